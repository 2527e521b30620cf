"""What a push must pass before the store applies it: every gradient checked against the
model, then the bound on its size (``PushNormBound``), then the staleness verdict.

The checks are plain functions of their inputs (the model's shapes; the versions and the
bound), and the size rule is a small object holding its statistic, so
``amprl.paramserver.store`` calls them under its lock and the servicer can name the step
of a multi-step push a bad gradient came in. The staleness rule itself is described in the
store's docstring.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Mapping, Sequence

import torch

from amprl.compression import nonfinite
from amprl.errors import FailedPrecondition, InvalidArgument

# The defaults of paramserver.max_push_norm, max_push_norm_ratio, push_norm_window and
# push_norm_floor (amprl.config.sections, which says why each).
DEFAULT_MAX_PUSH_NORM = 1.0e6
DEFAULT_MAX_PUSH_NORM_RATIO = 100.0
DEFAULT_PUSH_NORM_WINDOW = 100
DEFAULT_PUSH_NORM_FLOOR = 10.0


def in_step(exc: InvalidArgument, i: int, steps: int) -> InvalidArgument:
    """``exc`` naming step ``i`` of a multi-step push ("step 2 of 3: ..."); as is for a
    one-step push."""
    return exc if steps == 1 else InvalidArgument(f"step {i} of {steps}: {exc}")


def validate_gradients(grads: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple]) -> None:
    """Raises InvalidArgument naming the first bad tensor of ``grads`` (by name, for a model
    of parameters ``shapes``); touches nothing."""
    if not grads:
        raise InvalidArgument("the push holds no gradients")
    for name, g in grads.items():
        if name not in shapes:
            known = ", ".join(list(shapes)[:8])
            raise InvalidArgument(f"{name}: not a parameter of the model (known: {known}"
                                  f"{', ...' if len(shapes) > 8 else ''})")
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            raise InvalidArgument(f"{name}: gradient must be a floating-point tensor, got "
                                  f"{getattr(g, 'dtype', type(g).__name__)}")
        if tuple(g.shape) != shapes[name]:
            raise InvalidArgument(f"{name}: gradient shape {list(g.shape)} differs from the "
                                  f"parameter's {list(shapes[name])}")
    names = list(grads)
    bad = [names[i] for i in nonfinite(list(grads.values()))]
    if bad:
        raise InvalidArgument(f"{bad[0]}: gradient contains NaN or infinite values"
                              + (f" (also {', '.join(bad[1:4])})" if len(bad) > 1 else ""))


def admit(base_version: int, version: int, max_staleness: int,
          staleness_scaling: bool) -> tuple[int, float]:
    """(staleness, scale) of a push computed on ``base_version`` that finds the store at
    ``version``: staleness = version - base_version, and the push is applied times ``scale``
    (1 / (1 + staleness) with ``staleness_scaling``, else 1).

    Raises FailedPrecondition with ``current_version`` when the staleness exceeds
    ``max_staleness`` or is negative (the base is ahead of the server's version).
    """
    staleness = version - int(base_version)
    if staleness < 0:
        raise FailedPrecondition(
            f"base_version {base_version} is ahead of the server's version "
            f"{version} (the server restarted from a checkpoint?); pull the "
            f"current weights and retry", current_version=version)
    if staleness > max_staleness:
        raise FailedPrecondition(
            f"gradient too stale: computed on version {base_version}, server is at "
            f"{version} (staleness {staleness} > max_staleness "
            f"{max_staleness}); pull the current weights", current_version=version)
    return staleness, (1.0 / (1.0 + staleness) if staleness_scaling else 1.0)


def push_norm(grads: Mapping[str, torch.Tensor]) -> float:
    """The global L2 norm of one step's gradients, sqrt(sum over tensors of sum g^2), as
    they will be applied (decoded: a 1-bit tensor's values are its block scales, signed).

    Summed in float32; a total that overflows it (any element above ~1.8e19 can) is
    measured again in float64, so a refusal names the real norm."""
    tensors = [g if g.dtype == torch.float32 else g.float() for g in grads.values()]
    if not tensors:
        return 0.0
    device = tensors[0].device
    norms = torch.stack([torch.linalg.vector_norm(g).to(device) for g in tensors])
    total = float(torch.linalg.vector_norm(norms, dtype=torch.float64))
    if math.isinf(total):
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64).to(device)
                             for g in tensors])
        total = float(torch.linalg.vector_norm(norms))
    return total


class PushNormBound:
    """The bounded-update rule: how far one optimizer step may move the weights, judged by
    the global L2 norm of its gradient (``push_norm``; before staleness scaling, which only
    shrinks it). With m the median norm of the last ``window`` accepted steps::

        bound = max_norm                                    until ``window`` steps are accepted
        bound = min(max_norm, max(floor, ratio * m))        from then on

    and a step whose norm exceeds the bound is refused (InvalidArgument): the store applies
    nothing of its push and this statistic does not change. Why each part:

    * the ratio to recent norms, because gradient norms have no unit a server could know:
      a clipped dense gradient is at most ``learner.grad_clip_norm`` (10), while a 1-bit
      preconditioned one is normalised per element by its sender (norm ~ sqrt(elements):
      ~1.3e3 for the Nature CNN's 1.7M parameters). Legit norms drift 10x and more over a
      run (TD errors shrink as the values fit, grow with the returns), so ``ratio`` is
      generous (100) and the statistic moves with them;
    * the median, because one large accepted step (up to ``ratio`` x m) does not move it,
      while a real trend moves it within ``window / 2`` steps;
    * accepted steps only, so a stream of refused pushes cannot raise the bound for the
      next one;
    * ``floor``, because a sparse reward's first gradient can be thousands of times the
      near-zero median of the zero-reward steps before it, and refusing it would refuse it
      for good (prioritized replay keeps sampling it, and refused norms never enter the
      median): a step at or under the floor is never refused by the ratio;
    * ``max_norm``, an absolute cap that holds from the first push on (the ratio needs a
      full window first) and caps how far the bound can climb.

    Not thread-safe: the store calls it under its lock. ``norms``/``load`` carry the window
    through checkpoints, so a resumed server judges by the statistic it had.
    """

    def __init__(self, *, max_norm: float = DEFAULT_MAX_PUSH_NORM,
                 ratio: float = DEFAULT_MAX_PUSH_NORM_RATIO, window: int = DEFAULT_PUSH_NORM_WINDOW,
                 floor: float = DEFAULT_PUSH_NORM_FLOOR):
        if not max_norm > 0 or not ratio > 1 or window < 1 or not floor >= 0:
            raise InvalidArgument(f"push norm bound: max_push_norm ({max_norm}) must be > 0, "
                                  f"max_push_norm_ratio ({ratio}) > 1, push_norm_window "
                                  f"({window}) >= 1 and push_norm_floor ({floor}) >= 0")
        self.max_norm, self.ratio, self.floor = float(max_norm), float(ratio), float(floor)
        self.window = int(window)
        self._norms: collections.deque[float] = collections.deque(maxlen=self.window)
        self.bound = self.max_norm
        """The largest norm a step may have now."""
        self.median = 0.0
        """m above (0 during the warm-up)."""

    def check(self, norms: Sequence[float]) -> None:
        """Raises InvalidArgument for the first of a push's step norms over the bound, with
        the norm, the bound, where the bound comes from and the knob to change; changes
        nothing."""
        for i, norm in enumerate(norms):
            if norm > self.bound:
                raise in_step(InvalidArgument(
                    f"gradient norm {norm:.4g} exceeds the bound {self.bound:.4g} "
                    f"({self._why()}); not applied. Clip gradients on the learner "
                    f"(learner.grad_clip_norm), or raise {self._knob()} if such steps are "
                    f"expected"), i, len(norms))

    def accept(self, norms: Sequence[float]) -> None:
        """Records the step norms of an applied push and moves the bound."""
        self._norms.extend(norms)
        if len(self._norms) == self.window:
            self.median = statistics.median(self._norms)
            self.bound = min(self.max_norm, max(self.floor, self.ratio * self.median))

    def norms(self) -> list[float]:
        """The window, oldest first (for checkpoints)."""
        return list(self._norms)

    def load(self, norms: Sequence[float]) -> None:
        """Restores ``norms()`` output (the newest ``window`` of it)."""
        self._norms.clear()
        self.bound, self.median = self.max_norm, 0.0
        self.accept([float(n) for n in norms][-self.window:])

    def _why(self) -> str:
        if len(self._norms) < self.window:
            return (f"paramserver.max_push_norm, until {self.window} steps are accepted "
                    f"({len(self._norms)} so far) and the ratio to their median applies")
        if self.bound == self.max_norm:
            return (f"paramserver.max_push_norm, below {self.ratio:g} x {self.median:.4g}, "
                    f"the median norm of the last {self.window} accepted steps")
        if self.bound == self.floor:
            return (f"paramserver.push_norm_floor, above {self.ratio:g} x {self.median:.4g}, "
                    f"the median norm of the last {self.window} accepted steps")
        return (f"paramserver.max_push_norm_ratio {self.ratio:g} x {self.median:.4g}, the "
                f"median norm of the last {self.window} accepted steps "
                f"(paramserver.push_norm_window)")

    def _knob(self) -> str:
        full = len(self._norms) == self.window
        return ("paramserver.max_push_norm" if not full or self.bound == self.max_norm
                else "paramserver.push_norm_floor" if self.bound == self.floor
                else "paramserver.max_push_norm_ratio")
