"""The Atari factory on real ALE games: DQN preprocessing, training-only wrappers."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ale_py")

from amprl.config import EnvConfig  # noqa: E402
from amprl.envs.atari import AreaResize, area_weights  # noqa: E402
from amprl.envs.factory import env_spec, make_env  # noqa: E402


def _pair(game: str, seed: int = 3):
    cfg = EnvConfig(id=f"ALE/{game}-v5", frame_stack=4)
    train = make_env(cfg, training=True)
    evaluation = make_env(cfg, training=False)
    f_train, _ = train.reset(seed=seed)
    f_eval, _ = evaluation.reset(seed=seed)
    return train, evaluation, f_train, f_eval


def test_pong_spec_is_single_84x84_uint8_frames_stacked_by_four():
    spec = env_spec(EnvConfig(id="ALE/Pong-v5", frame_stack=4))
    assert spec.frame_shape == (84, 84)
    assert spec.frame_dtype == np.uint8
    assert spec.frame_stack == 4 and spec.obs_shape == (4, 84, 84)
    assert spec.discrete and spec.num_actions == 6


def test_pong_frames_are_grayscale_84x84_uint8_with_v5_sticky_actions():
    env = make_env(EnvConfig(id="ALE/Pong-v5"), seed=0)
    frame, info = env.reset(seed=0)
    assert frame.shape == (84, 84) and frame.dtype == np.uint8
    assert frame.max() > frame.min()  # a real screen, not a blank
    assert env.unwrapped.ale.getFloat("repeat_action_probability") == pytest.approx(0.25)
    frame2, reward, terminated, truncated, _ = env.step(2)
    assert frame2.shape == (84, 84) and frame2.dtype == np.uint8
    assert isinstance(reward, float) and not terminated and not truncated


def test_one_agent_step_is_four_emulator_frames():
    env = make_env(EnvConfig(id="ALE/Pong-v5"), seed=0)
    env.reset(seed=0)
    ale = env.unwrapped.ale
    before = ale.getEpisodeFrameNumber()
    env.step(0)
    assert ale.getEpisodeFrameNumber() - before == 4


def test_noop_starts_vary_the_first_frame_number_with_the_seed():
    env = make_env(EnvConfig(id="ALE/Pong-v5"))
    ale = env.unwrapped.ale
    starts = set()
    for seed in range(6):
        env.reset(seed=seed)
        n = ale.getEpisodeFrameNumber()
        assert 1 <= n <= 30
        starts.add(n)
    assert len(starts) > 1


def test_rewards_are_clipped_in_training_and_real_in_evaluation():
    # SpaceInvaders pays 5-30 points per alien: clipping shows at once under random play.
    train, evaluation, f_train, f_eval = _pair("SpaceInvaders")
    np.testing.assert_array_equal(f_train, f_eval)  # same seed, same game
    rng = np.random.default_rng(0)
    raw, clipped = [], []
    for _ in range(2000):
        a = int(rng.integers(train.action_space.n))
        _, r_train, term_train, trunc_train, _ = train.step(a)
        _, r_eval, term_eval, trunc_eval, _ = evaluation.step(a)
        raw.append(r_eval)
        clipped.append(r_train)
        if term_train or trunc_train or term_eval or trunc_eval:
            break
    raw, clipped = np.array(raw), np.array(clipped)
    assert raw.max() > 1.0, "random play should have scored a multi-point alien"
    np.testing.assert_array_equal(clipped, np.sign(raw))


def test_a_lost_life_ends_the_training_episode_only_and_the_game_goes_on():
    train, evaluation, _, _ = _pair("Breakout")
    lives0 = train.unwrapped.ale.lives()
    assert lives0 == 5
    rng = np.random.default_rng(1)
    for step in range(5000):
        a = int(rng.integers(train.action_space.n))
        _, _, term_train, _, info_train = train.step(a)
        _, _, term_eval, _, info_eval = evaluation.step(a)
        if term_train:
            break
    else:
        pytest.fail("no life lost in 5000 random steps")
    assert info_train["lives"] == lives0 - 1 and not info_train["game_over"]
    assert not term_eval and info_eval["lives"] == lives0 - 1  # evaluation plays on
    # reset after a life loss continues the same game instead of restarting it
    frames_before = train.unwrapped.ale.getEpisodeFrameNumber()
    frame, info = train.reset()
    assert frame.shape == (84, 84)
    assert info["lives"] == lives0 - 1
    assert train.unwrapped.ale.getEpisodeFrameNumber() > frames_before


def test_training_episodes_end_at_every_life_and_the_game_restarts_after_the_last():
    env = make_env(EnvConfig(id="ALE/Breakout-v5"), training=True)
    env.reset(seed=5)
    rng = np.random.default_rng(2)
    lives_at_end = []
    while len(lives_at_end) < 5:
        _, _, terminated, truncated, info = env.step(int(rng.integers(4)))
        if terminated or truncated:
            lives_at_end.append(info["lives"])
            env.reset()
    assert lives_at_end == [4, 3, 2, 1, 0]
    assert env.unwrapped.ale.lives() == 5  # a new game


def test_area_resize_averages_pixel_areas():
    frame = np.random.default_rng(0).integers(0, 256, (210, 160), dtype=np.uint8)
    resize = AreaResize((210, 160), (84, 84))
    out = resize(frame)
    assert out.shape == (84, 84) and out.dtype == np.uint8
    dense = area_weights(210, 84) @ frame.astype(np.float64) @ area_weights(160, 84).T
    assert np.abs(out.astype(np.float64) - dense).max() <= 0.51
    flat = np.full((210, 160), 77, dtype=np.uint8)
    assert (resize(flat) == 77).all()
    w = area_weights(210, 84)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
    assert (w[0, :2] == pytest.approx(0.4)) and w[0, 2] == pytest.approx(0.2)
