"""The learner loop.

One update, read straight down (``Learner.update``):

    batch   = feed.get()                    # sampled from replay in the background (feed.py)
    loss    = algo.loss(batch)              # under torch.autocast (bf16 / fp16)
    grads   = backward, unscale, clip       # non-finite -> skip, never pushed
    pushes.add(grads)                       # compressed, async, in a bounded window (pushes.py)
    priorities -> replay                    # async, by the feed's priority thread
    weights.catch_up()                      # synchronous mode only (weights.py)

Between updates the loop swaps in the weights the parameter server sent back or the pull
thread fetched (``weights.py`` says how each ``learner.sync`` mode follows the server), so
round trips overlap with computation instead of stalling it. Why the window and the
accumulation look as they do (the staleness rule) is in ``pushes.py``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from amprl import algos, errors
from amprl.common.supervise import Supervisor
from amprl.wire.compressed import ErrorFeedback
from amprl.config import ExperimentConfig
from amprl.core import BatchSource, ParameterServer
from amprl.envs.spec import EnvSpec
from amprl.learner.feed import ReplayFeed
from amprl.learner.precision import Precision
from amprl.learner.pushes import PushWindow
from amprl.learner.weights import WeightSync

log = logging.getLogger(__name__)

LOG_WINDOW = 50
"""Updates averaged into the reported loss and mean Q (and over which max Q is taken)."""
LOG_EVERY_S = 10.0
"""Seconds between the learner's progress lines in its log."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class LearnerStats:
    updates: int = 0
    skipped_nonfinite: int = 0
    stale_rejections: int = 0
    push_errors: int = 0
    loss: float = 0.0
    """Mean loss over the last logging window (``LOG_WINDOW`` updates)."""
    q_mean: float = 0.0
    """Mean Q(s, a) of the trained batches over the last logging window (DQN: the online
    network; TD3: critic 1). Far above r_max / (1 - gamma) means the Q-function diverged."""
    q_max: float = 0.0
    """Largest Q(s, a) of the trained batches over the last logging window."""
    grad_norm: float = 0.0
    pushes: int = 0
    """Pushes sent (each one optimizer step on the server once applied)."""
    push_calls: int = 0
    """PushGradients calls (fewer than pushes with ``learner.steps_per_push`` > 1)."""
    pushes_applied: int = 0
    batches_per_push: float = 1.0
    """Mean batches averaged into one push (> 1 while the window is full: see the rule)."""
    resyncs: int = 0
    """Full-weight pulls after a rejected or failed push."""
    server_rollbacks: int = 0
    """Times the pulled version was lower than the replica's (server restored a checkpoint)."""
    push_rtt_ms: float = 0.0
    """Moving average of a push's round trip (send to reply)."""
    staleness: float = 0.0
    """Moving average of the staleness the server reported for our applied pushes."""
    rebases: int = 0
    """local_replica: times the replica was re-based onto weights from the server."""
    rebase_drift: float = 0.0
    """local_replica: largest |replica - server| over the applied pushes, at a re-base."""


class Learner:
    """Owns the model replica, target networks, error-feedback residuals, the replay feed
    (``feed``: prefetched batches in, priorities out), the weight sync (``weights``) and the
    push window (``pushes``)."""

    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, replay: BatchSource, paramserver: ParameterServer,
                 learner_id: str = "learner-0", device: str | None = None):
        self.cfg = cfg
        self.lcfg = cfg.learner
        self.replay = replay
        self.ps = paramserver
        self.learner_id = learner_id
        self.device = pick_device(device or self.lcfg.device)
        torch.manual_seed(cfg.run.seed)
        self.model = algos.build_model(cfg, spec).to(self.device)
        self.algo = algos.builder(cfg.algo).make_learner(cfg, self.model, self.device)
        self.precision = Precision(self.lcfg.precision, self.device, list(self.model.parameters()))
        self.compressor = ErrorFeedback(self.lcfg.grad_encoding, block_size=self.lcfg.onebit_block_size,
                                        min_elements=self.lcfg.onebit_min_elements,
                                        precondition=True,
                                        eps=cfg.paramserver.adam_eps)
        self.stats = LearnerStats()
        self._params = dict(self.model.named_parameters())
        self._stop = threading.Event()
        self.on_replay: Callable[[bool], None] | None = None
        """Called with False when replay stops answering, True when it answers again (the
        learner's readiness: ``__main__`` sets its health)."""
        self.feed = ReplayFeed(cfg, replay, self.algo.to_tensors, pin=self.device.type == "cuda",
                               stop=self._stop, updates=lambda: self.stats.updates,
                               on_reachable=lambda ok: self.on_replay and self.on_replay(ok))
        window = self.lcfg.max_pushes_in_flight or min(256, max(1, cfg.paramserver.max_staleness // 2))
        self.weights = WeightSync(cfg, self._params, self.device, paramserver, self.algo, self.stats,
                                  self._stop, self.compressor, history=4 * window + 64)
        self.pushes = PushWindow(cfg, paramserver, self.compressor, self.weights, self.stats, window)
        self._threads = Supervisor("learner")
        # deploy.pin_learner_update_thread: the CPUs the process may use (empty: no pinning); the
        # update thread gets the lowest, the other threads the rest
        self._allowed_cpus: set[int] = set()
        self._update_tid: int | None = None
        if cfg.deploy.pin_learner_update_thread:
            self._allowed_cpus = os.sched_getaffinity(0)
            if len(self._allowed_cpus) < 2:
                raise errors.ConfigError(
                    f"deploy.pin_learner_update_thread: this process may use only CPU {sorted(self._allowed_cpus)}; "
                    "it needs a second one for its other threads (set it to false)")
        self._loss_sum = 0.0
        self._q_sum = 0.0
        self._q_max = -math.inf
        self._loss_n = 0
        self.log_every_s = LOG_EVERY_S
        self._logged = (0.0, 0)  # (monotonic time, updates) of the last progress line

    @property
    def version(self) -> int:
        """The server version the replica's weights are (or, local_replica, will be) at."""
        return self.weights.version

    @property
    def window(self) -> int:
        """Pushes in flight at most (``pushes.py``)."""
        return self.pushes.size

    def _pin_threads(self, unpin: bool = False) -> None:
        """``deploy.pin_learner_update_thread``: the update thread on its CPU, every other thread of
        this process (those started since the last call too) on the other CPUs; ``unpin``:
        every thread on all the CPUs the process had."""
        if not self._allowed_cpus or self._update_tid is None:
            return
        update_cpu = {min(self._allowed_cpus)}
        for name in os.listdir("/proc/self/task"):
            tid = int(name)
            want = (self._allowed_cpus if unpin else
                    update_cpu if tid == self._update_tid else self._allowed_cpus - update_cpu)
            try:
                if os.sched_getaffinity(tid) != want:
                    os.sched_setaffinity(tid, want)
            except OSError:
                continue  # the thread ended meanwhile

    def start(self) -> None:
        """Pulls the initial weights (blocking) and starts the background threads."""
        self.weights.start(self.pushes.seq)
        log.info("push window %d, up to %d batches per push, push deadline %.1f s (max_staleness %d)",
                 self.window, self.lcfg.max_batches_per_push, self.lcfg.push_timeout_s,
                 self.cfg.paramserver.max_staleness)
        # the pull thread also moves threads started meanwhile (gRPC, pushes) off the update CPU
        for target, name in ((self.feed.prefetch_loop, "prefetch"),
                             (self.feed.priority_loop, "priorities"),
                             (lambda: self.weights.pull_loop(self._pin_threads), "pull")):
            self._threads.start(target, name)

    def stop(self) -> None:
        """Sends the steps not yet pushed and waits for the pushes in flight (a partly
        accumulated push is dropped: less than one optimizer step), then stops the threads."""
        self.pushes.send_unsent()
        self.pushes.drain(0)
        self._stop.set()
        self._threads.join(timeout_s=5.0)
        self._pin_threads(unpin=True)  # the process's threads may outlive this learner
        self.algo.close()

    def swap_in_weights(self) -> None:
        """Loads the weights that came back from the server, if any (between updates)."""
        swapped = self.weights.swap_in(self.pushes.seq)
        if swapped is not None:
            self.pushes.forget(swapped)

    # -- the update ------------------------------------------------------------------------

    def step(self, timeout: float = 1.0) -> bool:
        """One update from the prefetch queue; False if no batch arrived within timeout.
        Raises ThreadDied once a background thread has died (the process should end)."""
        self._threads.check()
        if not self.feed.ready():
            self.pushes.send_unsent()  # no batch ready: don't hold back steps made
        batch = self.feed.get(timeout)
        if batch is None:
            return False
        self.swap_in_weights()
        return self.update(batch)

    def update(self, item) -> bool:
        """One update on ``item`` = (Batch, keys); returns True (the batch was consumed)."""
        batch, keys = item
        names = self.algo.trainable_names(self.stats.updates)
        for p in self._params.values():  # model.zero_grad(set_to_none=True) without its bookkeeping
            p.grad = None
        info: dict = {}
        with self.precision.autocast():
            loss, td_abs = self.algo.loss(batch, self.stats.updates, info)
        self.precision.backward(loss)
        params = [self._params[n] for n in names if self._params[n].grad is not None]
        # clip_grad_norm_, without its multiply by 1.0 of every gradient when the norm is
        # under the limit (the common case): the same gradients, one pass fewer
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        norm_value = float(norm)
        finite = math.isfinite(norm_value)
        if finite and norm_value > self.lcfg.grad_clip_norm:
            torch.nn.utils.clip_grads_with_norm_(params, self.lcfg.grad_clip_norm, norm)
        self.precision.update()
        if td_abs is not None:
            prios = td_abs.detach().float().cpu().numpy() + self.cfg.replay.priority_epsilon
            if np.isfinite(prios).all():
                self.feed.send_priorities(keys, prios)
        if not finite:
            self.stats.skipped_nonfinite += 1
            return True
        self.pushes.add({n: g for n in names if (g := self._params[n].grad) is not None}, len(keys))
        if self.lcfg.sync == "synchronous":
            last = self.pushes.inflight[-1] if self.pushes.inflight else None
            self.pushes.drain(0)
            swapped = self.weights.catch_up(last)
            if swapped is not None:
                self.pushes.forget(swapped)
        self.stats.updates += 1
        self.stats.grad_norm = norm_value
        # one device sync for the three figures
        loss_value, q_value, q_max = torch.stack([loss.detach().float(), info["q_mean"],
                                                  info["q_max"]]).tolist()
        self._loss_sum += loss_value
        self._q_sum += q_value
        self._q_max = max(self._q_max, q_max)
        self._loss_n += 1
        if self._loss_n >= LOG_WINDOW:
            self.stats.loss, self.stats.q_mean = self._loss_sum / self._loss_n, self._q_sum / self._loss_n
            self.stats.q_max = self._q_max
            self._loss_sum, self._q_sum, self._loss_n, self._q_max = 0.0, 0.0, 0, -math.inf
        return True

    def run(self, stop: threading.Event, max_updates: int | None = None) -> None:
        """Updates until ``stop`` is set (or ``max_updates`` in all); with
        ``deploy.pin_learner_update_thread`` the calling thread becomes the pinned update thread."""
        if self._allowed_cpus and self._update_tid != threading.get_native_id():
            self._update_tid = threading.get_native_id()
            self._pin_threads()
        self._logged = (time.monotonic(), self.stats.updates)
        while not stop.is_set() and (max_updates is None or self.stats.updates < max_updates):
            self.step(timeout=0.5)
            if time.monotonic() - self._logged[0] >= self.log_every_s:
                self._log_progress()

    def _log_progress(self) -> None:
        """One line of what the learner is doing (what a user watching the log wants)."""
        now, s = time.monotonic(), self.stats
        (then, updates), self._logged = self._logged, (now, s.updates)
        log.info("updates %d (%.0f/s), loss %.4g, Q %.4g, grad norm %.3g, version %d, pushes applied %d, "
                 "staleness %.2f, stale rejections %d, push errors %d, skipped non-finite %d, replay batches "
                 "queued %d", s.updates, (s.updates - updates) / max(now - then, 1e-9), s.loss, s.q_mean,
                 s.grad_norm, self.version, s.pushes_applied, s.staleness, s.stale_rejections,
                 s.push_errors, s.skipped_nonfinite, self.queue_size)

    @property
    def queue_size(self) -> int:
        return self.feed.batches.qsize()

    @property
    def replay_reachable(self) -> bool:
        return self.feed.reachable
