"""Versioned weights: the weights a server serves, their version and revision, the life
(incarnation) they belong to, and the clients reading them; thread-safe.

It is all that serving weights needs, so a pull-only follower (``amprl.paramserver.follower``)
holds only this, and ``amprl.paramserver.store.ParameterStore`` adds the optimizer, the
staleness rule and the push ledger on top. The counters Info reports live here too, so a
follower answers Info with the same fields (its push counts stay zero).
"""

from __future__ import annotations

import collections
import copy
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Self

import torch
from torch import nn

from amprl.errors import InvalidArgument

DEFAULT_LIVE_WINDOW_S = 60.0
"""A client counts as live in Info if it called within this many seconds (or is watching)."""


class Snapshot(NamedTuple):
    """A consistent copy of the weights (``VersionedWeights.snapshot``)."""

    version: int
    weights: dict[str, torch.Tensor]
    """Copies, by name, in serving order."""
    revision: int
    """``VersionedWeights.revision`` of these weights."""
    incarnation: int = 0
    """``VersionedWeights.incarnation`` of these weights."""


def new_incarnation() -> int:
    """A random non-zero 63-bit number: one server life's name (see ``incarnation``)."""
    return secrets.randbelow(2**63 - 1) + 1


@dataclass
class Counters:
    """Cumulative counts reported by Info (since this process started)."""

    pushes_applied: int = 0
    pushes_scaled: int = 0
    pushes_rejected_stale: int = 0
    pushes_rejected_invalid: int = 0
    pushes_rejected_norm: int = 0
    """Pushes refused because a step's gradient norm exceeded the bound (store docstring)."""
    pushes_abandoned: int = 0
    """Pushes not applied because their caller had gone (deadline passed, cancelled)."""
    pushes_repeated: int = 0
    """Resends of numbered pushes answered with their first outcome."""
    steps_applied_by_learner: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    """Learner id -> optimizer steps applied from its pushes (the most recent last)."""
    max_staleness_accepted: int = 0
    staleness_sum: int = 0
    """Sum of the staleness of accepted pushes (its mean is logged at shutdown)."""
    pulls_with_weights: int = 0
    pulls_unchanged: int = 0
    gradient_bytes_received: int = 0
    transitions_trained: int = 0


@dataclass
class _Clients:
    last_seen: dict[str, float] = field(default_factory=dict)
    learners_seen: dict[str, float] = field(default_factory=dict)
    watching: dict[str, int] = field(default_factory=dict)


class VersionedWeights:
    """Weights, their version, and the clients reading them; thread-safe.

    What a server of weights needs, and all a pull-only follower holds: ``replace`` is its
    only write. ``revision`` counts every change of the weights, including one that keeps
    the version number (a follower adopting the weights of a main server that restarted
    without a checkpoint), so a cache keyed on it never serves stale bytes.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], *,
                 live_window_s: float = DEFAULT_LIVE_WINDOW_S, device: str | torch.device = "cpu"):
        if not params:
            raise InvalidArgument("a parameter store needs at least one parameter")
        self.device = torch.device(device)
        self.params: dict[str, nn.Parameter] = {
            name: nn.Parameter(t.detach().to(self.device, torch.float32).clone())
            for name, t in params.items()}
        self.shapes = {name: tuple(p.shape) for name, p in self.params.items()}
        self.live_window_s = float(live_window_s)
        self.version = 0
        self.revision = 0
        self.incarnation = new_incarnation()
        """Names this life of the weights: drawn at start, so a server that resumed from an
        older checkpoint (its versions counted again from a lower number) is told apart by
        every client; a follower takes its main server's."""
        self.checkpoint_version = 0
        self.counters = Counters()
        self._clients = _Clients()
        self._lock = threading.Lock()
        # Notified on every version change (and on close) so watchers wake at once.
        self.changed = threading.Condition(self._lock)
        self.closed = False

    @classmethod
    def from_model(cls, model: nn.Module, **kwargs) -> Self:
        return cls(dict(model.named_parameters()), **kwargs)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.params.values())

    # -- weights -----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """(version, a consistent copy of the weights in serving order, revision)."""
        with self._lock:
            return Snapshot(self.version, {n: p.detach().clone() for n, p in self.params.items()},
                            self.revision, self.incarnation)

    def replace(self, version: int, weights: Mapping[str, torch.Tensor],
                incarnation: int | None = None) -> None:
        """Takes ``weights`` (every parameter, by name) as those of ``version`` (and
        ``incarnation``, when given): how a follower adopts what it pulled. The version may
        go down (the main server resumed from an older checkpoint). InvalidArgument when
        the names or shapes differ from this store's; nothing changes then."""
        if set(weights) != set(self.params):
            missing = sorted(set(self.params) - set(weights))
            unknown = sorted(set(weights) - set(self.params))
            raise InvalidArgument(f"weights do not match the model: missing {missing[:4]}, "
                                  f"unknown {unknown[:4]}")
        for name, t in weights.items():
            if tuple(t.shape) != self.shapes[name]:
                raise InvalidArgument(f"{name}: shape {list(t.shape)} differs from the "
                                      f"model's {list(self.shapes[name])}")
        with self._lock, torch.no_grad():
            for name, p in self.params.items():
                p.copy_(weights[name])
            self.version = int(version)
            if incarnation:
                self.incarnation = int(incarnation)
            self.revision += 1
            self.changed.notify_all()

    def count_pull(self, *, unchanged: bool) -> None:
        with self._lock:
            if unchanged:
                self.counters.pulls_unchanged += 1
            else:
                self.counters.pulls_with_weights += 1

    def wait_for_version(self, have_version: int, timeout: float | None) -> int:
        """Blocks until the version differs from ``have_version`` (or timeout/close)."""
        with self._lock:
            if self.version == have_version and not self.closed:
                self.changed.wait(timeout)
            return self.version

    def close(self) -> None:
        """Wakes every waiter for good (server shutdown)."""
        with self._lock:
            self.closed = True
            self.changed.notify_all()

    # -- clients and Info ----------------------------------------------------------------

    def note_client(self, client_id: str) -> None:
        if client_id:
            with self._lock:
                self._clients.last_seen[client_id] = time.monotonic()

    def watch_started(self, client_id: str) -> None:
        with self._lock:
            self._clients.watching[client_id] = self._clients.watching.get(client_id, 0) + 1
            if client_id:
                self._clients.last_seen[client_id] = time.monotonic()

    def watch_ended(self, client_id: str) -> None:
        with self._lock:
            left = self._clients.watching.get(client_id, 0) - 1
            if left > 0:
                self._clients.watching[client_id] = left
            else:
                self._clients.watching.pop(client_id, None)
            if client_id:
                self._clients.last_seen[client_id] = time.monotonic()

    def live_clients(self) -> tuple[int, int, int]:
        """(clients_live, actors_live, learners_live) within the live window."""
        now = time.monotonic()
        horizon = now - self.live_window_s
        with self._lock:
            for d in (self._clients.last_seen, self._clients.learners_seen):
                for k in [k for k, t in d.items() if t < horizon]:
                    del d[k]  # forget ids that left, so the maps stay small
            live = set(self._clients.last_seen) | {k for k in self._clients.watching if k}
            learners = len(self._clients.learners_seen)
        return len(live), sum(1 for c in live if c.startswith("actor")), learners

    def info(self) -> dict:
        """Everything ParameterServiceInfoResponse reports, as a dict of its field names."""
        clients, actors, learners = self.live_clients()
        with self._lock:
            c = copy.copy(self.counters)
            by_learner = dict(c.steps_applied_by_learner)
            version, ckpt = self.version, self.checkpoint_version
        return {
            "version": version,
            "pushes_applied": c.pushes_applied,
            "pushes_scaled": c.pushes_scaled,
            "pushes_rejected_stale": c.pushes_rejected_stale,
            "pushes_rejected_invalid": c.pushes_rejected_invalid,
            "pushes_rejected_norm": c.pushes_rejected_norm,
            "pushes_abandoned": c.pushes_abandoned,
            "pushes_repeated": c.pushes_repeated,
            "steps_applied_by_learner": by_learner,
            "max_staleness": c.max_staleness_accepted,
            "pulls_with_weights": c.pulls_with_weights,
            "pulls_unchanged": c.pulls_unchanged,
            "gradient_bytes_received": c.gradient_bytes_received,
            "checkpoint_version": ckpt,
            "clients_live": clients,
            "actors_live": actors,
            "learners_live": learners,
            "live_window_seconds": self.live_window_s,
            "num_tensors": len(self.params),
            "num_parameters": self.num_parameters,
            "transitions_trained": c.transitions_trained,
            "incarnation": self.incarnation,
        }
