"""The parameter store: master weights, their optimizer, a version, and the staleness rule.

The store knows nothing of gRPC; ``amprl.paramserver.service`` adapts it. What serving
weights needs (the weights, their version, who reads them) is
``amprl.paramserver.weights.VersionedWeights``; a pull-only follower
(``amprl.paramserver.follower``) holds only that, and ``ParameterStore`` adds the optimizer
and the staleness rule on top (the checks, ``admission``; the resends, ``ledger``).

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

Bounded updates: no push moves the weights further than a bound on its size. Each step's
global gradient norm is judged against the bound of ``admission.PushNormBound`` (an absolute
cap, and a multiple of the median norm of recently accepted steps; the formula and its
reasons are there) right before the staleness rule: it judges what the push holds, so a
huge push is refused as such (InvalidArgument, counted in ``pushes_rejected_norm``) whether
or not it is also stale. A refused push changes nothing else: weights, optimizer moments,
version and the norm statistic stay as they were.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Mapping, cast

import torch
from torch import nn

from amprl.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from amprl.paramserver.admission import (PushNormBound, admit, in_step, push_norm,
                                         validate_gradients)
from amprl.paramserver.ledger import PushLedger
from amprl.paramserver.weights import DEFAULT_LIVE_WINDOW_S, VersionedWeights
from amprl.rl.optimizer import OptimizerRule

MAX_LEARNERS_COUNTED = 64
"""Info's steps_applied_by_learner counts a few learners: a bounded map."""

DEFAULT_REORDER_WAIT_S = 1.0
"""How long a push whose base version is ahead of the store's waits for it to catch up."""


@dataclass(frozen=True)
class Step:
    """One optimizer step of a push (``ParameterStore.apply_steps``)."""

    grads: Mapping[str, torch.Tensor]
    """Gradients by parameter name (a subset of the model's parameters)."""
    preconditioned: frozenset[str] | set[str] = frozenset()
    """Names whose gradients the sender already divided by its second moment."""
    batch_size: int = 0
    """Transitions in the batch the step was computed on (counted in Info)."""


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
                 reorder_wait_s: float = DEFAULT_REORDER_WAIT_S,
                 norm_bound: PushNormBound | None = None):
        if max_staleness < 0:
            raise InvalidArgument(f"max_staleness ({max_staleness}) must be >= 0")
        super().__init__(params, live_window_s=live_window_s, device=device)
        self.norm_bound = PushNormBound() if norm_bound is None else norm_bound
        """The bound on each step's gradient norm (module docstring), owned by this store."""
        self._ledger = PushLedger(self.changed, lambda: self.closed)
        self.rule = OptimizerRule(self.params, lr=lr, adam_eps=adam_eps, lr_final=lr_final,
                                  lr_decay_versions=lr_decay_versions, betas=betas)
        self.max_staleness = int(max_staleness)
        self.staleness_scaling = bool(staleness_scaling)
        self.reorder_wait_s = float(reorder_wait_s)

    # -- gradients ---------------------------------------------------------------------

    def validate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Raises InvalidArgument naming the first bad tensor; touches nothing."""
        validate_gradients(grads, self.shapes)

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
            first = self._ledger.claim(push_id, self.reorder_wait_s * 5)
            if first is not None:
                with self._lock:
                    self.counters.pushes_repeated += 1
                if isinstance(first, Exception):
                    raise first
                return dataclasses.replace(cast(ApplyResult, first), weights=None, repeat=True)
        outcome: ApplyResult | Exception | None = None
        try:
            result = self._apply_steps(base_version, steps, learner_id=learner_id,
                                       wire_bytes=wire_bytes, snapshot=snapshot,
                                       trusted=trusted, caller_gone=caller_gone)
            outcome = dataclasses.replace(result, weights=None)
        except (FailedPrecondition, InvalidArgument) as exc:
            outcome = exc
            raise
        finally:
            if push_id is not None:
                self._ledger.settle(push_id, outcome)
        return result

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
        norms = [push_norm(step.grads) for step in steps]  # before the lock: it reads every value
        with self._lock:
            ahead = int(base_version) - self.version
            if 0 < ahead <= self.max_staleness:  # pushes computed in order, arriving out of it
                self.changed.wait_for(lambda: self.version >= int(base_version) or self.closed,
                                      timeout=self.reorder_wait_s)
            if caller_gone is not None and caller_gone():
                self.counters.pushes_abandoned += 1
                raise DeadlineExceeded(f"push on version {base_version}: its caller went away "
                                       f"before it was applied (not applied)")
            try:
                self.norm_bound.check(norms)
            except InvalidArgument:
                self.counters.pushes_rejected_norm += 1
                raise
            try:
                staleness, scale = admit(base_version, self.version, self.max_staleness,
                                         self.staleness_scaling)
            except FailedPrecondition:
                self.counters.pushes_rejected_stale += 1
                raise
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
            self.norm_bound.accept(norms)
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

    def info(self) -> dict:
        """``VersionedWeights.info`` and the bound a step's gradient norm is judged by now."""
        out = super().info()
        with self._lock:
            out["push_norm_bound"] = self.norm_bound.bound
        return out

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
                "push_norms": self.norm_bound.norms(),
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
            self.norm_bound.load(state.get("push_norms", []))  # none in older checkpoints
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
    bound = PushNormBound(max_norm=ps.max_push_norm, ratio=ps.max_push_norm_ratio,
                          window=ps.push_norm_window, floor=ps.push_norm_floor)
    return ParameterStore.from_model(model, lr=ps.lr, adam_eps=ps.adam_eps,
                                     lr_final=ps.lr_final, lr_decay_versions=ps.lr_decay_versions,
                                     max_staleness=ps.max_staleness,
                                     staleness_scaling=ps.staleness_scaling, device=device,
                                     norm_bound=bound, **extra)
