"""NStepChunker: n-step returns and discounts, episode ends, frame stacks, chunk packing."""

from __future__ import annotations

import numpy as np
import pytest

from amprl.actor.nstep import NStepChunker
from amprl.envs.autoreset import same_step_frames
from amprl.rl.transitions import stacked
from amprl.envs.spec import EnvSpec
from amprl.v1 import replay_pb2
from amprl.wire.transitions import chunk_from_proto, chunk_to_proto


def frame(env: int, ep: int, step: int) -> np.ndarray:
    """A vector frame that names where it came from."""
    return np.array([env, ep, step], dtype=np.float32)


def all_transitions(chunks, stack):
    """Decodes chunks into (obs, action, reward, discount, next_obs) tuples of frame tuples."""
    out = []
    for c in chunks:
        obs = c.frames[c.obs_idx]        # [T, stack, 3]
        nxt = c.frames[c.next_obs_idx]
        for t in range(len(c)):
            act = c.actions[t]
            act = tuple(np.atleast_1d(act).tolist())
            out.append((tuple(map(tuple, obs[t].tolist())), act, float(c.rewards[t]),
                        float(c.discounts[t]), tuple(map(tuple, nxt[t].tolist()))))
    return out


def single_env_chunks(rewards, *, n, gamma, stack=1, terminated=True, chunk=100):
    ch = NStepChunker(1, n, gamma, stack, chunk)
    ch.reset(frame(0, 0, 0)[None])
    chunks = []
    L = len(rewards)
    for k, r in enumerate(rewards):
        end = k == L - 1
        chunks += ch.step(np.array([k % 2]), np.array([r]), np.array([end and terminated]),
                          np.array([end and not terminated]), frame(0, 0, k + 1)[None],
                          frame(0, 1, 0)[None] if end else None)
    last = ch.flush()
    return chunks + ([last] if last is not None else []), ch


def test_nstep_returns_and_discount_zero_after_termination():
    chunks, _ = single_env_chunks([1.0, 2.0, 3.0, 4.0], n=3, gamma=0.5, terminated=True)
    tr = all_transitions(chunks, 1)
    got = {o[0][2]: (r, d, nx[0][2]) for o, _, r, d, nx in tr}
    # start step -> (n-step return, discount, step of the bootstrap observation)
    assert got == {0: (1 + 0.5 * 2 + 0.25 * 3, 0.125, 3),
                   1: (2 + 0.5 * 3 + 0.25 * 4, 0.0, 4),
                   2: (3 + 0.5 * 4, 0.0, 4),
                   3: (4.0, 0.0, 4)}


def test_truncation_bootstraps_from_final_frame_with_gamma_k():
    chunks, _ = single_env_chunks([1.0, 2.0, 3.0, 4.0], n=3, gamma=0.5, terminated=False)
    got = {o[0][2]: (r, d, nx[0][2]) for o, _, r, d, nx in all_transitions(chunks, 1)}
    assert got == {0: (2.75, 0.125, 3), 1: (4.5, 0.125, 4), 2: (5.0, 0.25, 4), 3: (4.0, 0.5, 4)}


def test_episode_shorter_than_n_flushes_every_step():
    chunks, _ = single_env_chunks([1.0, 1.0], n=5, gamma=0.9, terminated=True)
    got = sorted((o[0][2], r, d) for o, _, r, d, _ in all_transitions(chunks, 1))
    assert got == [(0, pytest.approx(1.9), 0.0), (1, 1.0, 0.0)]


def test_frame_stack_pads_episode_start_with_first_frame_stored_once():
    ch = NStepChunker(1, 1, 0.9, 3, 2)
    ch.reset(frame(0, 0, 0)[None])
    np.testing.assert_array_equal(ch.observations()[0], [frame(0, 0, 0)] * 3)
    chunks = []
    for k in range(2):
        chunks += ch.step(np.array([0]), np.array([0.0]), np.array([False]), np.array([False]),
                          frame(0, 0, k + 1)[None])
    (c,) = chunks
    assert c.frames.shape == (3, 3)            # f0, f1, f2 once each
    np.testing.assert_array_equal(c.obs_idx[0], [0, 0, 0])
    np.testing.assert_array_equal(c.next_obs_idx[0], [0, 0, 1])
    np.testing.assert_array_equal(c.obs_idx[1], [0, 0, 1])
    np.testing.assert_array_equal(c.next_obs_idx[1], [0, 1, 2])
    np.testing.assert_array_equal(stacked(c.frames, c.next_obs_idx)[1],
                                  [frame(0, 0, 0), frame(0, 0, 1), frame(0, 0, 2)])


def test_new_episode_stack_restarts_from_reset_frame():
    ch = NStepChunker(1, 1, 0.9, 2, 1)
    ch.reset(frame(0, 0, 0)[None])
    ch.step([0], [1.0], [False], [False], frame(0, 0, 1)[None])
    (c,) = ch.step([0], [1.0], [True], [False], frame(0, 0, 2)[None], frame(0, 1, 0)[None])
    np.testing.assert_array_equal(stacked(c.frames, c.next_obs_idx)[0], [frame(0, 0, 1), frame(0, 0, 2)])
    np.testing.assert_array_equal(ch.observations()[0], [frame(0, 1, 0)] * 2)
    (c,) = ch.step([1], [1.0], [False], [False], frame(0, 1, 1)[None])
    np.testing.assert_array_equal(stacked(c.frames, c.obs_idx)[0], [frame(0, 1, 0)] * 2)
    np.testing.assert_array_equal(c.obs_idx[0], [0, 0])


def test_step_requires_reset_frames_when_an_episode_ends():
    ch = NStepChunker(2, 1, 0.9, 1, 2)
    ch.reset(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="reset_frames"):
        ch.step([0, 0], [0.0, 0.0], [True, False], [False, False], np.zeros((2, 3), np.float32))
    # the rejected call changed nothing: the same step with its reset frames goes through
    (c,) = ch.step([0, 0], [1.0, 2.0], [True, False], [False, False], np.ones((2, 3), np.float32),
                   np.full((2, 3), 5, np.float32))
    assert len(c) == 2 and c.frames.shape[0] == 4 and ch.observations()[0].tolist() == [5, 5, 5]


def test_step_before_reset_is_an_error():
    with pytest.raises(RuntimeError, match="reset"):
        NStepChunker(1, 1, 0.9, 1, 8).step([0], [0.0], [False], [False], np.zeros((1, 3)))


def assert_same_transitions(got, want):
    """Same transitions (keyed by their unique observation stacks), rewards to float32 precision."""
    def keyed(ts):
        out = {}
        for o, a, r, d, nx in ts:
            key = (o, tuple(round(float(x), 5) for x in a), nx)
            assert key not in out, f"duplicate transition {key}"
            out[key] = (r, d)
        return out
    g, w = keyed(got), keyed(want)
    assert set(g) == set(w), (sorted(set(g) - set(w))[:3], sorted(set(w) - set(g))[:3])
    for k in w:
        np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-5, err_msg=str(k))


# ---------------------------------------------------------------- reference comparison

def reference(episodes, *, n, gamma, stack):
    """Transitions computed the slow, obvious way from whole episodes."""
    out = []
    for ep in episodes:
        frames, acts, rews, end = ep["frames"], ep["actions"], ep["rewards"], ep["end"]
        L = len(rews)

        def stack_at(j):
            return tuple(tuple(frames[max(0, k)].tolist()) for k in range(j - stack + 1, j + 1))

        for j in range(L):
            K = min(n, L - j)
            if K < n and end is None:
                continue  # window still open at the end of the run
            ret = sum(gamma ** k * rews[j + k] for k in range(K))
            disc = 0.0 if (end == "term" and j + K == L) else gamma ** K
            out.append((stack_at(j), tuple(np.atleast_1d(acts[j]).tolist()), ret, disc,
                        stack_at(j + K)))
    return out


def run_random(num_envs, n, gamma, stack, chunk_transitions, steps, seed, *,
               continuous=False, truncate_at_end=False):
    rng = np.random.default_rng(seed)
    ch = NStepChunker(num_envs, n, gamma, stack, chunk_transitions)
    ep_idx = [0] * num_envs
    t_in_ep = [0] * num_envs
    episodes = {(i, 0): {"frames": [frame(i, 0, 0)], "actions": [], "rewards": [], "end": None}
                for i in range(num_envs)}
    ch.reset(np.stack([frame(i, 0, 0) for i in range(num_envs)]))
    chunks = []
    for _ in range(steps):
        np.testing.assert_array_equal(
            ch.observations().reshape(num_envs, stack, 3)[:, -1],
            np.stack([episodes[(i, ep_idx[i])]["frames"][-1] for i in range(num_envs)]))
        acts = (rng.uniform(-1, 1, (num_envs, 2)).astype(np.float32) if continuous
                else rng.integers(0, 4, num_envs))
        rews = rng.normal(size=num_envs).round(2)
        term = rng.random(num_envs) < 0.05
        trunc = ~term & (rng.random(num_envs) < 0.05)
        nxt, rst = [], []
        for i in range(num_envs):
            ep = episodes[(i, ep_idx[i])]
            t_in_ep[i] += 1
            f = frame(i, ep_idx[i], t_in_ep[i])
            ep["frames"].append(f)
            ep["actions"].append(acts[i])
            ep["rewards"].append(rews[i])
            nxt.append(f)
            if term[i] or trunc[i]:
                ep["end"] = "term" if term[i] else "trunc"
                ep_idx[i] += 1
                t_in_ep[i] = 0
                r = frame(i, ep_idx[i], 0)
                episodes[(i, ep_idx[i])] = {"frames": [r], "actions": [], "rewards": [], "end": None}
                rst.append(r)
            else:
                rst.append(np.full(3, -1, np.float32))
        chunks += ch.step(acts, rews, term, trunc, np.stack(nxt),
                          np.stack(rst) if (term | trunc).any() else None)
    for c in chunks:
        assert len(c) == chunk_transitions
    last = ch.flush(truncate_pending=truncate_at_end)
    if last is not None:
        chunks.append(last)
    if truncate_at_end:
        for ep in episodes.values():
            if ep["end"] is None:
                ep["end"] = "trunc"
    return chunks, list(episodes.values()), ch


@pytest.mark.parametrize("num_envs,n,stack,chunk", [
    (1, 1, 1, 1), (3, 3, 1, 7), (4, 3, 4, 16), (5, 5, 2, 64), (2, 2, 4, 3), (8, 1, 4, 32),
])
def test_matches_reference_over_random_episodes(num_envs, n, stack, chunk):
    gamma = 0.9
    chunks, episodes, ch = run_random(num_envs, n, gamma, stack, chunk, 400, seed=n * 10 + stack)
    want = reference(episodes, n=n, gamma=gamma, stack=stack)
    assert_same_transitions(all_transitions(chunks, stack), want)
    assert ch.transitions_emitted == len(want)


def test_flush_truncating_pending_accounts_for_every_env_step():
    chunks, episodes, ch = run_random(4, 3, 0.99, 2, 10, 300, seed=7, truncate_at_end=True)
    assert sum(len(c) for c in chunks) == ch.env_steps == 4 * 300
    want = reference(episodes, n=3, gamma=0.99, stack=2)
    assert_same_transitions(all_transitions(chunks, 2), want)


def test_continuous_actions_keep_their_vectors():
    chunks, episodes, _ = run_random(3, 2, 0.9, 1, 16, 200, seed=3, continuous=True)
    assert chunks[0].actions.dtype == np.float32 and chunks[0].actions.shape == (16, 2)
    want = reference(episodes, n=2, gamma=0.9, stack=1)
    assert_same_transitions(all_transitions(chunks, 1), want)


def test_chunks_store_each_frame_once_and_are_self_contained():
    chunks, _, _ = run_random(4, 3, 0.9, 4, 16, 300, seed=11)
    assert len(chunks) > 10
    for c in chunks:
        # every frame is distinct and used; the replay gate's bound holds
        assert len({tuple(f) for f in c.frames.tolist()}) == c.frames.shape[0]
        used = np.union1d(c.obs_idx.ravel(), c.next_obs_idx.ravel())
        np.testing.assert_array_equal(used, np.arange(c.frames.shape[0]))
        assert c.frames.shape[0] <= 2 * 4 * len(c)
        assert c.obs_idx.dtype == np.int32 and c.next_obs_idx.dtype == np.int32
        assert c.rewards.dtype == np.float32 and c.discounts.dtype == np.float32
        assert c.actions.dtype == np.int64


def test_chunks_pass_the_replay_wire_gate_with_uint8_frames():
    spec = EnvSpec((84, 84), np.dtype(np.uint8), 4, True, num_actions=6)
    rng = np.random.default_rng(0)
    ch = NStepChunker(2, 3, 0.99, 4, 8)
    ch.reset(rng.integers(0, 255, (2, 84, 84), dtype=np.uint8))
    chunks = []
    for k in range(40):
        done = np.array([k == 20, False])
        chunks += ch.step(rng.integers(0, 6, 2), rng.normal(size=2), done, [False, False],
                          rng.integers(0, 255, (2, 84, 84), dtype=np.uint8),
                          rng.integers(0, 255, (2, 84, 84), dtype=np.uint8) if done.any() else None)
    assert chunks and chunks[0].frames.dtype == np.uint8
    for c in chunks:
        back = chunk_from_proto(chunk_to_proto(c, replay_pb2.TransitionBatch()), spec)
        np.testing.assert_array_equal(back.frames[back.obs_idx], c.frames[c.obs_idx])
        assert stacked(c.frames, c.obs_idx).shape == (8, 4, 84, 84)


def test_log_compaction_and_growth_keep_old_frames_reachable():
    # Long run, one env, chunk much larger than the initial log: forces growth + compaction.
    chunks, episodes, _ = run_random(1, 3, 0.5, 4, 200, 2000, seed=5)
    want = reference(episodes, n=3, gamma=0.5, stack=4)
    assert_same_transitions(all_transitions(chunks, 4), want)


def test_frame_log_grows_when_full():
    ch = NStepChunker(2, 3, 0.9, 2, 1000)
    ch.reset(np.stack([frame(i, 0, 0) for i in range(2)]))
    ch._log._frames = ch._log._frames[:4].copy()  # shrink the log: the next appends must grow it
    for k in range(300):
        ch.step([0, 1], [1.0, 1.0], [False, False], [False, False],
                np.stack([frame(i, 0, k + 1) for i in range(2)]))
    c = ch.flush()
    assert len(c) == 2 * 298
    np.testing.assert_array_equal(stacked(c.frames, c.obs_idx)[:, -1, 2] + 3,
                                  stacked(c.frames, c.next_obs_idx)[:, -1, 2])
    assert ch.observations()[1, -1].tolist() == [1, 0, 300]
    assert ch._log.capacity > 4


def test_gymnasium_same_step_vector_env_round_trip():
    gym = pytest.importorskip("gymnasium")
    from gymnasium.vector import AutoresetMode

    envs = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP})
    ch = NStepChunker(3, 1, 0.99, 1, 32)
    obs, _ = envs.reset(seed=0)
    ch.reset(obs)
    chunks, ends = [], 0
    rng = np.random.default_rng(0)
    for _ in range(300):
        np.testing.assert_array_equal(ch.observations(), obs)
        a = rng.integers(0, 2, 3)
        obs, r, term, trunc, info = envs.step(a)
        ends += int((term | trunc).sum())
        nxt, rst = same_step_frames(obs, term, trunc, info)
        chunks += ch.step(a, r, term, trunc, nxt, rst)
    envs.close()
    last = ch.flush(truncate_pending=True)
    chunks += [last] if last is not None else []
    assert ends > 5
    assert sum(len(c) for c in chunks) == 900
    disc = np.concatenate([c.discounts for c in chunks])
    assert (disc == 0).sum() == ends  # CartPole episodes only terminate within 300 steps
    for c in chunks:  # a 1-step transition moves the cart by at most a small amount
        s, s2 = c.frames[c.obs_idx[:, 0]], c.frames[c.next_obs_idx[:, 0]]
        assert np.abs(s2[:, 0] - s[:, 0]).max() < 0.1


def test_from_config_reads_the_algorithm_settings():
    from amprl.config import load_config

    cfg = load_config(overrides=["dqn.n_step=5", "env.frame_stack=2", "actor.chunk_transitions=9"])
    ch = NStepChunker.from_config(cfg, num_envs=3)
    assert (ch.num_envs, ch.n_step, ch.gamma, ch.frame_stack, ch.chunk_transitions) == (3, 5, 0.99, 2, 9)


# ---------------------------------------------------------------- scoring with acting Q-values

def qfun(obs: np.ndarray) -> np.ndarray:
    """A made-up Q(s, ·) over 4 actions, a deterministic function of each observation."""
    x = obs.reshape(obs.shape[0], -1).astype(np.float64).sum(axis=1)
    return np.sin(0.37 * x[:, None] + np.arange(4)).astype(np.float32)


@pytest.mark.parametrize("num_envs,n,stack,chunk", [(1, 1, 1, 1), (3, 3, 1, 7), (4, 3, 4, 16), (5, 2, 2, 9)])
def test_step_scored_gives_step_chunks_with_td_errors_of_the_acting_values(num_envs, n, stack, chunk):
    """The chunks of step_scored are those of step (one call later), scored with
    |R + D max_a Q(next_obs, a) - Q(obs, a)| of the Q-values the caller acted on."""
    gamma, rng = 0.9, np.random.default_rng(n * 10 + stack)
    plain, scored = (NStepChunker(num_envs, n, gamma, stack, chunk) for _ in range(2))
    first = np.stack([frame(i, 0, 0) for i in range(num_envs)])
    plain.reset(first)
    scored.reset(first)
    ep, t_in_ep = np.zeros(num_envs, int), np.zeros(num_envs, int)
    got_plain, got_scored = [], []
    for _ in range(300):
        obs = scored.observations()
        np.testing.assert_array_equal(obs, plain.observations())
        q = qfun(obs)
        acts = rng.integers(0, 4, num_envs)
        rews = rng.normal(size=num_envs).round(2)
        term = rng.random(num_envs) < 0.05
        trunc = ~term & (rng.random(num_envs) < 0.05)
        t_in_ep += 1
        nxt = np.stack([frame(i, ep[i], t_in_ep[i]) for i in range(num_envs)])
        ep[term | trunc] += 1
        t_in_ep[term | trunc] = 0
        rst = np.stack([frame(i, ep[i], 0) for i in range(num_envs)])
        final = None
        if trunc.any():
            final = np.full(num_envs, np.nan, np.float32)  # rows not truncated are ignored
            final[trunc] = qfun(scored.final_observations(nxt, trunc)).max(axis=1)
        got_plain += plain.step(acts, rews, term, trunc, nxt, rst)
        got_scored += scored.step_scored(acts, rews, term, trunc, nxt, rst,
                                         q_taken=q[np.arange(num_envs), acts], values=q.max(axis=1),
                                         final_values=final)
    assert len(got_scored) >= max(1, len(got_plain) - 1)
    for (c, td), p in zip(got_scored, got_plain):
        for name in ("frames", "obs_idx", "next_obs_idx", "actions", "rewards", "discounts"):
            np.testing.assert_array_equal(getattr(c, name), getattr(p, name), err_msg=name)
        obs, nxt = stacked(c.frames, c.obs_idx), stacked(c.frames, c.next_obs_idx)
        want = np.abs(c.rewards + c.discounts * qfun(nxt).max(axis=1)
                      - qfun(obs)[np.arange(len(c)), c.actions])
        assert td.dtype == np.float32 and td.shape == (len(c),)
        np.testing.assert_allclose(td, want, rtol=1e-5, atol=1e-6)


def test_step_scored_requires_final_values_for_truncations_and_no_mixing():
    ch = NStepChunker(2, 1, 0.9, 1, 4)
    ch.reset(np.zeros((2, 3), np.float32))
    z = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="final_values"):
        ch.step_scored([0, 0], [0.0, 0.0], [False, False], [True, False], np.ones((2, 3), np.float32),
                       np.ones((2, 3), np.float32), q_taken=z, values=z)
    with pytest.raises(RuntimeError, match="mixed"):
        ch.step([0, 0], [0.0, 0.0], [False, False], [False, False], np.ones((2, 3), np.float32))
    with pytest.raises(RuntimeError, match="scored"):
        ch.flush()
