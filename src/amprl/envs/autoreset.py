"""Gymnasium's SAME_STEP autoreset, as the n-step chunker takes its frames: the step that
ends an episode reports the final frame and the next episode's first frame together."""

from __future__ import annotations

import numpy as np


def same_step_frames(obs: np.ndarray, terminated, truncated, info: dict
                     ) -> tuple[np.ndarray, np.ndarray | None]:
    """``(next_frames, reset_frames)`` for ``NStepChunker.step`` from a gymnasium vector env
    in SAME_STEP autoreset mode, where ``obs`` already holds the next episode's first frame
    for ended envs and ``info["final_obs"]`` their final frame."""
    done = np.logical_or(terminated, truncated)
    if not done.any():
        return obs, None
    final = info["final_obs"]
    next_frames = np.array(obs, copy=True)
    for i in np.flatnonzero(done):
        next_frames[i] = final[i]
    return next_frames, obs
