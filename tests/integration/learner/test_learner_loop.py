"""The real Learner against a real replay service (real Redis) and a real parameter server."""

from __future__ import annotations

import os
import logging
import threading
import time

import numpy as np
import pytest
import torch

from amprl.common.redis_server import EmbeddedRedis
from amprl.wire.compressed import encode
from amprl.config import load_config
from amprl.errors import ConfigError
from amprl.envs.factory import env_spec
from amprl.learner.learner import Learner
from amprl.paramserver.client import ParameterClient
from amprl.paramserver.service import create_server as create_ps
from amprl.replay.client import ReplayClient
from amprl.replay.service import create_server as create_replay
from amprl.algos import build_model
from amprl.rl.transitions import Chunk


def _chunk(spec, rng, T=200, nan_rewards=False):
    frames = rng.standard_normal((T + 3, *spec.frame_shape)).astype(np.float32)
    idx = np.arange(T, dtype=np.int32)[:, None]
    rewards = np.ones(T, np.float32)
    chunk = Chunk(frames, idx, idx + 3, rng.integers(spec.num_actions, size=T).astype(np.int64),
                  rewards, np.full(T, 0.97, np.float32))
    return chunk, np.full(T, 1.0, np.float32), T


@pytest.fixture
def system(tmp_path):
    started = []

    def start(*overrides):
        cfg = load_config(None, ["replay.min_size_to_sample=100", "learner.batch_size=32",
                                 "paramserver.checkpoint_interval_s=0", *overrides])
        spec = env_spec(cfg.env)
        redis = EmbeddedRedis(tmp_path / "redis")
        started.append(redis.stop)
        rs = create_replay(cfg, spec, redis.url, "127.0.0.1", 0, seed=0)
        port = rs.port
        started.append(lambda: rs.stop(0))
        torch.manual_seed(cfg.run.seed)
        ps = create_ps(cfg, build_model(cfg, spec), host="127.0.0.1", port=0)
        started.append(ps.stop)
        replay = ReplayClient(f"127.0.0.1:{port}")
        started.append(replay.close)
        rng = np.random.default_rng(0)
        replay.insert("test", [_chunk(spec, rng) for _ in range(5)], timeout=30)
        psc = ParameterClient(f"127.0.0.1:{ps.port}", client_id="learner:test")
        started.append(psc.close)
        learner = Learner(cfg, spec, ReplayClient(f"127.0.0.1:{port}"), psc, device="cpu")
        started.append(learner.stop)
        return learner, replay, psc

    try:
        yield start
    finally:
        for stop in reversed(started):
            stop()


def _run_updates(learner, n, timeout=60):
    stop = threading.Event()
    t = threading.Timer(timeout, stop.set)
    t.start()
    learner.run(stop, max_updates=n)
    t.cancel()


def test_updates_push_gradients_and_advance_the_version(system):
    learner, replay, ps = system()
    learner.start()
    _run_updates(learner, 30)
    learner.stop()
    assert learner.stats.updates == 30
    assert ps.info().version >= 30
    assert learner.stats.grad_norm > 0  # the pre-clip norm is recorded
    deadline = time.monotonic() + 10
    while replay.info().priority_updates_total == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replay.info().priority_updates_total > 0


def test_the_learner_logs_a_progress_line_with_its_rates_loss_q_and_staleness(system, caplog):
    learner, _, _ = system()
    learner.log_every_s = 0.0  # a line after every update
    learner.start()
    with caplog.at_level(logging.INFO, logger="amprl.learner.learner"):
        _run_updates(learner, 5)
    learner.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("updates ")]
    assert len(lines) == 5
    assert lines[-1].startswith("updates 5 (") and "loss " in lines[-1] and "Q " in lines[-1]
    assert "staleness " in lines[-1] and "pushes applied " in lines[-1]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_updates_run_on_cpu(system, precision):
    learner, _, ps = system(f"learner.precision={precision}")
    learner.start()
    _run_updates(learner, 10)
    learner.stop()
    assert learner.stats.updates == 10 and ps.info().version >= 10
    if precision == "fp16":
        assert learner.precision.scale == 65536.0  # GradScaler init scale, no overflow yet


def test_non_finite_gradients_are_skipped_and_never_pushed(system):
    learner, _, ps = system()
    learner.start()
    _run_updates(learner, 2)
    learner.pushes.drain(0)
    version = ps.info().version
    batch, keys = learner.feed.batches.get(timeout=30)
    batch.rewards[:] = float("nan")
    learner.update((batch, keys))
    learner.pushes.drain(0)
    assert learner.stats.skipped_nonfinite == 1
    assert ps.info().version == version
    assert ps.info().pushes_rejected_invalid == 0


def test_fp16_overflow_backs_off_the_loss_scale_and_skips_the_step(system):
    # A quadratic loss (Huber with a huge delta): dL/dQ = (Q - y) / B, so with y ~ 6e4 the
    # gradient scaled by 65536 is ~1e8, beyond fp16 whatever batch is drawn. (With Huber's
    # delta 1 the scaled gradient per sample is bounded by 65536 / B, and whether a layer's
    # sum of those overflowed depended on the prioritized draw: flaky.)
    learner, _, ps = system("learner.precision=fp16", "dqn.huber_delta=1000000.0")
    learner.start()
    _run_updates(learner, 1)
    learner.pushes.drain(0)
    version = ps.info().version
    skipped, scale = learner.stats.skipped_nonfinite, learner.precision.scale
    batch, keys = learner.feed.batches.get(timeout=30)
    batch.rewards[:] = 6e4
    learner.update((batch, keys))
    learner.pushes.drain(0)
    assert learner.stats.skipped_nonfinite == skipped + 1
    assert learner.precision.scale == scale / 2 and scale <= 65536.0
    assert ps.info().version == version


@pytest.mark.parametrize("encoding", ["fp32", "onebit"])
def test_apply_locally_keeps_the_replica_on_the_servers_weights_with_a_wide_window(system, encoding):
    """With sync: local_replica the learner steps its replica as the server will: with one
    learner every push arrives at staleness 0 even with 8 pushes in flight, the re-bases
    find (almost) nothing to correct, and at the end the replica is the server's weights."""
    learner, _, ps = system("learner.sync=local_replica", "learner.max_pushes_in_flight=8",
                            "learner.pull_lag_versions=4", f"learner.grad_encoding={encoding}",
                            "paramserver.max_staleness=16")
    learner.start()
    _run_updates(learner, 40)
    learner.stop()
    info = ps.info()
    assert info.version == learner.stats.pushes == 40 and learner.version == 40
    assert info.max_staleness == 0 and info.pushes_applied == 40
    assert learner.stats.rebases >= 2 and learner.stats.rebase_drift < 1e-5
    version, weights = ps.pull(have_version=0)
    assert version == 40
    for name, p in learner.model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("window", [1, 4])
def test_steps_per_push_sends_consecutive_steps_in_one_call_and_the_server_matches(system, window):
    """learner.steps_per_push 4: 4 optimizer steps per PushGradients call, each its own
    version on the server, applied in the order they were computed. The server ends on the
    replica's weights (every step at staleness 0) after 1/4 of the calls."""
    learner, _, ps = system("learner.sync=local_replica", f"learner.max_pushes_in_flight={window}",
                            "learner.pull_lag_versions=8", "learner.steps_per_push=4",
                            "paramserver.max_staleness=16")
    learner.start()
    _run_updates(learner, 42)
    learner.stop()  # sends the 2 steps still held back
    info = ps.info()
    assert info.version == learner.stats.pushes == 42 and learner.version == 42
    assert info.pushes_applied == 42 and info.max_staleness == 0 and info.transitions_trained == 42 * 32
    assert learner.stats.stale_rejections == 0 and learner.stats.push_errors == 0
    # ~10 full calls and the remainder (a dry prefetch queue may send a call early)
    assert 11 <= learner.stats.push_calls < 42
    assert learner.stats.rebases >= 2 and learner.stats.rebase_drift < 1e-5
    version, weights = ps.pull(have_version=0)
    assert version == 42
    for name, p in learner.model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=1e-5)


def test_apply_locally_steps_the_replica_in_place_and_keeps_only_the_changes_a_rebase_needs(system):
    """The local store steps the model's own weights; the weight change of a push is kept
    only while a reply that brings weights is awaited or waits to be taken (the pushes a
    re-base adds back), not for every push -- and the replica still ends on the server's."""
    learner, _, ps = system("learner.sync=local_replica", "learner.max_pushes_in_flight=2",
                            "learner.pull_lag_versions=16", "paramserver.max_staleness=16")
    for name, p in learner.model.named_parameters():
        assert learner.weights.local.params[name].data_ptr() == p.data_ptr()
    kept = []
    deltas = learner.weights.deltas

    class Recording(type(deltas)):
        def append(self, item):
            kept.append(item[0])
            super().append(item)
    learner.weights.deltas = Recording(deltas)
    learner.start()
    _run_updates(learner, 64)
    learner.stop()
    assert learner.stats.rebases >= 4 and learner.stats.rebase_drift < 1e-5
    assert 0 < len(kept) < 32, kept  # a few pushes around each of the ~4 weights replies
    version, weights = ps.pull(have_version=0)
    assert version == 64 == learner.version
    for name, p in learner.model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=1e-5)


def test_apply_locally_rebases_onto_pushes_from_another_learner(system):
    """Another learner's push moves the server's weights: the next re-base folds that
    change into the replica, keeping the replica's own pushes in flight on top."""
    learner, _, ps = system("learner.sync=local_replica", "learner.max_pushes_in_flight=4",
                            "learner.pull_lag_versions=1")
    learner.start()
    _run_updates(learner, 5)
    learner.pushes.drain(0)
    other = ParameterClient(ps.address, client_id="learner:other")
    try:
        shapes = {n: p.shape for n, p in learner.model.named_parameters()}
        other.push(ps.info().version, [encode(n, torch.full(s, 1.0), "fp32") for n, s in shapes.items()])
    finally:
        other.close()
    _run_updates(learner, 15)  # 10 more
    learner.stop()
    learner.swap_in_weights()  # the weights the last reply that asked brought, if not taken yet
    version, weights = ps.pull(have_version=0)
    assert version == 16 and learner.version == 16
    assert learner.stats.rebase_drift > 1e-4  # the foreign step was found and folded in
    assert learner.stats.stale_rejections == 0 and learner.stats.resyncs == 0
    # the replica carries the foreign step; what is left is the server's Adam moments
    # (which saw the foreign gradient) stepping differently from the learner's copy over
    # the steps since the last re-base (how many depends on when replies came back): each
    # step under a few lr (1e-3), none when the last reply brought the final weights
    since = version - learner.weights.taken_version
    for name, p in learner.model.named_parameters():
        torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=1e-6 + 5e-3 * since)


@pytest.mark.parametrize("norm", ["table", "batch"])
def test_importance_weights_are_normalised_by_the_table_or_by_each_batch(system, norm):
    learner, replay, _ = system(f"replay.is_weight_normalization={norm}",
                                "learner.sample_batches_per_call=4")
    cfg = learner.cfg
    spec = env_spec(cfg.env)
    rng = np.random.default_rng(1)
    chunk, _, T = _chunk(spec, rng)
    prios = rng.uniform(0.01, 10.0, size=T).astype(np.float32)
    replay.insert("test", [(chunk, prios, T)], timeout=30)  # keys 1000..1199; 0..999 have p = 1
    p = np.concatenate([np.ones(1000, np.float32), prios])
    learner.start()
    batch, keys = learner.feed.batches.get(timeout=30)
    learner.stop()
    w = batch.weights.numpy()
    a, beta = cfg.replay.alpha, cfg.replay.beta_start
    raw = (p[keys] ** a) ** -beta
    expected = raw / (raw.max() if norm == "batch" else (p.min() ** a) ** -beta)
    np.testing.assert_allclose(w, expected, rtol=1e-4)
    assert (w.max() == 1.0) == (norm == "batch" or p[keys].min() == p.min())


def _affinity(tid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(tid)
    except OSError:
        return None  # the thread ended since the listing


def test_pin_update_thread_gives_the_update_thread_a_cpu_of_its_own(system):
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, "this test needs a machine with 2 or more CPUs"
    cpu, rest = allowed[0], set(allowed[1:])
    learner, _, ps = system("deploy.pin_learner_update_thread=true")
    learner.start()
    seen: dict = {}

    def train():  # the update thread: its own, so that pytest's thread is not pinned
        _run_updates(learner, 20)
        me = threading.get_native_id()
        seen["update"] = os.sched_getaffinity(0)
        # threads started during the updates (pushes, gRPC) are moved within 0.5 s
        deadline = time.monotonic() + 5
        while True:
            listed = ((int(t), _affinity(int(t))) for t in os.listdir("/proc/self/task"))
            others = {tid: cpus for tid, cpus in listed if tid != me and cpus is not None}
            if all(a == rest for a in others.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        seen["others"] = others

    t = threading.Thread(target=train)
    t.start()
    t.join(60)
    learner.stop()
    assert learner.stats.updates == 20 and ps.info().version >= 20
    assert seen["update"] == {cpu}
    assert {tid: rest for tid in seen["others"]} == seen["others"]
    assert os.sched_getaffinity(0) == set(allowed)  # stop() gave every thread all the CPUs back


def test_pin_update_thread_with_one_allowed_cpu_is_a_clear_error(system):
    errors: list = []

    def build():  # a thread allowed one CPU builds the learner
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        try:
            system("deploy.pin_learner_update_thread=true")
        except ConfigError as exc:
            errors.append(exc)

    t = threading.Thread(target=build)
    t.start()
    t.join(60)
    assert len(errors) == 1
    assert "deploy.pin_learner_update_thread" in str(errors[0]) and "needs a second one" in str(errors[0])
