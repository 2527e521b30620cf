"""RecordMp4: the first episode's rendered frames, as a playable MP4 at the env's frame rate."""

from __future__ import annotations

import imageio_ffmpeg
import numpy as np
import pytest

from amprl.config import EnvConfig
from amprl.envs.factory import make_env
from amprl.envs.video import RecordMp4


def read_mp4(path):
    """(frames [N, H, W, 3], fps) decoded by the same ffmpeg."""
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    frames = np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader])
    return frames, meta["fps"]


def test_the_first_episode_is_written_frame_by_frame_at_the_envs_rate(tmp_path):
    pytest.importorskip("pygame", reason="CartPole draws with pygame (gymnasium[classic-control])")
    env = RecordMp4(make_env(EnvConfig(id="CartPole-v1"), render_mode="rgb_array"), tmp_path / "ep.mp4")
    env.reset(seed=0)
    steps = 0
    while True:
        steps += 1
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            break
    env.reset(seed=1)  # a second episode is not recorded
    env.step(0)
    env.close()
    frames, fps = read_mp4(tmp_path / "ep.mp4")
    assert env.frames == steps + 1  # the reset's picture and one per step
    assert frames.shape == (steps + 1, 400, 600, 3) and fps == 50  # CartPole's render_fps
    assert frames.std() > 0  # a picture, not a blank


def test_an_env_without_rgb_frames_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rgb_array"):
        RecordMp4(make_env(EnvConfig(id="CartPole-v1")), tmp_path / "x.mp4")


def test_atari_frames_are_the_colour_screen_at_the_agent_step_rate(tmp_path):
    pytest.importorskip("ale_py")
    env = RecordMp4(make_env(EnvConfig(id="ALE/Pong-v5", max_episode_steps=5), training=False,
                             render_mode="rgb_array"), tmp_path / "pong.mp4")
    env.reset(seed=0)
    for _ in range(5):
        if any(env.step(0)[2:4]):
            break
    env.close()
    frames, fps = read_mp4(tmp_path / "pong.mp4")
    assert frames.shape[1:] == (210, 160, 3)  # not the 84x84 grayscale observation
    assert fps == 15  # 60 emulator frames/s, 4 per agent step
