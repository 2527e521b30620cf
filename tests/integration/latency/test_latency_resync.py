"""The learner re-syncs after FAILED_PRECONDITION and survives a parameter-server restart.

A real replay service (real Redis) in-process, the parameter server as its own OS process
(so it can be SIGKILLed and restarted from its checkpoint on the same port), the real
Learner in-process with 1-bit gradients and error feedback.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from amprl.common.redis_server import EmbeddedRedis
from amprl.wire.compressed import ErrorFeedback
from amprl.config import dump_config, load_config
from amprl.envs.factory import env_spec
from amprl.launch.procs import start_service, stop_services, wait_for_port
from amprl.learner.learner import Learner
from amprl.paramserver.client import ParameterClient
from amprl.replay.client import ReplayClient
from amprl.replay.service import create_server as create_replay
from amprl.rl.transitions import Chunk

OVERRIDES = ["replay.min_size_to_sample=100", "replay.samples_per_insert=0", "learner.batch_size=32",
             "learner.device=cpu", "learner.grad_encoding=onebit", "learner.onebit_min_elements=16",
             "learner.push_timeout_s=3", "learner.max_pushes_in_flight=0", "learner.max_batches_per_push=4",
             "paramserver.max_staleness=4", "paramserver.checkpoint_interval_s=0.5",
             "network.hidden_sizes=[32, 32]"]


def _chunk(spec, rng, T=200):
    frames = rng.standard_normal((T + 3, *spec.frame_shape)).astype(np.float32)
    idx = np.arange(T, dtype=np.int32)[:, None]
    chunk = Chunk(frames, idx, idx + 3, rng.integers(spec.num_actions, size=T).astype(np.int64),
                  np.ones(T, np.float32), np.full(T, 0.97, np.float32))
    return chunk, np.full(T, 1.0, np.float32), T


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


class System:
    def __init__(self, tmp_path):
        self.cfg = load_config(None, OVERRIDES)
        self.spec = env_spec(self.cfg.env)
        self.run_dir = tmp_path
        (tmp_path / "logs").mkdir()
        dump_config(self.cfg, tmp_path / "config.yaml")
        self.closers = []
        redis = EmbeddedRedis(tmp_path / "redis")
        self.closers.append(redis.stop)
        rs = create_replay(self.cfg, self.spec, redis.url, "127.0.0.1", 0, seed=0)
        self.closers.append(lambda: rs.stop(0))
        self.replay_addr = f"127.0.0.1:{rs.port}"
        with ReplayClient(self.replay_addr) as replay:
            rng = np.random.default_rng(0)
            replay.insert("test", [_chunk(self.spec, rng) for _ in range(5)], timeout=30)
        self.ps = None
        self.ps_port = 0
        self.start_ps()
        self.info = ParameterClient(f"127.0.0.1:{self.ps_port}", client_id="test-info")
        self.closers.append(self.info.close)

    def start_ps(self) -> None:
        args = ["--config", str(self.run_dir / "config.yaml"), "--run-dir", str(self.run_dir),
                "--host", "127.0.0.1", "--port", str(self.ps_port)]
        self.ps = start_service("paramserver", "amprl.paramserver", args, self.run_dir / "logs")
        self.ps_port = wait_for_port(self.ps)

    def kill_ps(self) -> None:
        os.killpg(self.ps.proc.pid, signal.SIGKILL)
        self.ps.proc.wait(timeout=10)

    def learner(self) -> Learner:
        learner = Learner(self.cfg, self.spec, ReplayClient(self.replay_addr),
                          ParameterClient(f"127.0.0.1:{self.ps_port}", client_id="learner:test"),
                          device="cpu")
        self.closers.append(lambda: (learner.stop(), learner.ps.close(), learner.replay.close()))
        return learner

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - tear everything down regardless
                pass
        if self.ps is not None:
            stop_services([self.ps])


@pytest.fixture
def system(tmp_path):
    s = System(tmp_path)
    try:
        yield s
    finally:
        s.close()


def _residuals(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in learner.compressor.residuals.items()}


def test_a_stale_push_is_rejected_and_the_learner_resyncs_and_goes_on(system):
    learner = system.learner()
    learner.start()
    for _ in range(5):
        assert learner.step(timeout=30)
    learner.pushes.drain(0)
    residuals = learner.compressor.residuals
    assert residuals and learner.compressor.residual_norm() > 0
    # another learner moves the server 6 versions on: our next push is 6+ > max_staleness 4 stale
    other = ErrorFeedback("fp32")
    zeros = {n: torch.zeros_like(p) for n, p in learner.model.named_parameters()}
    with ParameterClient(f"127.0.0.1:{system.ps_port}", client_id="learner:other") as ps2:
        for _ in range(6):
            ps2.push(ps2.info().version, other.compress(zeros))
    stale_base = learner.version
    learner._swap_in_new_weights = lambda: None  # hold the old replica for one more update
    learner.weights.pending = None
    assert learner.step(timeout=30)
    learner.pushes.drain(0)
    del learner._swap_in_new_weights
    assert learner.stats.stale_rejections == 1
    assert system.info.info().pushes_rejected_stale >= 1
    _wait(lambda: learner.stats.resyncs >= 1 and learner.weights.pending is not None, 30, "re-sync pull")
    for _ in range(5):
        assert learner.step(timeout=30)
    learner.pushes.drain(0)
    assert learner.version > stale_base + 6
    assert learner.stats.stale_rejections == 1  # the pushes after the re-sync were accepted
    assert learner.compressor.residuals is residuals and learner.compressor.residual_norm() > 0


def test_the_learner_survives_a_parameter_server_restart_from_its_checkpoint(system):
    learner = system.learner()
    learner.start()
    stop = threading.Event()
    loop = threading.Thread(target=learner.run, args=(stop,), daemon=True)
    loop.start()
    try:
        ckpts = system.run_dir / "checkpoints"
        _wait(lambda: system.info.info().version >= 40 and any(ckpts.glob("*")), 90, "version 40 and a checkpoint")
        residual_names = set(learner.compressor.residuals)
        assert residual_names
        residuals_before = _residuals(learner)
        before = learner.stats.updates
        system.kill_ps()  # SIGKILL: no final checkpoint, the restart resumes an older version
        time.sleep(1.0)
        system.start_ps()
        restored = system.info.info(timeout=30).version
        _wait(lambda: system.info.info().version >= restored + 30, 90, "30 versions after the restart")
        _wait(lambda: abs(learner.version - system.info.info().version) <= 2 * learner.window + 8, 30,
              "the learner's replica to catch up")
    finally:
        stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive()
    assert learner.stats.updates > before + 30
    assert learner.stats.push_errors + learner.stats.stale_rejections >= 1
    assert learner.stats.resyncs >= 1
    # error-feedback residuals are the learner's: kept (and still in use) across the restart
    assert set(learner.compressor.residuals) == residual_names
    assert learner.compressor.residual_norm() > 0
    assert any(not torch.equal(residuals_before[k], learner.compressor.residuals[k]) for k in residual_names)
