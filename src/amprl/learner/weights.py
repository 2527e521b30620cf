"""The learner's replica of the weights and how it follows the parameter server.

``learner.sync`` picks one of three ways:

* **overlapped** (default). A push that will leave the replica ``learner.pull_lag_versions``
  or more behind asks for the weights it makes in its reply (``return_weights``; served
  when the model fits one message; one such push in flight at a time), else the pull thread
  fetches them; the update loop swaps new weights in between updates, so round trips
  overlap with computation instead of stalling it.
* **synchronous**. Each update waits for its push's reply, which carries the weights the
  push made (a pull when the model is too large for one message), and loads them before
  the next update: staleness 0, one round trip per update. Small models, where fresh
  gradients matter more than overlap, learn steadier this way (DQN on CartPole settles
  instead of oscillating at a few versions of staleness).
* **local_replica**. The learner also applies each push to its own replica with the
  server's optimizer rule (``amprl.rl.optimizer.OptimizerRule`` from the same config, fed
  the *decoded* message, so exactly what the server will apply), so the next gradient is
  computed on the weights the server will hold when it arrives: with one learner, in-order
  delivery makes every push's staleness 0 however wide the window and however long the
  round trip. The replica is still the server's: a push that asks for its weights in the
  reply (one in flight at a time, every ``pull_lag_versions`` pushes) brings the server's
  weights W at its version V, and the replica re-bases onto them: ``replica = W + the
  weight changes of our pushes the server had not applied at V`` (those sent after it
  whose reply is not back or made a version above V). That folds in other learners' pushes
  and corrects any drift; ``stats.rebase_drift`` is the largest |replica - server| a
  re-base found. A reply without weights (a model over one message) leaves the replica on
  its own steps until a re-sync.

**Re-sync.** A FAILED_PRECONDITION (too stale, or ahead of a server that restarted from an
older checkpoint), a failed push (lost connection, deadline) or a new server incarnation
asks the pull thread for the server's full current weights (``have_version=0``), which
replace the replica whatever their version -- also a *lower* one after a server restart
(the target network then hard-resets, see ``TargetNetwork.maybe_update``). The learner's
own state (error-feedback residuals, target networks, counters, prefetched batches) lives
in the process and survives any number of re-syncs and reconnects.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from amprl import errors
from amprl.config import ExperimentConfig
from amprl.core import Algorithm, WeightSource
from amprl.paramserver.client import reply_weights
from amprl.rl.optimizer import OptimizerRule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Swapped:
    """What ``WeightSync.swap_in`` loaded: the server ``version`` and whether it was a
    re-sync (a pull of the full weights, which forgets the pushes in flight)."""
    version: int
    resync: bool


class WeightSync:
    """The replica's server version, the weights waiting to be swapped in, the pull thread,
    and what push replies mean for the replica (module docstring)."""

    def __init__(self, cfg: ExperimentConfig, params: dict[str, torch.nn.Parameter], device: torch.device,
                 paramserver: WeightSource, algo: Algorithm, stats, stop: threading.Event, compressor,
                 history: int):
        self.lcfg = cfg.learner
        self.mode = cfg.learner.sync
        self.ps = paramserver
        self.algo = algo
        self.stats = stats
        self.device = device
        self._params = params
        self._stop = stop
        self._compressor = compressor  # its ``decoded``: what the server will decode from each push
        self._history = history  # pushes back a re-base may need to know about
        self.version = 0
        # local_replica: the server's optimizer rule stepping the replica's own weights, the
        # weight change of the pushes a re-base may need (seq, {name: delta}; see
        # apply_locally), and the version each push's reply reported (seq -> version)
        self.local = OptimizerRule.from_config(cfg, params) if self.mode == "local_replica" else None
        self.deltas: collections.deque = collections.deque()
        self._made: dict[int, int] = {}
        self.pushes_since_rebase = 0
        self.pending: tuple | None = None
        """(version, weights) or, local_replica, (version, weights, anchor push seq | None)."""
        self.pending_lock = threading.Lock()
        # the server version of the last weights the update loop took from ``pending``: set
        # under the lock when taken, so a reply offered while they are being copied in
        # (self.version not yet updated) is compared with them, not with the older replica
        self.taken_version = 0
        self.want_pull = threading.Event()
        self.resync = threading.Event()  # the next pull fetches the full current weights
        self.newest_seen = 0
        self._incarnation = 0  # the parameter server's, from its push replies (0: not seen)
        self._weights_push = None  # the newest push that asked for its weights in the reply
        # local_replica: that push's reply is not handled yet (its callback clears this)
        self._weights_push_open = False

    def start(self, seq: int) -> None:
        """Pulls the initial weights (blocking) and loads them."""
        version, weights = self.ps.pull(have_version=0, timeout=60.0)
        assert weights is not None  # have_version 0 means none held: weights always come
        self.load(version, weights)
        if self.local is not None:
            self.rebase(version, weights, anchor_seq=None, seq=seq)
        self.algo.on_weights(self.version, initial=True)

    # -- the pull thread -------------------------------------------------------------------

    def pull_loop(self, on_wake: Callable[[], None] = lambda: None) -> None:
        """Pulls when asked (``want_pull``) until stopped; ``on_wake`` runs every half second."""
        while not self._stop.is_set():
            on_wake()
            if not self.want_pull.wait(timeout=0.5):
                continue
            self.want_pull.clear()
            # local_replica asks for pulls only to re-sync (after a failed or rejected push)
            resync = self.resync.is_set() or self.local is not None
            self.resync.clear()
            try:
                pending = self.pending
                have = 0 if resync else (pending[0] if pending else self.version)
                version, weights = self.ps.pull(have_version=have, timeout=30.0)
            except errors.AmprlError as exc:
                log.warning("pull failed: %s", exc)
                if resync:
                    self.resync.set()
                self._stop.wait(0.2)
                self.want_pull.set()
                continue
            if resync:
                self.stats.resyncs += 1
            if weights is not None:
                # A re-sync's pull is the newest state of the server we know: the swap loads
                # it whatever its version. Otherwise a push reply may have brought newer
                # weights meanwhile: keep those.
                with self.pending_lock:
                    if resync or version > self.newest_held():
                        # local_replica: a re-sync forgets the pushes in flight (None)
                        self.pending = ((version, weights, None)
                                        if self.local is not None else (version, weights))

    # -- loading ---------------------------------------------------------------------------

    @torch.no_grad()
    def load(self, version: int, weights: dict) -> None:
        for name, value in weights.items():
            self._params[name].copy_(value.to(self.device, non_blocking=True))
        self.version = version

    def newest_held(self) -> int:
        """The newest server version the replica has, is loading or has pending (call with
        ``pending_lock`` held)."""
        pending = self.pending
        return max(self.version, self.taken_version, pending[0] if pending else 0)

    def swap_in(self, seq: int) -> Swapped | None:
        """Loads the pending weights, if any, into the replica (the update loop calls this
        between updates); ``seq`` is the newest push sent."""
        with self.pending_lock:
            pending, self.pending = self.pending, None
            if pending is not None:
                self.taken_version = pending[0]
        if pending is None:
            return None
        if self.local is not None:
            version, weights, anchor = pending
            self.rebase(version, weights, anchor_seq=anchor, seq=seq)
            return Swapped(version, resync=anchor is None)
        version = pending[0]
        if version < self.version:
            self.stats.server_rollbacks += 1
            log.warning("parameter server went back from version %d to %d (restored a "
                        "checkpoint?): re-synced", self.version, version)
        self.load(*pending)
        self.algo.on_weights(self.version)
        return Swapped(version, resync=False)

    @torch.no_grad()
    def rebase(self, version: int, weights: dict, anchor_seq: int | None, seq: int) -> None:
        """local_replica: replica = the server's ``weights`` at ``version`` + the changes of our
        pushes not in them (module docstring). ``anchor_seq``: the push whose reply brought
        them (the ones sent before it are in); None: a re-sync (a pull) or the start, which
        forgets every push in flight."""
        measure = anchor_seq is not None  # else there is nothing of ours to compare
        if anchor_seq is None:
            self.deltas.clear()
            self._made.clear()
            anchor_seq = seq
        pending = [d for j, d in self.deltas
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
        while self.deltas and (self.deltas[0][0] <= anchor_seq
                               or self._made.get(self.deltas[0][0], version + 1) <= version):
            self._made.pop(self.deltas.popleft()[0], None)
        for j in [j for j in self._made if j <= anchor_seq]:
            del self._made[j]
        self.stats.rebases += 1
        self.stats.rebase_drift = max(self.stats.rebase_drift, drift)
        self.pushes_since_rebase = 0
        self.algo.on_weights(self.version)

    @torch.no_grad()
    def apply_locally(self, msgs: list, seq: int) -> None:
        """local_replica: the server's step for push ``seq`` of ``msgs`` on the replica."""
        # what the server will decode from msgs, kept by the compressor (no decode of our own bytes)
        grads = {m.name: self._compressor.decoded[m.name].to(self.device) for m in msgs}
        # A re-base adds back the weight change of each push sent after the one whose reply
        # brought the weights, so that change is kept while such a reply is awaited or its
        # weights wait to be taken -- for a few pushes in every pull_lag_versions, not for
        # every push. Read in this order: the reply's callback queues the weights, then clears
        # the flag.
        record = self._weights_push_open
        record = record or self.pending is not None
        before = {name: self._params[name].detach().clone() for name in grads} if record else None
        # the server's rule, stepping the replica's own weights in place
        assert self.local is not None  # called in local_replica mode only
        self.local.step(grads, self.version,
                        preconditioned={m.name for m in msgs if m.preconditioned})
        if before is not None:
            for name, b in before.items():
                torch.sub(self._params[name].detach(), b, out=b)  # b = new - old
            self.deltas.append((seq, before))
            if len(self.deltas) > self._history:  # replies lost and no re-base for long
                self.deltas.popleft()
        # the versions replies reported, kept for as many pushes back (one pop per push)
        self._made.pop(seq - self._history, None)
        self.version += 1
        self.algo.on_weights(self.version)

    def catch_up(self, last) -> Swapped | None:
        """Synchronous mode, after every push in flight is back: loads the weights the last
        push ``last`` made -- sent back in its reply, else pulled (failures leave it to the
        background re-sync)."""
        if self.resync.is_set():
            return None  # a failed or rejected push: the pull thread fetches the full weights
        if last is not None and last.done() and last.exception() is None:
            reply = last.result()
            weights = reply_weights(reply, self.device)
            if weights is not None and reply.version >= self.newest_seen:
                with self.pending_lock:
                    self.pending = (reply.version, weights)
                return self.swap_in(seq=0)
        try:
            version, weights = self.ps.pull(have_version=self.version, timeout=30.0)
        except errors.AmprlError as exc:
            log.warning("pull failed: %s", exc)
            self.want_pull.set()
            return None
        if weights is None:
            return None
        with self.pending_lock:
            self.pending = (version, weights)
        return self.swap_in(seq=0)

    # -- push replies ----------------------------------------------------------------------

    def wants_weights_back(self, in_flight: int) -> bool:
        """Whether a push sent now (with ``in_flight`` others pending) should ask for its
        weights in the reply: always in synchronous mode, else when no push in flight asked
        already (like pulls, one at a time: on a slow link a window of pushes each bringing
        the whole model would cost the model's size per push downstream, for weights the
        replica mostly skips) and the version it makes will leave the replica
        ``pull_lag_versions`` behind."""
        if self.mode == "synchronous":
            return True
        lag = self.lcfg.pull_lag_versions
        if self._weights_push is not None and not self._weights_push.done():
            return False
        if self.local is not None:
            return self.pushes_since_rebase >= lag  # the steps of this call counted
        made = max(self.newest_seen, self.version) + in_flight + 1
        return made - self.version >= lag

    def asked_weights(self, fut) -> None:
        """``fut`` is a push that asked for its weights in the reply."""
        self._weights_push = fut
        self._weights_push_open = True

    def push_done(self, fut, sent: float, seqs: list[int]) -> None:
        """The callback of a push future (pushes ``seqs``, sent at monotonic ``sent``)."""
        try:
            self._on_push_done(fut, sent, seqs)
        finally:
            if fut is self._weights_push:
                self._weights_push_open = False  # after its weights were queued (apply_locally)

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
                    self.resync.set()
                    self.want_pull.set()
                    return
                self._incarnation = reply.incarnation
            rtt_ms = (time.monotonic() - sent) * 1e3
            a = 0.1 if self.stats.pushes_applied else 1.0
            self.stats.push_rtt_ms += a * (rtt_ms - self.stats.push_rtt_ms)
            self.stats.staleness += a * (reply.staleness - self.stats.staleness)
            self.stats.pushes_applied += 1
            self.newest_seen = max(self.newest_seen, reply.version)
            if self.local is not None:
                for back, seq in enumerate(reversed(seqs)):  # the reply's version is the last step's
                    self._made[seq] = reply.version - back
                weights = reply_weights(reply, self.device) if reply.weights else None
                if weights is not None:
                    with self.pending_lock:
                        pending = self.pending
                        if (reply.version > self.taken_version
                                and (pending is None or pending[0] < reply.version)):
                            self.pending = (reply.version, weights, seqs[-1])
                return  # the replica moves with our own pushes; no pulls but re-syncs
            if self.mode == "synchronous":
                return  # the update loop catches up (``catch_up``)
            if reply.version - self.version < self.lcfg.pull_lag_versions:
                return  # the replica is recent enough; don't pay a pull for every push
            if reply.weights and self.offer_weights(reply):
                return  # the reply brought them: no pull
            if self._weights_push is not None and not self._weights_push.done():
                return  # a push in flight asked for its weights: they are on their way
        except errors.FailedPrecondition as exc:
            self.stats.stale_rejections += 1
            if exc.current_version is not None:
                self.newest_seen = max(self.newest_seen, exc.current_version)
            self.resync.set()
        except Exception as exc:  # noqa: BLE001 - counted and logged, the loop goes on
            # lost connection, deadline, server restart: the server may now be anywhere
            self.stats.push_errors += 1
            log.warning("push failed: %s", exc)
            self.resync.set()
        self.want_pull.set()

    def offer_weights(self, reply) -> bool:
        """Makes the weights a push reply carries the pending swap unless newer ones are
        already pending or loaded (replies and pulls can complete out of order: an older
        reply is not a server rollback); True if the replica will be at least that recent,
        so no pull is needed."""
        def newer() -> bool:
            return reply.version > self.newest_held()

        if not reply.weights:
            return False
        with self.pending_lock:
            if not newer():
                return True  # don't decode weights that would be dropped
        weights = reply_weights(reply, self.device)
        if weights is None:
            return False
        with self.pending_lock:
            if newer():
                self.pending = (reply.version, weights)
        return True
