"""Frame stacks for a batch of environments, as the policy sees them.

Replay stores frames once and rebuilds stacks from indices; actors and the evaluator keep
the last ``frame_stack`` frames of each env here to feed the network. At reset the stack is
filled with the first frame (the convention the n-step chunker uses too).
"""

from __future__ import annotations

import numpy as np

from amprl.envs.spec import EnvSpec


class FrameStacks:
    def __init__(self, num_envs: int, spec: EnvSpec):
        self.k = spec.frame_stack
        self.buf = np.zeros((num_envs, self.k, *spec.frame_shape), dtype=spec.frame_dtype)

    def reset(self, i: int, frame: np.ndarray) -> None:
        self.buf[i] = frame

    def push(self, i: int, frame: np.ndarray) -> None:
        if self.k > 1:
            self.buf[i, :-1] = self.buf[i, 1:]
        self.buf[i, -1] = frame

    def observations(self, idx=None) -> np.ndarray:
        """[len(idx), *obs_shape]: the frame itself when frame_stack == 1."""
        b = self.buf if idx is None else self.buf[idx]
        return b[:, 0] if self.k == 1 else b
