"""An MP4 of one episode, as the environment draws it.

``RecordMp4`` wraps an env built with ``render_mode="rgb_array"`` and sends ``env.render()``
after the reset and after every step to ffmpeg (the binary inside the ``imageio-ffmpeg``
wheel: no system ffmpeg needed), until the first episode ends. The frames are the env's own
picture (Atari: the 210x160 colour screen), not the preprocessed or frame-stacked
observation the network sees; they play at the env's ``render_fps``.

MuJoCo draws offscreen through OpenGL: set ``MUJOCO_GL=egl`` (a GPU driver's libEGL) or
``MUJOCO_GL=osmesa`` (software, libOSMesa) before the process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

DEFAULT_FPS = 30.0
"""Frame rate of an env whose metadata names none."""


class RecordMp4(gym.Wrapper):
    """Writes the first episode's rendered frames to ``path`` (H.264, yuv420p)."""

    def __init__(self, env: gym.Env, path: str | Path):
        if env.render_mode != "rgb_array":
            raise ValueError(f"RecordMp4 needs an env made with render_mode='rgb_array', "
                             f"not {env.render_mode!r}")
        super().__init__(env)
        self.path = Path(path)
        self.frames = 0
        self._writer: Any = None  # the imageio-ffmpeg generator, opened at the first frame
        self._done = False

    def _write(self) -> None:
        frame = np.ascontiguousarray(self.env.render(), dtype=np.uint8)
        if self._writer is None:
            import imageio_ffmpeg
            h, w = frame.shape[:2]
            fps = float(self.metadata.get("render_fps") or DEFAULT_FPS)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # macro_block_size 2: yuv420p needs even sides; the default 16 would rescale
            # CartPole's 600x400 frames
            self._writer = imageio_ffmpeg.write_frames(str(self.path), (w, h), fps=fps,
                                                       codec="libx264", macro_block_size=2)
            self._writer.send(None)  # starts ffmpeg
        self._writer.send(frame)
        self.frames += 1

    def reset(self, **kwargs):
        out = self.env.reset(**kwargs)
        if not self._done:
            self._write()
        return out

    def step(self, action):
        out = self.env.step(action)
        if not self._done:
            self._write()
            if out[2] or out[3]:  # terminated or truncated: the video is complete
                self.finish()
        return out

    def finish(self) -> None:
        """Closes the file (ffmpeg writes the MP4 index); further frames are not recorded."""
        self._done = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        self.finish()
        super().close()
