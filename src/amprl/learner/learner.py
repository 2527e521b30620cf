"""The learner loop.

One update, read straight down:

    batch   = prefetch_queue.get()          # sampled in the background from replay
    loss    = algo.loss(batch)              # under torch.autocast (bf16 / fp16)
    grads   = backward, unscale, clip       # non-finite -> skip, never pushed
    push(compress(grads), base_version)     # async, inside a bounded window (below)
    priorities -> replay                    # async, by a background thread

Weights come back from the parameter server: a push that will leave the replica
``learner.pull_lag_versions`` or more behind asks for the weights it makes in its reply
(``return_weights``; served when the model fits one message; one such push in flight at a
time), else a background thread pulls them; the update loop swaps new weights in between updates, so network round trips
overlap with computation instead of stalling it. Weights in the reply save the pull's own
round trip and RPC (one call per push instead of two, on both sides).

Latency tolerance -- the rule
-----------------------------
The parameter server applies a push only if ``staleness = server version - base version``
is at most ``paramserver.max_staleness``. With a round trip R between learner and server
and W pushes in flight, the server advances W versions per R, and a gradient reaches it
computed on weights pulled between R/2 and 3R/2 earlier: its staleness is about W to 2W.
Hence:

* **Window.** At most ``W = learner.max_pushes_in_flight`` pushes are in flight; 0 means
  auto, ``W = max(1, max_staleness // 2)``, the widest window the staleness rule accepts.
  The window bounds optimizer steps per round trip (W / R), whatever the learner's speed.
* **Accumulate instead of waiting.** While the window is full, each new batch's clipped
  gradient is averaged into the next push (up to ``learner.max_batches_per_push`` batches;
  1 = wait for a slot, the plain bounded window). So at 300 ms RTT the learner keeps
  training at its own rate (updates/s does not collapse) and each push -- one Adam step
  on the server -- carries a larger effective batch; at low RTT the window is never full
  and every batch is its own push. The push's base version is the oldest weights any of
  its batches used (staleness is never understated). An update counts a batch trained;
  ``stats.pushes`` counts optimizer steps sent. The trade-off: averaged batches buy
  throughput, not optimizer steps -- replay's rate limiter counts sampled batches, so
  actors run ahead of the (fewer, larger) steps and steps-to-target grows. With
  ``max_batches_per_push`` 1 the learner instead runs at W / R updates/s and keeps the
  per-step sample efficiency, paying in wall-clock time.
* **Synchronous mode.** ``learner.sync: synchronous`` trades the overlap for fresh
  gradients: each update waits for its push's reply, which carries the weights the push
  made (``return_weights``; a pull when the model is too large for one message), and loads
  them before the next update (staleness 0, one round trip per update). On loopback with a
  small model (CartPole) that costs part of the update rate, and DQN learns markedly
  steadier: at the few versions of staleness of ``overlapped`` CartPole's greedy return
  oscillated instead of settling at 500.
* **Apply locally** (``learner.sync: local_replica``). The learner also applies each push
  to its own replica with the server's optimizer rule (``amprl.rl.optimizer.OptimizerRule``
  built from the same config, stepping the replica's weights in place, fed the *decoded* message, so
  exactly what the server will apply), so the next gradient is computed on the weights the
  server will hold when it arrives: with one learner, in-order delivery makes every push's
  staleness 0 however wide the window and however long the round trip -- the overlap of
  the default mode at the gradient quality of the synchronous one. The replica is still
  the server's: a push that asks for its weights in the reply (one in flight at a time,
  when ``pull_lag_versions`` pushes have gone since the last one) brings the server's
  weights W at its version V, and the replica re-bases onto them: ``replica = W + sum of
  the weight changes of our pushes the server had not applied at V`` (those sent after it
  whose reply is not back or made a version above V; the learner keeps a push's weight
  change only while such a reply is on its way, a few pushes in every
  ``pull_lag_versions``). That folds in other learners' pushes and corrects any drift (an
  Adam state that differs from the server's after a server restart; float differences
  between devices); ``stats.rebase_drift`` is the largest |replica - server| a re-base
  found (0.0 with one fp32 CPU learner: the two stores compute the same steps). A push
  whose reply comes back without weights (a model over one message) leaves the replica on
  its own steps until a re-sync.
* **Several steps per call** (``learner.steps_per_push``, ``local_replica`` only). Since the
  replica already holds each step, consecutive steps can travel together: K steps in one
  PushGradients call (``more_steps``), step i computed on base_version + i, applied by the
  server back to back, one version each -- the same optimizer steps in the same order, with
  the call's fixed cost (gRPC on both sides, request handling) shared by K. The server's
  weights trail the replica by up to K - 1 steps; held-back steps are sent when the
  prefetch queue is empty and at ``stop``. A re-sync drops the held-back steps (they were
  computed on weights the server never had).
* **Deadlines.** Every push has ``learner.push_timeout_s`` (including waiting for a lost
  connection to come back), pulls 30 s, samples 2 s; keepalive pings (grpcutil) detect a
  dead peer. A push is never resent: it may have been applied before the reply was lost.
* **Re-sync.** A FAILED_PRECONDITION (too stale, or ahead of a server that restarted from
  an older checkpoint) or a failed push (lost connection, deadline) asks the pull thread
  for the server's full current weights (``have_version=0``), which replace the replica
  whatever their version -- also a *lower* one after a server restart (the target network
  then hard-resets, see ``TargetNetwork.maybe_update``). Gradients accumulated on weights
  newer than the server's are dropped. The learner's own state -- error-feedback
  residuals, target networks, counters, the prefetched batches -- lives in this process and
  survives any number of re-syncs and reconnects (the gRPC channel reconnects by itself;
  calls wait for it under their deadlines).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from amprl import errors
from amprl.common.supervise import Supervisor
from amprl.wire.compressed import ErrorFeedback
from amprl.config import ExperimentConfig
from amprl.envs.spec import EnvSpec
from amprl.learner.algos import make_algo
from amprl.learner.feed import ReplayFeed
from amprl.learner.precision import Precision
from amprl.paramserver.client import reply_weights
from amprl.rl.models import build_model
from amprl.rl.optimizer import OptimizerRule

log = logging.getLogger(__name__)

LOG_WINDOW = 50
"""Updates averaged into the reported loss and mean Q."""


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
    rebases: int = 0
    """local_replica: times the replica was re-based onto weights from the server."""
    rebase_drift: float = 0.0
    """local_replica: largest |replica - server| over the applied pushes, at a re-base."""


class Learner:
    """Owns the model replica, target networks, error-feedback residuals, the replay feed
    (``feed``: prefetched batches in, priorities out) and the threads that sync weights with
    the parameter server."""

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
                                        min_elements=self.lcfg.onebit_min_elements,
                                        precondition=self.lcfg.onebit_precondition,
                                        eps=cfg.paramserver.adam_eps)
        self.stats = LearnerStats()
        self.version = 0
        self._params = dict(self.model.named_parameters())
        self._stop = threading.Event()
        self.on_replay: Callable[[bool], None] | None = None
        """Called with False when replay stops answering, True when it answers again (the
        learner's readiness: ``__main__`` sets its health)."""
        self.feed = ReplayFeed(cfg, replay, self.algo.to_tensors, pin=self.device.type == "cuda",
                               stop=self._stop, updates=lambda: self.stats.updates,
                               on_reachable=lambda ok: self.on_replay and self.on_replay(ok))
        self.window = self.lcfg.max_pushes_in_flight or min(256, max(1, cfg.paramserver.max_staleness // 2))
        """Pushes in flight at most (see the rule in the module docstring)."""
        # local_replica: the server's optimizer rule stepping the replica's own weights, the
        # weight change of the pushes a re-base may need (seq, {name: delta}; see
        # _apply_locally), and the version each push's reply reported (seq -> version)
        self.local = (OptimizerRule.from_config(cfg, self._params)
                      if self.lcfg.sync == "local_replica" else None)
        self._seq = 0
        self._unsent: list = []  # local_replica: steps applied locally, not yet pushed
        self._unsent_base = 0
        self._deltas: collections.deque = collections.deque()
        self._made: dict[int, int] = {}
        self._pushes_since_rebase = 0
        self._inflight: collections.deque = collections.deque()
        self._pending_weights: tuple[int, dict] | None = None
        self._pending_lock = threading.Lock()
        # the server version of the last weights the update loop took from _pending_weights:
        # set under the lock when taken, so a reply offered while they are being copied in
        # (self.version not yet updated) is compared with them, not with the older replica
        self._taken_version = 0
        self._want_pull = threading.Event()
        self._resync = threading.Event()  # the next pull fetches the full current weights
        self._newest_seen = 0
        self._incarnation = 0  # the parameter server's, from its push replies (0: not seen)
        self._weights_push = None  # the newest push that asked for its weights in the reply
        # local_replica: that push's reply is not handled yet (its callback clears this)
        self._weights_push_open = False
        # gradients averaged into the next push while the window is full
        self._acc: dict[str, torch.Tensor] = {}
        self._acc_count: dict[str, int] = {}
        self._acc_batches = 0
        self._acc_items = 0
        self._acc_base = 0
        self._batches_pushed = 0
        self._threads = Supervisor("learner")
        # learner.pin_update_thread: the CPUs the process may use (empty: no pinning); the
        # update thread gets the lowest, the other threads the rest
        self._allowed_cpus: set[int] = set()
        self._update_tid: int | None = None
        if self.lcfg.pin_update_thread:
            self._allowed_cpus = os.sched_getaffinity(0)
            if len(self._allowed_cpus) < 2:
                raise errors.ConfigError(
                    f"learner.pin_update_thread: this process may use only CPU {sorted(self._allowed_cpus)}; "
                    "it needs a second one for its other threads (set it to false)")
        self._loss_sum = 0.0
        self._q_sum = 0.0
        self._loss_n = 0

    # -- background threads -------------------------------------------------------------

    def _pin_threads(self, unpin: bool = False) -> None:
        """``learner.pin_update_thread``: the update thread on its CPU, every other thread of
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

    def _pull_loop(self) -> None:
        while not self._stop.is_set():
            self._pin_threads()  # threads started meanwhile (gRPC, pushes) off the update CPU
            if not self._want_pull.wait(timeout=0.5):
                continue
            self._want_pull.clear()
            # local_replica asks for pulls only to re-sync (after a failed or rejected push)
            resync = self._resync.is_set() or self.local is not None
            self._resync.clear()
            try:
                pending = self._pending_weights
                have = 0 if resync else (pending[0] if pending else self.version)
                version, weights = self.ps.pull(have_version=have, timeout=30.0)
            except errors.AmprlError as exc:
                log.warning("pull failed: %s", exc)
                if resync:
                    self._resync.set()
                self._stop.wait(0.2)
                self._want_pull.set()
                continue
            if resync:
                self.stats.resyncs += 1
            if weights is not None:
                # A re-sync's pull is the newest state of the server we know: the swap loads
                # it whatever its version (see "Re-sync" in the docstring). Otherwise a push
                # reply may have brought newer weights meanwhile: keep those.
                with self._pending_lock:
                    if resync or version > self._newest_held():
                        # local_replica: a re-sync forgets the pushes in flight (None)
                        self._pending_weights = ((version, weights, None)
                                                 if self.local is not None else (version, weights))

    def start(self) -> None:
        """Pulls the initial weights (blocking) and starts the background threads."""
        version, weights = self.ps.pull(have_version=0, timeout=60.0)
        self._load(version, weights)
        if self.local is not None:
            self._rebase(version, weights, anchor_seq=None)
        self.algo.on_weights(self.version, initial=True)
        log.info("push window %d, up to %d batches per push, push deadline %.1f s (max_staleness %d)",
                 self.window, self.lcfg.max_batches_per_push, self.lcfg.push_timeout_s,
                 self.cfg.paramserver.max_staleness)
        for target, name in ((self.feed.prefetch_loop, "prefetch"),
                             (self.feed.priority_loop, "priorities"), (self._pull_loop, "pull")):
            self._threads.start(target, name)

    def stop(self) -> None:
        """Sends the steps not yet pushed and waits for the pushes in flight (a partly
        accumulated push is dropped: less than one optimizer step), then stops the threads."""
        self._send_unsent()
        self._drain_pushes(0)
        self._stop.set()
        self._threads.join(timeout_s=5.0)
        self._pin_threads(unpin=True)  # the process's threads may outlive this learner
        self.algo.close()

    # -- weights ---------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, version: int, weights: dict) -> None:
        for name, value in weights.items():
            self._params[name].copy_(value.to(self.device, non_blocking=True))
        self.version = version

    def _newest_held(self) -> int:
        """The newest server version the replica has, is loading or has pending (call with
        ``_pending_lock`` held)."""
        pending = self._pending_weights
        return max(self.version, self._taken_version, pending[0] if pending else 0)

    def _swap_in_new_weights(self) -> None:
        with self._pending_lock:
            pending, self._pending_weights = self._pending_weights, None
            if pending is not None:
                self._taken_version = pending[0]
        if pending is None:
            return
        if self.local is not None:
            self._rebase(*pending)
            return
        version = pending[0]
        if version < self.version:
            self.stats.server_rollbacks += 1
            log.warning("parameter server went back from version %d to %d (restored a "
                        "checkpoint?): re-synced", self.version, version)
        if self._acc and version < self._acc_base:
            self._clear_accumulator()  # computed on weights the server no longer has
        self._load(*pending)
        self.algo.on_weights(self.version)

    @torch.no_grad()
    def _rebase(self, version: int, weights: dict, anchor_seq: int | None) -> None:
        """local_replica: replica = the server's ``weights`` at ``version`` + the changes of our
        pushes not in them (module docstring). ``anchor_seq``: the push whose reply brought
        them (the ones sent before it are in); None: a re-sync (a pull) or the start, which
        forgets every push in flight."""
        measure = anchor_seq is not None  # else there is nothing of ours to compare
        if anchor_seq is None:
            self._deltas.clear()
            self._made.clear()
            self._unsent.clear()  # computed on weights the server never had
            anchor_seq = self._seq
        pending = [d for j, d in self._deltas
                   if j > anchor_seq and (j not in self._made or self._made[j] > version)]
        drift = 0.0
        for name, p in self._params.items():
            w = weights[name].to(self.device)
            if measure:
                own = p.detach().clone()
                for d in pending:
                    if name in d:
                        own.sub_(d[name])
                drift = max(drift, float((own - w).abs().max()))
            p.copy_(w)
            for d in pending:
                if name in d:
                    p.add_(d[name])
        if version < self.version - len(pending):
            self.stats.server_rollbacks += 1
            log.warning("parameter server went back to version %d (restored a checkpoint?): "
                        "re-based onto it", version)
        self.version = version + len(pending)
        while self._deltas and (self._deltas[0][0] <= anchor_seq
                                or self._made.get(self._deltas[0][0], version + 1) <= version):
            self._made.pop(self._deltas.popleft()[0], None)
        for j in [j for j in self._made if j <= anchor_seq]:
            del self._made[j]
        self.stats.rebases += 1
        self.stats.rebase_drift = max(self.stats.rebase_drift, drift)
        self._pushes_since_rebase = 0
        self.algo.on_weights(self.version)

    @torch.no_grad()
    def _apply_locally(self, msgs: list) -> None:
        """The server's step for ``msgs`` on the replica (module docstring, "Apply locally")."""
        # what the server will decode from msgs, kept by the compressor (no decode of our own bytes)
        grads = {m.name: self.compressor.decoded[m.name].to(self.device) for m in msgs}
        # A re-base adds back the weight change of each push sent after the one whose reply
        # brought the weights, so that change is kept while such a reply is awaited or its
        # weights wait to be taken -- for a few pushes in every pull_lag_versions, not for
        # every push. Read in this order: the reply's callback queues the weights, then clears
        # the flag.
        record = self._weights_push_open
        record = record or self._pending_weights is not None
        before = {name: self._params[name].detach().clone() for name in grads} if record else None
        # the server's rule, stepping the replica's own weights in place
        self.local.step(grads, self.version,
                        preconditioned={m.name for m in msgs if m.preconditioned})
        if before is not None:
            for name, b in before.items():
                torch.sub(self._params[name].detach(), b, out=b)  # b = new - old
            self._deltas.append((self._seq, before))
            if len(self._deltas) > 4 * self.window + 64:  # replies lost and no re-base for long
                self._deltas.popleft()
        # the versions replies reported, kept for as many pushes back (one pop per push)
        self._made.pop(self._seq - (4 * self.window + 64), None)
        self.version += 1
        self.algo.on_weights(self.version)

    def _sync_weights(self) -> None:
        """Synchronous mode: waits for every push in flight, then loads the weights the last
        push made -- sent back in its reply (``return_weights``), else pulled -- into the
        replica (failures leave it to the background re-sync)."""
        last = self._inflight[-1] if self._inflight else None
        self._drain_pushes(0)
        if self._resync.is_set():
            return  # a failed or rejected push: the pull thread fetches the full weights
        if last is not None and last.done() and last.exception() is None:
            reply = last.result()
            weights = reply_weights(reply, self.device)
            if weights is not None and reply.version >= self._newest_seen:
                with self._pending_lock:
                    self._pending_weights = (reply.version, weights)
                self._swap_in_new_weights()
                return
        try:
            version, weights = self.ps.pull(have_version=self.version, timeout=30.0)
        except errors.AmprlError as exc:
            log.warning("pull failed: %s", exc)
            self._want_pull.set()
            return
        if weights is not None:
            with self._pending_lock:
                self._pending_weights = (version, weights)
            self._swap_in_new_weights()

    # -- pushes ----------------------------------------------------------------------------

    def _push_done(self, fut, sent: float, seqs: list[int]) -> None:
        try:
            self._on_push_done(fut, sent, seqs)
        finally:
            if fut is self._weights_push:
                self._weights_push_open = False  # after its weights were queued (_apply_locally)

    def _on_push_done(self, fut, sent: float, seqs: list[int]) -> None:
        try:
            reply = fut.result()
            if reply.incarnation and reply.incarnation != self._incarnation:
                if self._incarnation:
                    # the server restarted (maybe from an older checkpoint: its versions
                    # name other weights now): re-sync onto whatever it holds
                    log.warning("the parameter server restarted (incarnation %d, was %d): "
                                "re-syncing", reply.incarnation, self._incarnation)
                    self._incarnation = reply.incarnation
                    self._resync.set()
                    self._want_pull.set()
                    return
                self._incarnation = reply.incarnation
            rtt_ms = (time.monotonic() - sent) * 1e3
            a = 0.1 if self.stats.pushes_applied else 1.0
            self.stats.push_rtt_ms += a * (rtt_ms - self.stats.push_rtt_ms)
            self.stats.pushes_applied += 1
            self._newest_seen = max(self._newest_seen, reply.version)
            if self.local is not None:
                for back, seq in enumerate(reversed(seqs)):  # the reply's version is the last step's
                    self._made[seq] = reply.version - back
                weights = reply_weights(reply, self.device) if reply.weights else None
                if weights is not None:
                    with self._pending_lock:
                        pending = self._pending_weights
                        if (reply.version > self._taken_version
                                and (pending is None or pending[0] < reply.version)):
                            self._pending_weights = (reply.version, weights, seqs[-1])
                return  # the replica moves with our own pushes; no pulls but re-syncs
            if self.lcfg.sync == "synchronous":
                return  # synchronous: the update loop pulls (``_sync_weights``)
            if reply.version - self.version < self.lcfg.pull_lag_versions:
                return  # the replica is recent enough; don't pay a pull for every push
            if reply.weights and self._offer_weights(reply):
                return  # the reply brought them: no pull
            if self._weights_push is not None and not self._weights_push.done():
                return  # a push in flight asked for its weights: they are on their way
        except errors.FailedPrecondition as exc:
            self.stats.stale_rejections += 1
            if exc.current_version is not None:
                self._newest_seen = max(self._newest_seen, exc.current_version)
            self._resync.set()
        except Exception as exc:  # noqa: BLE001 - counted and logged, the loop goes on
            # lost connection, deadline, server restart: the server may now be anywhere
            self.stats.push_errors += 1
            log.warning("push failed: %s", exc)
            self._resync.set()
        self._want_pull.set()

    def _offer_weights(self, reply) -> bool:
        """Makes the weights a push reply carries the pending swap unless newer ones are
        already pending or loaded (replies and pulls can complete out of order: an older
        reply is not a server rollback); True if the replica will be at least that recent,
        so no pull is needed."""
        def newer() -> bool:
            return reply.version > self._newest_held()

        if not reply.weights:
            return False
        with self._pending_lock:
            if not newer():
                return True  # don't decode weights that would be dropped
        weights = reply_weights(reply, self.device)
        if weights is None:
            return False
        with self._pending_lock:
            if newer():
                self._pending_weights = (reply.version, weights)
        return True

    def _wants_weights_back(self) -> bool:
        """Whether a push sent now should ask for its weights in the reply: always in
        synchronous mode, else when no push in flight asked already (like pulls, one at a
        time: on a slow link a window of pushes each bringing the whole model would cost
        the model's size per push downstream, for weights the replica mostly skips) and
        the version it makes will leave the replica ``pull_lag_versions`` behind (the
        pushes in flight each add a version)."""
        if self.lcfg.sync == "synchronous":
            return True
        lag = self.lcfg.pull_lag_versions
        if self._weights_push is not None and not self._weights_push.done():
            return False
        if self.local is not None:
            return self._pushes_since_rebase >= lag  # the steps of this call counted
        made = max(self._newest_seen, self.version) + len(self._inflight) + 1
        return made - self.version >= lag

    def _drain_pushes(self, keep: int) -> None:
        while len(self._inflight) > keep:
            fut = self._inflight.popleft()
            try:
                fut.result(timeout=self.lcfg.push_timeout_s + 5.0)
            except Exception:  # noqa: BLE001 - already handled in _on_push_done
                pass

    def _window_full(self) -> bool:
        while self._inflight and self._inflight[0].done():
            self._inflight.popleft()
        # replies may come out of order: count the ones still pending
        return sum(1 for f in self._inflight if not f.done()) >= self.window

    def _clear_accumulator(self) -> None:
        self._acc, self._acc_count = {}, {}
        self._acc_batches = self._acc_items = 0

    def _accumulate(self, grads: dict[str, torch.Tensor], items: int) -> None:
        if not self._acc_batches:
            self._acc_base = self.version
        self._acc_base = min(self._acc_base, self.version)
        for name, g in grads.items():
            if name in self._acc:
                self._acc[name].add_(g)
                self._acc_count[name] += 1
            else:
                # .grad is replaced (zero_grad(set_to_none=True)) before the next backward,
                # so the accumulator may own this tensor
                self._acc[name] = g
                self._acc_count[name] = 1
        self._acc_batches += 1
        self._acc_items += items

    def _push(self, base_version: int, grads: dict[str, torch.Tensor], items: int,
              batches: int) -> None:
        # only called with the gradients of a finite total norm (``update``)
        msgs = self.compressor.compress(grads, known_finite=True)
        self._seq += 1
        self.stats.pushes += 1
        self._batches_pushed += batches
        self.stats.batches_per_push = self._batches_pushed / self.stats.pushes
        if self.local is None:
            self._send(base_version, [(msgs, items, self._seq)])
            return
        # local_replica: the step joins the unsent ones (learner.steps_per_push of them per
        # call); step i of a call is computed on the call's base version + i
        if not self._unsent:
            self._unsent_base = base_version
        self._unsent.append((msgs, items, self._seq))
        self._pushes_since_rebase += 1
        if len(self._unsent) >= self.lcfg.steps_per_push:
            # sent before the local step, whose Adam step overlaps the call's serialisation
            self._send_unsent()
        self._apply_locally(msgs)

    def _send_unsent(self) -> None:
        """Sends the steps applied locally but not yet pushed, in one call."""
        if self._unsent:
            steps, self._unsent = self._unsent, []
            self._send(self._unsent_base, steps)

    def _send(self, base_version: int, steps: list) -> None:
        """One PushGradients call of ``steps`` = [(messages, batch size, seq)], the first
        computed on ``base_version`` and each next one on the version before it makes."""
        self._drain_pushes(self.window - 1)  # blocks only when the window is full
        sent = time.monotonic()
        # the reply brings the new weights when the replica will want them (one round trip, not two)
        ask = self._wants_weights_back()
        (msgs, items, _), more = steps[0], steps[1:]
        fut = self.ps.push_future(base_version, msgs, batch_size=items,
                                  timeout=self.lcfg.push_timeout_s, return_weights=ask,
                                  more_steps=[(m, b) for m, b, _ in more])
        if ask:
            self._weights_push = fut
            self._weights_push_open = True
        seqs = [seq for _, _, seq in steps]
        fut.add_done_callback(lambda f: self._push_done(f, sent, seqs))
        self._inflight.append(fut)
        self.stats.push_calls += 1

    def _flush(self) -> None:
        grads = {n: g / self._acc_count[n] if self._acc_count[n] > 1 else g
                 for n, g in self._acc.items()}
        base, items, batches = self._acc_base, self._acc_items, self._acc_batches
        self._clear_accumulator()
        self._push(base, grads, items, batches)

    # -- the update ------------------------------------------------------------------------

    def step(self, timeout: float = 1.0) -> bool:
        """One update from the prefetch queue; False if no batch arrived within timeout.
        Raises ThreadDied once a background thread has died (the process should end)."""
        self._threads.check()
        if not self.feed.ready():
            self._send_unsent()  # no batch ready: don't hold back steps made
        batch = self.feed.get(timeout)
        if batch is None:
            return False
        self._swap_in_new_weights()
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
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
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
        grads = {n: self._params[n].grad for n in names if self._params[n].grad is not None}
        full = self._window_full()
        if not full and not self._acc_batches:
            self._push(self.version, grads, len(keys), 1)  # the common case at low RTT
        else:
            self._accumulate(grads, len(keys))
            if not full or self._acc_batches >= self.lcfg.max_batches_per_push:
                self._flush()  # waits for a slot only in the second case
        if self.lcfg.sync == "synchronous":
            self._sync_weights()
        self.stats.updates += 1
        self.stats.grad_norm = norm_value
        # one device sync for both figures
        loss_value, q_value = torch.stack([loss.detach().float(), info["q_mean"]]).tolist()
        self._loss_sum += loss_value
        self._q_sum += q_value
        self._loss_n += 1
        if self._loss_n >= LOG_WINDOW:
            self.stats.loss, self.stats.q_mean = self._loss_sum / self._loss_n, self._q_sum / self._loss_n
            self._loss_sum, self._q_sum, self._loss_n = 0.0, 0.0, 0
        return True

    def run(self, stop: threading.Event, max_updates: int | None = None) -> None:
        """Updates until ``stop`` is set (or ``max_updates`` in all); with
        ``learner.pin_update_thread`` the calling thread becomes the pinned update thread."""
        if self._allowed_cpus and self._update_tid != threading.get_native_id():
            self._update_tid = threading.get_native_id()
            self._pin_threads()
        while not stop.is_set() and (max_updates is None or self.stats.updates < max_updates):
            self.step(timeout=0.5)

    @property
    def queue_size(self) -> int:
        return self.feed.batches.qsize()

    @property
    def replay_reachable(self) -> bool:
        return self.feed.reachable
