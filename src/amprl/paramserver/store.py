"""The parameter store: master weights, their optimizer, a version, and the staleness rule.

The store knows nothing of gRPC; ``amprl.paramserver.service`` adapts it. What serving
weights needs (the weights, their version, who reads them) is ``VersionedWeights``; a
pull-only follower (``amprl.paramserver.follower``) holds only that, and
``ParameterStore`` adds the optimizer and the staleness rule on top.

Staleness rule (asynchronous SGD with bounded delay, as in Ho et al. 2013 "SSP" and the
Ape-X/IMPALA learners): every applied gradient advances ``version`` by one. A learner
computes a gradient on the weights of some ``base_version``; when the gradient arrives,

    staleness = version - base_version
    staleness >  max_staleness  ->  rejected: FailedPrecondition(current_version=version);
                                    the learner pulls the newest weights and carries on
    staleness <= max_staleness  ->  applied, multiplied by 1 / (1 + staleness) when
                                    staleness_scaling is on (Zhang et al. 2016,
                                    "staleness-aware async SGD"), else as sent

A ``base_version`` ahead of ``version`` by at most ``max_staleness`` first waits up to
``reorder_wait_s`` for the version to catch up: a learner that applies its pushes locally
(``learner.sync: local_replica``) computes push k+1 on the version push k will make, and two
pushes sent back to back can reach the store in either order (each call decodes on its
own thread before taking the lock), so the store applies them in the order they were
computed. A base still ahead after the wait, or further ahead (the server restarted from
an older checkpoint), is rejected the same way, so the learner re-syncs to what the server
really holds.

A push may name a subset of the parameters (TD3 pushes critic-only gradients between
actor updates): the absent parameters are not stepped and their Adam moments and step
counts stay as they are (torch's Adam skips parameters whose ``.grad`` is None).

The optimizer step itself, Adam with a momentum step for preconditioned (1-bit) gradients
and an optional lr schedule, is ``amprl.rl.optimizer.OptimizerRule``, shared with learners
that step a replica of their own.

Every push is validated in full (names, duplicates, shapes, dtypes, finiteness) before the
store is touched: a bad push changes nothing but the ``pushes_rejected_invalid`` counter.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Self

import torch
from torch import nn

from amprl.compression import nonfinite
from amprl.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from amprl.rl.optimizer import OptimizerRule

MAX_REMEMBERED_PUSHES = 4096
MAX_LEARNERS_COUNTED = 64  # Info's steps_applied_by_learner: a few learners, a bounded map
"""Outcomes of numbered pushes kept to answer resends (the oldest forgotten beyond it)."""
_IN_PROGRESS = object()  # a numbered push being applied

DEFAULT_LIVE_WINDOW_S = 60.0
DEFAULT_REORDER_WAIT_S = 1.0
"""A client counts as live in Info if it called within this many seconds (or is watching)."""


@dataclass(frozen=True)
class Step:
    """One optimizer step of a push (``ParameterStore.apply_steps``)."""

    grads: Mapping[str, torch.Tensor]
    """Gradients by parameter name (a subset of the model's parameters)."""
    preconditioned: frozenset[str] | set[str] = frozenset()
    """Names whose gradients the sender already divided by its second moment."""
    batch_size: int = 0
    """Transitions in the batch the step was computed on (counted in Info)."""


def in_step(exc: InvalidArgument, i: int, steps: int) -> InvalidArgument:
    """``exc`` naming step ``i`` of a multi-step push ("step 2 of 3: ..."); as is for a
    one-step push."""
    return exc if steps == 1 else InvalidArgument(f"step {i} of {steps}: {exc}")


@dataclass(frozen=True)
class ApplyResult:
    """What ``ParameterStore.apply`` (or ``apply_steps``) did with a push."""

    version: int
    """Version after the step (the last step of a multi-step push)."""
    staleness: int
    """version - base_version when the gradient arrived."""
    scale: float
    """Factor the gradient was multiplied by before the optimizer step."""
    scaled: bool
    """True when staleness scaling changed the gradient (scale < 1)."""
    weights: dict[str, torch.Tensor] | None = None
    """With ``apply(..., snapshot=True)``: a copy of the weights of exactly ``version``."""
    revision: int = 0
    """The store's ``revision`` after the step (names these weights, as ``Snapshot``)."""
    repeat: bool = False
    """A resend of a push applied before: its first outcome, nothing applied now."""


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



class ParameterStore(VersionedWeights):
    """Master fp32 weights + Adam + version counter; thread-safe.

    Build it from a model (``ParameterStore.from_model``); the model's named parameters in
    ``named_parameters()`` order are the store's tensors (the order weights are served in).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], *, lr: float = 1e-3,
                 adam_eps: float = 1e-8, lr_final: float | None = None,
                 lr_decay_versions: int = 0, betas: tuple[float, float] = (0.9, 0.999),
                 max_staleness: int = 16, staleness_scaling: bool = False,
                 live_window_s: float = DEFAULT_LIVE_WINDOW_S, device: str | torch.device = "cpu",
                 reorder_wait_s: float = DEFAULT_REORDER_WAIT_S):
        if max_staleness < 0:
            raise InvalidArgument(f"max_staleness ({max_staleness}) must be >= 0")
        super().__init__(params, live_window_s=live_window_s, device=device)
        # push id -> ApplyResult or the error it got, the oldest first (MAX_REMEMBERED_PUSHES)
        self._outcomes: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self.rule = OptimizerRule(self.params, lr=lr, adam_eps=adam_eps, lr_final=lr_final,
                                  lr_decay_versions=lr_decay_versions, betas=betas)
        self.max_staleness = int(max_staleness)
        self.staleness_scaling = bool(staleness_scaling)
        self.reorder_wait_s = float(reorder_wait_s)

    # -- gradients ---------------------------------------------------------------------

    def validate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Raises InvalidArgument naming the first bad tensor; touches nothing."""
        if not grads:
            raise InvalidArgument("the push holds no gradients")
        for name, g in grads.items():
            if name not in self.shapes:
                known = ", ".join(list(self.shapes)[:8])
                raise InvalidArgument(f"{name}: not a parameter of the model (known: {known}"
                                      f"{', ...' if len(self.shapes) > 8 else ''})")
            if not isinstance(g, torch.Tensor) or not g.is_floating_point():
                raise InvalidArgument(f"{name}: gradient must be a floating-point tensor, got "
                                      f"{getattr(g, 'dtype', type(g).__name__)}")
            if tuple(g.shape) != self.shapes[name]:
                raise InvalidArgument(f"{name}: gradient shape {list(g.shape)} differs from the "
                                      f"parameter's {list(self.shapes[name])}")
        names = list(grads)
        bad = [names[i] for i in nonfinite(list(grads.values()))]
        if bad:
            raise InvalidArgument(f"{bad[0]}: gradient contains NaN or infinite values"
                                  + (f" (also {', '.join(bad[1:4])})" if len(bad) > 1 else ""))

    def apply(self, base_version: int, grads: Mapping[str, torch.Tensor], *,
              learner_id: str = "", batch_size: int = 0, wire_bytes: int = 0,
              snapshot: bool = False,
              preconditioned: frozenset[str] | set[str] = frozenset(),
              trusted: bool = False) -> ApplyResult:
        """Applies one gradient computed on ``base_version`` (see the module docstring);
        with ``snapshot`` the result also holds the weights the step made (copied under the
        same lock, so no other push can slip in between). ``preconditioned``: the names
        whose gradients the sender already divided by its second moment (module docstring).
        ``trusted``: the gradients come from this process and are known to be finite and
        of the model's names and shapes (a learner's own replica), so validation is skipped.

        Raises InvalidArgument (nothing changed but the counter) or FailedPrecondition with
        ``current_version`` when the gradient is too stale.
        """
        return self.apply_steps(base_version, [Step(grads, preconditioned, batch_size)],
                                learner_id=learner_id, wire_bytes=wire_bytes, snapshot=snapshot,
                                trusted=trusted)

    def apply_steps(self, base_version: int, steps: list[Step], *, learner_id: str = "",
                    wire_bytes: int = 0, snapshot: bool = False,
                    trusted: bool = False,
                    caller_gone: Callable[[], bool] | None = None,
                    push_id: tuple | None = None) -> ApplyResult:
        """Applies consecutive optimizer steps of one push: step i was computed on
        ``base_version + i`` (the weights the steps before it make; a learner that applies
        its own steps locally batches them so). All steps are validated before any is
        applied; the staleness rule is judged once, on ``base_version`` (every step then
        has the same staleness), and the steps are applied back to back under the lock, one
        version each. Arguments and errors as ``apply``; when ``caller_gone`` says the
        caller went away (its deadline passed while the push waited), nothing is applied
        (DeadlineExceeded): a caller that saw its push fail must be able to count on it.
        ``push_id`` (learner id, its incarnation, the push's sequence) names a push: a
        repeat of one already answered gets the first outcome (``repeat``; the same error
        for a refused one) and changes nothing."""
        if push_id is not None:
            with self._lock:
                # a resend racing its first try waits for that try's outcome
                self.changed.wait_for(lambda: self._outcomes.get(push_id) is not _IN_PROGRESS
                                      or self.closed, timeout=self.reorder_wait_s * 5)
                first = self._outcomes.get(push_id)
                if first is _IN_PROGRESS:
                    raise Unavailable(f"push {push_id[2]} of {push_id[0]} is still being applied "
                                      f"(its first try); retry for its outcome")
                if first is None:
                    self._outcomes[push_id] = _IN_PROGRESS
            if first is not None:
                with self._lock:
                    self.counters.pushes_repeated += 1
                if isinstance(first, Exception):
                    raise first
                return dataclasses.replace(first, weights=None, repeat=True)
        outcome = None
        try:
            result = self._apply_steps(base_version, steps, learner_id=learner_id,
                                       wire_bytes=wire_bytes, snapshot=snapshot,
                                       trusted=trusted, caller_gone=caller_gone)
            outcome = dataclasses.replace(result, weights=None)
        except (FailedPrecondition, InvalidArgument) as exc:
            outcome = exc
            raise
        finally:
            self._settle(push_id, outcome)
        return result

    def _settle(self, push_id: tuple | None, outcome) -> None:
        """Records a numbered push's outcome (None: not decided, a resend may be applied)."""
        if push_id is None:
            return
        with self._lock:
            if outcome is None:
                self._outcomes.pop(push_id, None)
            else:
                self._outcomes[push_id] = outcome
            while len(self._outcomes) > MAX_REMEMBERED_PUSHES:
                self._outcomes.popitem(last=False)
            self.changed.notify_all()

    def _apply_steps(self, base_version: int, steps: list[Step], *, learner_id: str,
                     wire_bytes: int, snapshot: bool, trusted: bool,
                     caller_gone: Callable[[], bool] | None) -> ApplyResult:
        with self._lock:
            self.counters.gradient_bytes_received += int(wire_bytes)
            if learner_id:
                self._clients.learners_seen[learner_id] = time.monotonic()
        try:
            if not steps:
                raise InvalidArgument("the push holds no gradients")
            if not trusted:
                for i, step in enumerate(steps):
                    try:
                        self.validate(step.grads)
                    except InvalidArgument as exc:
                        raise in_step(exc, i, len(steps)) from None
        except InvalidArgument:
            self.note_invalid_push()
            raise
        with self._lock:
            ahead = int(base_version) - self.version
            if 0 < ahead <= self.max_staleness:  # pushes computed in order, arriving out of it
                self.changed.wait_for(lambda: self.version >= int(base_version) or self.closed,
                                      timeout=self.reorder_wait_s)
            if caller_gone is not None and caller_gone():
                self.counters.pushes_abandoned += 1
                raise DeadlineExceeded(f"push on version {base_version}: its caller went away "
                                       f"before it was applied (not applied)")
            staleness = self.version - int(base_version)
            if staleness < 0 or staleness > self.max_staleness:
                self.counters.pushes_rejected_stale += 1
                if staleness < 0:
                    raise FailedPrecondition(
                        f"base_version {base_version} is ahead of the server's version "
                        f"{self.version} (the server restarted from a checkpoint?); pull the "
                        f"current weights and retry", current_version=self.version)
                raise FailedPrecondition(
                    f"gradient too stale: computed on version {base_version}, server is at "
                    f"{self.version} (staleness {staleness} > max_staleness "
                    f"{self.max_staleness}); pull the current weights", current_version=self.version)
            scale = 1.0 / (1.0 + staleness) if self.staleness_scaling else 1.0
            scaled = scale != 1.0
            for step in steps:
                self._step(step, scale)
                self.version += 1
                if scaled:
                    self.counters.pushes_scaled += 1
                else:
                    self.counters.pushes_applied += 1
                self.counters.staleness_sum += staleness
                self.counters.transitions_trained += int(step.batch_size)
            self.counters.max_staleness_accepted = max(self.counters.max_staleness_accepted,
                                                       staleness)
            if learner_id:
                by = self.counters.steps_applied_by_learner
                by[learner_id] = by.pop(learner_id, 0) + len(steps)
                while len(by) > MAX_LEARNERS_COUNTED:
                    by.popitem(last=False)
            self.revision += 1
            self.changed.notify_all()
            weights = ({n: p.detach().clone() for n, p in self.params.items()} if snapshot else None)
            return ApplyResult(self.version, staleness, scale, scaled, weights, self.revision)

    def _step(self, step: Step, scale: float) -> None:
        """One optimizer step at the current version (call with the lock held)."""
        self.rule.step(step.grads, self.version, preconditioned=step.preconditioned, scale=scale)

    @property
    def optimizer(self) -> torch.optim.Adam:
        return self.rule.optimizer

    def lr_at(self, version: int) -> float:
        """The learning rate of the step that makes ``version + 1`` (``OptimizerRule``)."""
        return self.rule.lr_at(version)

    def note_invalid_push(self) -> None:
        """Counts a push rejected as malformed before it reached ``apply``."""
        with self._lock:
            self.counters.pushes_rejected_invalid += 1

    # -- state for checkpoints -----------------------------------------------------------

    def state_dict(self) -> dict:
        """A deep copy of weights, optimizer state, version and names (for checkpoints)."""
        with self._lock:
            return {
                "version": self.version,
                "names": list(self.params),
                "shapes": [list(s) for s in self.shapes.values()],
                "params": {n: p.detach().clone().cpu() for n, p in self.params.items()},
                "optimizer": _clone_tensors(self.optimizer.state_dict()),
            }

    def load_state_dict(self, state: Mapping) -> None:
        """Restores ``state_dict()`` output; InvalidArgument if it is for another model."""
        names = list(state["names"])
        if names != list(self.params):
            raise InvalidArgument(f"checkpoint parameters {names[:4]}... do not match the "
                                  f"model's {list(self.params)[:4]}...")
        for n in names:
            t = state["params"][n]
            if tuple(t.shape) != self.shapes[n]:
                raise InvalidArgument(f"checkpoint {n}: shape {list(t.shape)} differs from the "
                                      f"model's {list(self.shapes[n])}")
        with self._lock:
            with torch.no_grad():
                for n in names:
                    self.params[n].copy_(state["params"][n].to(self.device, torch.float32))
            self.rule.load_state_dict(state["optimizer"])  # this run's lr wins over the saved one
            self.version = int(state["version"])
            self.revision += 1
            self.checkpoint_version = self.version
            self.changed.notify_all()


def _clone_tensors(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone().cpu()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tensors(v) for v in obj)
    return obj


def build_store(cfg, model: nn.Module, *, live_window_s: float | None = None,
                device: str | torch.device = "cpu") -> ParameterStore:
    """A store holding a copy of ``model``'s parameters with the run's (an
    ExperimentConfig's) optimizer rule and staleness rule.

    ``live_window_s`` (default ``DEFAULT_LIVE_WINDOW_S``) is how recently a client must have
    called to count as live in Info.
    """
    ps = cfg.paramserver
    extra = {} if live_window_s is None else {"live_window_s": live_window_s}
    return ParameterStore.from_model(model, lr=ps.lr, adam_eps=ps.adam_eps,
                                     lr_final=ps.lr_final, lr_decay_versions=ps.lr_decay_versions,
                                     max_staleness=ps.max_staleness,
                                     staleness_scaling=ps.staleness_scaling, device=device,
                                     **extra)
