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
has them already (a restarted pod, ``amprl run --resume``) goes on with them: its history
(``eval.jsonl``, served again in Info), its wall time from the last evaluation's, the best
replaced only by a better one.

The evaluator also decides when the run ends (``amprl.evaluator.verdict``): a thread judges
the stop rule every ``JUDGE_INTERVAL_S`` with replay's env-step count, and after each
evaluation; once a condition is met, ``finish`` waits for the weights to settle (the
workers stop at their next poll of GetRunState), evaluates them once more and writes the
summary.
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
from amprl.common import runend
from amprl.rl.exploration import derive_seed
from amprl.config import ExperimentConfig, dump_config
from amprl.core import TransitionSink, WeightSource
from amprl.envs.episodes import run_episodes
from amprl.envs.factory import make_env
from amprl.envs.spec import EnvSpec
from amprl.evaluator.client import WORKER_POLL_S
from amprl.evaluator.verdict import Verdict
from amprl.v1 import telemetry_pb2

log = logging.getLogger(__name__)

JUDGE_INTERVAL_S = 1.0
"""How often the stop rule is judged with replay's env-step count."""

SETTLE_S = WORKER_POLL_S + 1.0
"""After the run ends, how long the evaluator waits before its final evaluation: every
worker has polled by then (and a learner has sent its last pushes)."""

STILL_S = 1.0
"""... and how long the version must then stay the same."""

MAX_SETTLE_S = 60.0
"""The final evaluation happens this long after the end at the latest, settled or not."""

_EVAL_FIELDS = ("param_version", "mean_return", "std_return", "episodes", "env_steps",
                "wall_seconds", "unix_time")


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
        self.verdict = Verdict(cfg.run, run_dir)
        self.replay_size: int | None = None
        """Transitions in replay at the last judgement (None: not known)."""

    def _continue_history(self) -> None:
        """Takes up a run folder's earlier evaluations (module docstring)."""
        assert self.history_path is not None and self.best_dir is not None
        try:
            lines = self.history_path.read_text().splitlines()
        except OSError:
            lines = []  # a new run
        for line in lines:
            try:
                row = json.loads(line)
                self.evaluations.append(telemetry_pb2.Evaluation(**{k: row[k] for k in _EVAL_FIELDS}))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash
        if self.evaluations:  # the clock goes on from the last evaluation's
            self.t0 -= self.evaluations[-1].wall_seconds
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

    @property
    def wall_seconds(self) -> float:
        """The run's wall time: this evaluator's, going on from the last recorded evaluation."""
        return time.monotonic() - self.t0

    def _replay_figures(self) -> tuple[int | None, int | None]:
        """(fleet env steps, transitions stored) from replay; None where not known."""
        if self.replay is None:
            return None, None
        try:
            info = self.replay.info(timeout=5.0)
        except errors.AmprlError as exc:
            log.debug("replay Info: %s", exc)
            return None, None
        return int(info.env_steps_total), int(info.size)

    def judge(self) -> bool:
        """Judges the stop rule now (``amprl.evaluator.verdict``); True if the run just ended."""
        env_steps, size = self._replay_figures()
        if size is not None:
            self.replay_size = size
        with self._lock:
            returns = [e.mean_return for e in self.evaluations]
        return self.verdict.judge(env_steps=env_steps, returns=returns, wall_seconds=self.wall_seconds)

    def evaluate_once(self) -> telemetry_pb2.Evaluation | None:
        if not self._pull() and self.evaluations:
            return None  # nothing new to evaluate
        return self._evaluate()

    def _evaluate(self) -> telemetry_pb2.Evaluation:
        """Evaluates the weights held and records the evaluation."""
        # the policy's moment: its version, the env steps and the wall time are all taken
        # when its weights were pulled, not after its episodes ran. The wall time is rounded
        # once, as the history records it, so a restarted evaluator's clock goes on from
        # exactly the value held here, never from just below it
        wall, unix = round(self.wall_seconds, 3), time.time()
        env_steps = self._replay_figures()[0] or 0
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
                    "wall_seconds": ev.wall_seconds, "unix_time": ev.unix_time}) + "\n")
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
                  "wall_seconds": ev.wall_seconds, "unix_time": ev.unix_time,
                  "weights": name, "config": "config.yaml"}
        tmp = self.best_dir / ".best.json.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, self.best_dir / "best.json")
        for old in self.best_dir.glob("weights-v*.pt"):
            if old.name != name:
                old.unlink(missing_ok=True)
        self.best = ev

    def run(self, stop: threading.Event) -> None:
        """Evaluates every ``evaluator.interval_s`` while the run goes on, ends it when the
        rule says so (``finish``), then serves its results until ``stop``."""
        if self.replay is None:
            log.warning("no replay address: the step budget (run.total_env_steps) is not judged")
        judge = threading.Thread(target=self._judge_loop, args=(stop,), name="judge", daemon=True)
        judge.start()
        while not stop.is_set() and self.verdict.phase == runend.RUNNING:
            started = time.monotonic()
            try:
                if self.evaluate_once() is not None:
                    self.judge()  # at once: the target may just have been reached
            except errors.Unavailable as exc:
                log.warning("parameter server unavailable: %s", exc)
            until = started + self.cfg.evaluator.interval_s
            while not stop.is_set() and self.verdict.phase == runend.RUNNING and time.monotonic() < until:
                stop.wait(min(0.25, max(0.0, until - time.monotonic())))
        while not stop.is_set() and self.verdict.phase == runend.STOPPING:
            try:
                self.finish(stop)
            except errors.Unavailable as exc:
                log.warning("parameter server unavailable: %s", exc)
                stop.wait(1.0)
        judge.join()
        stop.wait()  # FINISHED: the evaluator keeps serving the verdict and the results

    def _judge_loop(self, stop: threading.Event) -> None:
        while self.verdict.phase == runend.RUNNING and not stop.wait(JUDGE_INTERVAL_S):
            self.judge()

    def finish(self, stop: threading.Event) -> None:
        """Ends a STOPPING run: waits for the weights to settle (``SETTLE_S``, ``STILL_S``,
        ``MAX_SETTLE_S``), evaluates them unless they were evaluated already (a run that
        reached its target ends on that evaluation), writes the summary: FINISHED."""
        if self.verdict.reason != telemetry_pb2.STOP_REASON_TARGET_REACHED:
            still_since = time.monotonic()
            while not stop.is_set() and self.verdict.seconds_since_decision < MAX_SETTLE_S:
                if self._pull():
                    still_since = time.monotonic()
                elif (self.verdict.seconds_since_decision >= SETTLE_S
                      and time.monotonic() - still_since >= STILL_S):
                    break
                stop.wait(0.25)
            if stop.is_set():
                return
            last = self.evaluations[-1] if self.evaluations else None
            if last is None or last.param_version != self.version:
                self._evaluate()
        env_steps, size = self._replay_figures()
        state = self.verdict.state()
        with self._lock:
            evaluations = list(self.evaluations)
        self.verdict.finish(runend.summary(
            self.cfg, runend.REASONS[state.stop_reason], evaluations,
            env_steps=env_steps if env_steps is not None else state.env_steps,
            param_version=self.version, wall_seconds=self.wall_seconds,
            replay_size=size if size is not None else self.replay_size,
            run_dir=self.best_dir.parent if self.best_dir is not None else None))

    def best_policy(self) -> tuple[telemetry_pb2.Evaluation, str, dict[str, torch.Tensor]] | None:
        """(the evaluation, the config YAML, the weights) of ``RUN/best/``; None before the
        first evaluation or without a run folder."""
        if self.best_dir is None:
            return None
        try:
            record = json.loads((self.best_dir / "best.json").read_text())
            weights = torch.load(self.best_dir / record["weights"], weights_only=True)
            config_yaml = (self.best_dir / record["config"]).read_text()
            evaluation = telemetry_pb2.Evaluation(**{k: record[k] for k in _EVAL_FIELDS})
        except (OSError, ValueError, KeyError, RuntimeError):
            return None  # none yet (or replaced between reading the record and the weights)
        return evaluation, config_yaml, weights
