"""The learner's pushes: a bounded window of PushGradients calls in flight, and what a
batch's gradient does while that window is full.

The latency rule. The parameter server applies a push only if ``staleness = server version
- base version`` is at most ``paramserver.max_staleness``. With a round trip R and W pushes
in flight, the server advances W versions per R, and a gradient reaches it computed on
weights pulled between R/2 and 3R/2 earlier: its staleness is about W to 2W. Hence:

* **Window.** At most ``W = learner.max_pushes_in_flight`` pushes are in flight; 0 means
  auto, ``W = max(1, max_staleness // 2)``, the widest window the staleness rule accepts.
  The window bounds optimizer steps per round trip (W / R), whatever the learner's speed.
* **Accumulate instead of waiting.** While the window is full, each new batch's clipped
  gradient is averaged into the next push (up to ``learner.max_batches_per_push`` batches;
  1 = wait for a slot). So at a long RTT the learner keeps training at its own rate and
  each push -- one Adam step on the server -- carries a larger effective batch; at low RTT
  the window is never full and every batch is its own push. The push's base version is the
  oldest weights any of its batches used (staleness is never understated). The trade-off:
  averaged batches buy throughput, not optimizer steps (replay's rate limiter counts
  sampled batches), so steps-to-target grows; with ``max_batches_per_push`` 1 the learner
  instead runs at W / R updates/s and keeps the per-step sample efficiency.
* **Several steps per call** (``learner.steps_per_push``, ``local_replica`` only). The
  replica already holds each step, so K consecutive steps can travel in one call
  (``more_steps``), step i computed on base_version + i and applied by the server back to
  back, one version each. Held-back steps are sent when the prefetch queue is empty and at
  stop; a re-sync drops them (they were computed on weights the server never had).
* **Deadlines.** Every push has ``learner.push_timeout_s`` (including waiting for a lost
  connection to come back). A push is never resent: it may have been applied before the
  reply was lost.
"""

from __future__ import annotations

import collections
import time

import torch

from amprl.wire.compressed import ErrorFeedback
from amprl.config import ExperimentConfig
from amprl.core import WeightSink
from amprl.learner.weights import Swapped, WeightSync


class PushWindow:
    """Compresses gradients and sends them as pushes, at most ``size`` calls in flight;
    replies go to the weight sync (``WeightSync.push_done``)."""

    def __init__(self, cfg: ExperimentConfig, paramserver: WeightSink, compressor: ErrorFeedback,
                 weights: WeightSync, stats, size: int):
        self.lcfg = cfg.learner
        self.ps = paramserver
        self.compressor = compressor
        self.weights = weights
        self.stats = stats
        self.size = size
        self.seq = 0  # pushes made so far (the newest push's number)
        self.inflight: collections.deque = collections.deque()
        self._unsent: list = []  # local_replica: steps applied locally, not yet pushed
        self._unsent_base = 0
        # gradients averaged into the next push while the window is full
        self._acc: dict[str, torch.Tensor] = {}
        self._acc_count: dict[str, int] = {}
        self.acc_batches = 0
        self._acc_items = 0
        self._acc_base = 0
        self._batches_pushed = 0

    def full(self) -> bool:
        while self.inflight and self.inflight[0].done():
            self.inflight.popleft()
        # replies may come out of order: count the ones still pending
        return sum(1 for f in self.inflight if not f.done()) >= self.size

    def drain(self, keep: int) -> None:
        """Waits until at most ``keep`` pushes are in flight."""
        while len(self.inflight) > keep:
            fut = self.inflight.popleft()
            try:
                fut.result(timeout=self.lcfg.push_timeout_s + 5.0)
            except Exception:  # noqa: BLE001 - already handled in WeightSync.push_done
                pass

    def forget(self, swapped: Swapped) -> None:
        """Drops what was computed on weights the server no longer has, after ``swapped``
        was loaded: steps held back at a re-sync, batches accumulated on newer weights than
        a server that went back."""
        if swapped.resync:
            self._unsent.clear()
        if self._acc and swapped.version < self._acc_base and self.weights.local is None:
            self._clear_accumulator()

    def add(self, grads: dict[str, torch.Tensor], items: int) -> None:
        """The clipped, finite gradients of one batch of ``items``: pushed at once when the
        window has room, else averaged into the next push (module docstring)."""
        full = self.full()
        if not full and not self.acc_batches:
            self._push(self.weights.version, grads, items, 1)  # the common case at low RTT
            return
        self._accumulate(grads, items)
        if not full or self.acc_batches >= self.lcfg.max_batches_per_push:
            self._flush()  # waits for a slot only in the second case

    def _clear_accumulator(self) -> None:
        self._acc, self._acc_count = {}, {}
        self.acc_batches = self._acc_items = 0

    def _accumulate(self, grads: dict[str, torch.Tensor], items: int) -> None:
        version = self.weights.version
        if not self.acc_batches:
            self._acc_base = version
        self._acc_base = min(self._acc_base, version)
        for name, g in grads.items():
            if name in self._acc:
                self._acc[name].add_(g)
                self._acc_count[name] += 1
            else:
                # .grad is replaced (zero_grad(set_to_none=True)) before the next backward,
                # so the accumulator may own this tensor
                self._acc[name] = g
                self._acc_count[name] = 1
        self.acc_batches += 1
        self._acc_items += items

    def _flush(self) -> None:
        grads = {n: g / self._acc_count[n] if self._acc_count[n] > 1 else g
                 for n, g in self._acc.items()}
        base, items, batches = self._acc_base, self._acc_items, self.acc_batches
        self._clear_accumulator()
        self._push(base, grads, items, batches)

    def _push(self, base_version: int, grads: dict[str, torch.Tensor], items: int,
              batches: int) -> None:
        # only called with the gradients of a finite total norm (``Learner.update``)
        msgs = self.compressor.compress(grads, known_finite=True)
        self.seq += 1
        self.stats.pushes += 1
        self._batches_pushed += batches
        self.stats.batches_per_push = self._batches_pushed / self.stats.pushes
        if self.weights.local is None:
            self._send(base_version, [(msgs, items, self.seq)])
            return
        # local_replica: the step joins the unsent ones (learner.steps_per_push of them per
        # call); step i of a call is computed on the call's base version + i
        if not self._unsent:
            self._unsent_base = base_version
        self._unsent.append((msgs, items, self.seq))
        self.weights.pushes_since_rebase += 1
        if len(self._unsent) >= self.lcfg.steps_per_push:
            # sent before the local step, whose Adam step overlaps the call's serialisation
            self.send_unsent()
        self.weights.apply_locally(msgs, self.seq)

    def send_unsent(self) -> None:
        """Sends the steps applied locally but not yet pushed, in one call."""
        if self._unsent:
            steps, self._unsent = self._unsent, []
            self._send(self._unsent_base, steps)

    def _send(self, base_version: int, steps: list) -> None:
        """One PushGradients call of ``steps`` = [(messages, batch size, seq)], the first
        computed on ``base_version`` and each next one on the version before it makes."""
        self.drain(self.size - 1)  # blocks only when the window is full
        sent = time.monotonic()
        # the reply brings the new weights when the replica will want them (one round trip, not two)
        ask = self.weights.wants_weights_back(len(self.inflight))
        (msgs, items, _), more = steps[0], steps[1:]
        fut = self.ps.push_future(base_version, msgs, batch_size=items,
                                  timeout=self.lcfg.push_timeout_s, return_weights=ask,
                                  more_steps=[(m, b) for m, b, _ in more])
        if ask:
            self.weights.asked_weights(fut)
        seqs = [seq for _, _, seq in steps]
        fut.add_done_callback(lambda f: self.weights.push_done(f, sent, seqs))
        self.inflight.append(fut)
        self.stats.push_calls += 1
