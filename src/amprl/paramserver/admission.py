"""What a push must pass before the store applies it: every gradient checked against the
model, then the staleness verdict.

Both are plain functions of their inputs (the model's shapes; the versions and the bound),
so ``amprl.paramserver.store`` calls them under its lock and the servicer can name the step
of a multi-step push a bad gradient came in. The staleness rule itself is described in the
store's docstring.
"""

from __future__ import annotations

from typing import Mapping

import torch

from amprl.compression import nonfinite
from amprl.errors import FailedPrecondition, InvalidArgument


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
