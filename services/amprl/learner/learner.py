"""The learner loop.

One update, read straight down:

    batch   = prefetch_queue.get()          # sampled in the background from replay
    loss    = algo.loss(batch)              # under torch.autocast (bf16 / fp16)
    grads   = backward, unscale, clip       # non-finite -> skip, never pushed
    push(compress(grads), base_version)     # async; at most max_pushes_in_flight pending
    priorities -> replay                    # async, by a background thread

Weights come back from the parameter server: every push reply announces a new version and
a background thread pulls it; the update loop swaps new weights in between updates, so
network round trips (up to ~300 ms) overlap with computation instead of stalling it.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from amprl import errors
from amprl.compression import ErrorFeedback
from amprl.config import ExperimentConfig
from amprl.envs.spec import EnvSpec
from amprl.learner.algos import make_algo
from amprl.learner.precision import Precision
from amprl.rl.models import build_model

log = logging.getLogger(__name__)


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
    grad_norm: float = 0.0
    priority_updates: int = 0


class Learner:
    """Owns the model replica, target networks, error-feedback residuals and the threads
    that feed (prefetch), drain (priorities) and sync (weights) the update loop."""

    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, replay, paramserver,
                 learner_id: str = "learner-0", device: str | None = None):
        self.cfg = cfg
        self.lcfg = cfg.learner
        self.replay = replay
        self.ps = paramserver
        self.learner_id = learner_id
        self.device = pick_device(device or self.lcfg.device)
        torch.manual_seed(cfg.run.seed)
        self.model = build_model(cfg, spec).to(self.device)
        self.algo = make_algo(cfg, self.model, self.device)
        self.precision = Precision(self.lcfg.precision, self.device, list(self.model.parameters()))
        self.compressor = ErrorFeedback(self.lcfg.grad_encoding, block_size=self.lcfg.onebit_block_size,
                                        min_elements=self.lcfg.onebit_min_elements)
        self.stats = LearnerStats()
        self.version = 0
        self._params = dict(self.model.named_parameters())
        self._stop = threading.Event()
        self._batches: queue.Queue = queue.Queue(maxsize=self.lcfg.prefetch_batches)
        self._priorities: queue.Queue = queue.Queue(maxsize=256)
        self._inflight: collections.deque = collections.deque()
        self._pending_weights: tuple[int, dict] | None = None
        self._pending_lock = threading.Lock()
        self._want_pull = threading.Event()
        self._newest_seen = 0
        self._threads: list[threading.Thread] = []
        self._loss_sum = 0.0
        self._loss_n = 0

    # -- background threads -------------------------------------------------------------

    def _beta(self) -> float:
        r = self.cfg.replay
        frac = min(1.0, self.stats.updates / max(1, r.beta_anneal_updates))
        return r.beta_start + frac * (r.beta_end - r.beta_start)

    def _prefetch_loop(self) -> None:
        pin = self.device.type == "cuda"
        per_call = self.lcfg.sample_batches_per_call
        bs = self.lcfg.batch_size
        while not self._stop.is_set():
            try:
                # One RPC for several batches: the per-call cost is shared, the draws are the
                # same i.i.d. prioritized draws a call per batch would make.
                sampled = self.replay.sample(bs * per_call, self._beta(), timeout=2.0)
            except errors.DeadlineExceeded:
                continue  # below min size or rate-limited: ask again
            except errors.Unavailable as exc:
                log.warning("replay unavailable: %s", exc)
                self._stop.wait(0.5)
                continue
            except errors.InvalidArgument:
                # the table is still smaller than several batches: ask for one
                per_call = 1
                continue
            for part in sampled.split(bs) if per_call > 1 else [sampled]:
                batch = self.algo.to_tensors(part, pin=pin)
                while not self._stop.is_set():
                    try:
                        self._batches.put(batch, timeout=0.2)
                        break
                    except queue.Full:
                        continue
            per_call = self.lcfg.sample_batches_per_call

    def _priority_loop(self) -> None:
        while not self._stop.is_set() or not self._priorities.empty():
            try:
                items = [self._priorities.get(timeout=0.2)]
            except queue.Empty:
                continue
            while True:  # everything queued meanwhile goes in the same call
                try:
                    items.append(self._priorities.get_nowait())
                except queue.Empty:
                    break
            keys = np.concatenate([k for k, _ in items])
            prios = np.concatenate([p for _, p in items])
            try:
                self.replay.update_priorities(keys, prios)
                self.stats.priority_updates += len(items)
            except errors.AmprlError as exc:
                log.warning("priority update failed: %s", exc)

    def _pull_loop(self) -> None:
        while not self._stop.is_set():
            if not self._want_pull.wait(timeout=0.5):
                continue
            self._want_pull.clear()
            try:
                have = self._pending_weights[0] if self._pending_weights else self.version
                version, weights = self.ps.pull(have_version=have, timeout=30.0)
            except errors.AmprlError as exc:
                log.warning("pull failed: %s", exc)
                self._stop.wait(0.2)
                self._want_pull.set()
                continue
            if weights is not None:
                with self._pending_lock:
                    self._pending_weights = (version, weights)

    def start(self) -> None:
        """Pulls the initial weights (blocking) and starts the background threads."""
        version, weights = self.ps.pull(have_version=0, timeout=60.0)
        self._load(version, weights)
        self.algo.on_weights(self.version, initial=True)
        for target, name in ((self._prefetch_loop, "prefetch"), (self._priority_loop, "priorities"),
                             (self._pull_loop, "pull")):
            t = threading.Thread(target=target, name=f"learner-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._drain_pushes(0)
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5.0)

    # -- weights ---------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, version: int, weights: dict) -> None:
        for name, value in weights.items():
            self._params[name].copy_(value.to(self.device, non_blocking=True))
        self.version = version

    def _swap_in_new_weights(self) -> None:
        with self._pending_lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is not None and pending[0] > self.version:
            self._load(*pending)
            self.algo.on_weights(self.version)

    # -- pushes ----------------------------------------------------------------------------

    def _on_push_done(self, fut) -> None:
        try:
            reply = fut.result()
            self._newest_seen = max(self._newest_seen, reply.version)
            if reply.version - self.version < self.lcfg.pull_lag_versions:
                return  # the replica is recent enough; don't pay a pull for every push
        except errors.FailedPrecondition as exc:
            self.stats.stale_rejections += 1
            if exc.current_version is not None:
                self._newest_seen = max(self._newest_seen, exc.current_version)
        except Exception as exc:  # noqa: BLE001 - counted and logged, the loop goes on
            self.stats.push_errors += 1
            log.warning("push failed: %s", exc)
        self._want_pull.set()

    def _drain_pushes(self, keep: int) -> None:
        while len(self._inflight) > keep:
            fut = self._inflight.popleft()
            try:
                fut.result(timeout=60.0)
            except Exception:  # noqa: BLE001 - already handled in _on_push_done
                pass

    # -- the update ------------------------------------------------------------------------

    def step(self, timeout: float = 1.0) -> bool:
        """One update from the prefetch queue; False if no batch arrived within timeout."""
        try:
            batch = self._batches.get(timeout=timeout)
        except queue.Empty:
            return False
        self._swap_in_new_weights()
        return self.update(batch)

    def update(self, item) -> bool:
        """One update on ``item`` = (Batch, keys); False never (True = a batch was consumed)."""
        batch, keys = item
        names = self.algo.trainable_names(self.stats.updates)
        self.model.zero_grad(set_to_none=True)
        with self.precision.autocast():
            loss, td_abs = self.algo.loss(batch, self.stats.updates)
        self.precision.backward(loss)
        params = [self._params[n] for n in names if self._params[n].grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.lcfg.grad_clip_norm)
        finite = bool(torch.isfinite(norm))
        self.precision.update()
        if td_abs is not None:
            prios = td_abs.detach().float().cpu().numpy() + self.cfg.replay.priority_epsilon
            if np.isfinite(prios).all():
                try:
                    self._priorities.put_nowait((keys, prios))
                except queue.Full:
                    pass  # priorities are advisory; never stall the update for them
        if not finite:
            self.stats.skipped_nonfinite += 1
            return True
        grads = {n: self._params[n].grad for n in names if self._params[n].grad is not None}
        msgs = self.compressor.compress(grads)
        self._drain_pushes(self.lcfg.max_pushes_in_flight - 1)
        fut = self.ps.push_future(self.version, msgs, batch_size=len(keys))
        fut.add_done_callback(self._on_push_done)
        self._inflight.append(fut)
        self.stats.updates += 1
        self.stats.grad_norm = float(norm)
        self._loss_sum += float(loss.detach())
        self._loss_n += 1
        if self._loss_n >= 50:
            self.stats.loss, self._loss_sum, self._loss_n = self._loss_sum / self._loss_n, 0.0, 0
        return True

    def run(self, stop: threading.Event, max_updates: int | None = None) -> None:
        while not stop.is_set() and (max_updates is None or self.stats.updates < max_updates):
            self.step(timeout=0.5)

    @property
    def queue_size(self) -> int:
        return self._batches.qsize()
