"""The learner's side of replay: batches sampled ahead of the update loop, and the new
priorities the updates compute sent back.

Two threads, started under the learner's supervisor:

- **prefetch** keeps up to ``learner.prefetch_batches`` batches ready: one Sample call draws
  ``learner.sample_batches_per_call`` batches at once (the per-call cost is shared; the
  draws are the i.i.d. prioritized draws a call per batch would make), split, converted to
  tensors (pinned on CUDA) and queued. Replay below its minimum size or rate-limited answers
  DEADLINE_EXCEEDED and is asked again; unreachable, it is asked again after a pause and
  ``on_reachable(False)`` is told (the learner's readiness).
- **priorities** sends the |TD errors| of trained batches, at most one UpdatePriorities call
  per ``learner.priority_flush_s``, everything queued meanwhile in that call. Priorities are
  advisory: a full queue drops them rather than stall an update, and a failed call is
  logged, not retried.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import replace
from typing import Callable

import numpy as np

from amprl import errors
from amprl.config import ExperimentConfig
from amprl.core import BatchSource

log = logging.getLogger(__name__)


class ReplayFeed:
    def __init__(self, cfg: ExperimentConfig, replay: BatchSource, to_tensors: Callable, *, pin: bool,
                 stop: threading.Event, updates: Callable[[], int],
                 on_reachable: Callable[[bool], None]):
        """``to_tensors(sampled, pin=...)`` makes a batch of a sampled draw (the
        algorithm's); ``updates()`` is the learner's update count (it anneals beta);
        ``on_reachable`` is called when replay stops or starts answering."""
        self.cfg = cfg
        self.lcfg = cfg.learner
        self.replay = replay
        self.to_tensors = to_tensors
        self.pin = pin
        self.stop = stop
        self.updates = updates
        self.on_reachable = on_reachable
        self.batches: queue.Queue = queue.Queue(maxsize=self.lcfg.prefetch_batches)
        self.priorities: queue.Queue = queue.Queue(maxsize=256)
        self.reachable = True
        self.priority_updates = 0
        """UpdatePriorities items sent (one per trained batch)."""

    def beta(self) -> float:
        """The importance-sampling exponent now: annealed linearly over the updates."""
        r = self.cfg.replay
        frac = min(1.0, self.updates() / max(1, r.beta_anneal_updates))
        return r.beta_start + frac * (r.beta_end - r.beta_start)

    def get(self, timeout: float):
        """The next (batch, keys), or None when none came within ``timeout``."""
        try:
            return self.batches.get_nowait()
        except queue.Empty:
            pass
        try:
            return self.batches.get(timeout=timeout)
        except queue.Empty:
            return None

    def ready(self) -> bool:
        return not self.batches.empty()

    def send_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """Queues new priorities for the priority thread (dropped when the queue is full)."""
        try:
            self.priorities.put_nowait((keys, priorities))
        except queue.Full:
            pass  # priorities are advisory; never stall the update for them

    def _set_reachable(self, reachable: bool) -> None:
        if reachable != self.reachable:
            self.reachable = reachable
            self.on_reachable(reachable)

    def prefetch_loop(self) -> None:
        per_call = self.lcfg.sample_batches_per_call
        bs = self.lcfg.batch_size
        while not self.stop.is_set():
            try:
                sampled = self.replay.sample(bs * per_call, self.beta(), timeout=2.0)
            except errors.DeadlineExceeded:
                self._set_reachable(True)
                continue  # below min size or rate-limited: ask again
            except errors.Unavailable as exc:
                log.warning("replay unavailable: %s", exc)
                self._set_reachable(False)
                self.stop.wait(0.5)
                continue
            except errors.InvalidArgument:
                # the table is still smaller than several batches: ask for one
                per_call = 1
                continue
            except errors.AmprlError as exc:  # e.g. RESOURCE_EXHAUSTED: retried, not fatal
                log.warning("sample failed: %s", exc)
                self.stop.wait(1.0)
                continue
            self._set_reachable(True)
            for part in sampled.split(bs) if per_call > 1 else [sampled]:
                if self.cfg.replay.is_weight_normalization == "batch":
                    # the table's normaliser is common to the whole draw, so this is exactly
                    # (N * P(i))^-beta / max over the batch
                    part = replace(part, weights=part.weights / part.weights.max())
                batch = self.to_tensors(part, pin=self.pin)
                while not self.stop.is_set():
                    try:
                        self.batches.put(batch, timeout=0.2)
                        break
                    except queue.Full:
                        continue
            per_call = self.lcfg.sample_batches_per_call

    def priority_loop(self) -> None:
        last_sent = 0.0
        while not self.stop.is_set() or not self.priorities.empty():
            try:
                items = [self.priorities.get(timeout=0.2)]
            except queue.Empty:
                continue
            # at most one call per priority_flush_s: the batches trained meanwhile join it
            self.stop.wait(max(0.0, last_sent + self.lcfg.priority_flush_s - time.monotonic()))
            last_sent = time.monotonic()
            while True:  # everything queued meanwhile goes in the same call
                try:
                    items.append(self.priorities.get_nowait())
                except queue.Empty:
                    break
            keys = np.concatenate([k for k, _ in items])
            prios = np.concatenate([p for _, p in items])
            try:
                self.replay.update_priorities(keys, prios)
                self.priority_updates += len(items)
            except errors.AmprlError as exc:
                log.warning("priority update failed: %s", exc)
