"""Greedy evaluation of the newest weights.

Runs ``episodes`` episodes side by side (one env each, one batched forward pass per step),
without training-only wrappers (Atari: real game score, no life-loss terminals), and
records mean/std return with the fleet's env steps and the wall time of the measurement.

With a run folder it also keeps the best-scoring weights so far in ``RUN/best/``:
``weights-v<version>.pt`` (a state dict of fp32 CPU tensors, ``torch.load(...,
weights_only=True)``), ``config.yaml`` (what rebuilds the network:
``amprl.algos.build_model``) and ``best.json`` (the evaluation, and which weights file it
scored), written last and atomically, so a reader never pairs a record with other weights.
A run that goes on past its best moment still has it. An evaluator started on a folder that
has them already (``amprl run --resume``) goes on with them: its wall time from the last
evaluation's, the best replaced only by a better one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from amprl import algos, errors
from amprl.rl.exploration import derive_seed
from amprl.config import ExperimentConfig, dump_config
from amprl.core import TransitionSink, WeightSource
from amprl.envs.episodes import run_episodes
from amprl.envs.factory import make_env
from amprl.envs.spec import EnvSpec
from amprl.v1 import telemetry_pb2

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, paramserver: WeightSource,
                 replay: TransitionSink | None = None,
                 run_dir: str = "", client_id: str = "evaluator"):
        self.cfg = cfg
        self.spec = spec
        self.ps = paramserver
        self.replay = replay
        self.model = algos.build_model(cfg, spec).eval()
        self._params = dict(self.model.named_parameters())
        self.policy = algos.builder(cfg.algo).make_greedy_policy(self.model)
        self.version = 0
        self.incarnation = 0  # the parameter server's incarnation of the weights held
        self.evaluations: list[telemetry_pb2.Evaluation] = []
        self.history_path = Path(run_dir) / "eval.jsonl" if run_dir else None
        self.best_dir = Path(run_dir) / "best" if run_dir else None
        self.best: telemetry_pb2.Evaluation | None = None
        base = derive_seed(cfg.run.seed, client_id)
        self.envs = [make_env(cfg.env, training=False) for _ in range(cfg.evaluator.episodes)]
        self._seed_base = base
        self._round = 0
        self.rng = np.random.default_rng(base)
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self.on_evaluation: Callable[[telemetry_pb2.Evaluation], None] | None = None
        """Called with each evaluation once it is recorded (``__main__`` writes it to
        TensorBoard at once)."""
        if run_dir:
            self._continue_history()

    def _continue_history(self) -> None:
        """Takes up a run folder's earlier evaluations (module docstring)."""
        assert self.history_path is not None and self.best_dir is not None
        try:
            last = json.loads(self.history_path.read_text().splitlines()[-1])
            self.t0 -= float(last["wall_seconds"])
        except (OSError, IndexError, ValueError, KeyError):
            pass  # a new run (or an unreadable last line: the clock starts at 0)
        try:
            best = json.loads((self.best_dir / "best.json").read_text())
            self.best = telemetry_pb2.Evaluation(param_version=int(best["param_version"]),
                                                 mean_return=float(best["mean_return"]))
        except (OSError, ValueError, KeyError):
            pass

    @torch.no_grad()
    def _pull(self) -> bool:
        version, incarnation, weights = self.ps.pull_versioned(
            self.version, self.incarnation, encoding="fp32", timeout=60.0)
        if weights is None:
            return False
        for name, value in weights.items():
            self._params[name].copy_(value)
        self.policy.sync()
        self.version, self.incarnation = version, incarnation
        return True

    def evaluate_once(self) -> telemetry_pb2.Evaluation | None:
        if not self._pull() and self.evaluations:
            return None  # nothing new to evaluate
        # the policy's moment: its version, the env steps and the wall time are all taken
        # when its weights were pulled, not after its episodes ran
        wall, unix = time.monotonic() - self.t0, time.time()
        env_steps = 0
        if self.replay is not None:
            try:
                env_steps = int(self.replay.info().env_steps_total)
            except errors.AmprlError:
                pass
        seeds = [self._seed_base + 1000 * self._round + i for i in range(len(self.envs))]
        self._round += 1
        returns = run_episodes(self.policy, self.spec, self.envs, seeds, self.cfg.evaluator.epsilon,
                               self.rng)
        ev = telemetry_pb2.Evaluation(
            param_version=self.version, mean_return=float(np.mean(returns)),
            std_return=float(np.std(returns)), episodes=len(returns), env_steps=env_steps,
            wall_seconds=wall, unix_time=unix)
        with self._lock:
            self.evaluations.append(ev)
        if self.history_path is not None:
            with self.history_path.open("a") as f:
                f.write(json.dumps({
                    "param_version": ev.param_version, "mean_return": ev.mean_return,
                    "std_return": ev.std_return, "episodes": ev.episodes, "env_steps": ev.env_steps,
                    "wall_seconds": round(ev.wall_seconds, 3), "unix_time": ev.unix_time}) + "\n")
        log.info("eval v%d: %.1f ± %.1f over %d episodes (env steps %d)", ev.param_version,
                 ev.mean_return, ev.std_return, ev.episodes, ev.env_steps)
        if self.best_dir is not None and (self.best is None or ev.mean_return > self.best.mean_return):
            self._keep_best(ev)
        if self.on_evaluation is not None:
            self.on_evaluation(ev)
        return ev

    @torch.no_grad()
    def _keep_best(self, ev: telemetry_pb2.Evaluation) -> None:
        """Writes the weights just evaluated as the run's best (module docstring)."""
        assert self.best_dir is not None
        self.best_dir.mkdir(parents=True, exist_ok=True)
        name = f"weights-v{ev.param_version}.pt"
        tmp = self.best_dir / f".{name}.tmp"
        torch.save({n: p.detach().float().cpu().clone() for n, p in self._params.items()}, tmp)
        os.replace(tmp, self.best_dir / name)
        if not (self.best_dir / "config.yaml").exists():
            dump_config(self.cfg, self.best_dir / "config.yaml")
        record = {"param_version": ev.param_version, "mean_return": ev.mean_return,
                  "std_return": ev.std_return, "episodes": ev.episodes, "env_steps": ev.env_steps,
                  "wall_seconds": round(ev.wall_seconds, 3), "unix_time": ev.unix_time,
                  "weights": name, "config": "config.yaml"}
        tmp = self.best_dir / ".best.json.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, self.best_dir / "best.json")
        for old in self.best_dir.glob("weights-v*.pt"):
            if old.name != name:
                old.unlink(missing_ok=True)
        self.best = ev

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.evaluate_once()
            except errors.Unavailable as exc:
                log.warning("parameter server unavailable: %s", exc)
            stop.wait(max(0.0, self.cfg.evaluator.interval_s - (time.monotonic() - started)))
