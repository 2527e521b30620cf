"""The acting fast path the algorithms' acting networks share (``amprl.algos.<name>.acting``):
a chain of Linear and ReLU layers run as ``addmm``/``relu_`` over copies of its weights
(a "plan"), without the module calls. Actors and the evaluator act through it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def native_bf16() -> bool:
    """True when this CPU computes bf16 matrix products natively (AVX512-BF16 or AMX)."""
    cpu: Any = getattr(torch, "cpu", None)  # private probes: None or missing raise AttributeError
    try:
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    except AttributeError:  # an older torch without the probes: assume not
        return False


def linear_chain(seq: torch.nn.Module | None) -> list[tuple[torch.nn.Linear, bool]] | None:
    """``[(linear, relu after it)]`` of a Sequential of biased Linear and ReLU layers, or None."""
    if not isinstance(seq, torch.nn.Sequential):
        return None
    chain: list[list] = []
    for layer in seq:
        if isinstance(layer, torch.nn.Linear) and layer.bias is not None:
            chain.append([layer, False])
        elif isinstance(layer, torch.nn.ReLU) and chain and not chain[-1][1]:
            chain[-1][1] = True
        else:
            return None
    return [(linear, relu) for linear, relu in chain]


_NARROW = 16
"""Layers with at most this many outputs run as ``F.linear`` on the ``[out, in]`` weight:
MKL's ``addmm`` over a transposed weight takes a slow path there, several times slower,
while wide layers are faster as ``addmm`` (see chain_plan)."""


def layer_plan(weight: torch.Tensor, bias: torch.Tensor, relu: bool, *, transpose_wide: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, bool, bool]:
    """One layer of a plan, a copy of the current weights: ``(weight, bias, relu, narrow)``
    with the weight ``[out, in]`` for narrow layers (and for every layer unless
    ``transpose_wide``: over the Nature CNN's 3,136 features ``F.linear`` is the faster
    for a batch of actor rows) and transposed ``[in, out]`` otherwise."""
    weight, bias = weight.detach(), bias.detach().clone()
    if weight.shape[0] <= _NARROW or not transpose_wide:
        return weight.clone(), bias, relu, True
    return weight.t().contiguous(), bias, relu, False


def chain_plan(chain, *, transpose_wide: bool = True) -> list[tuple[torch.Tensor, torch.Tensor, bool, bool]]:
    """The chain's current weights as layers for ``run_plan``: wide ones transposed for
    ``addmm`` (unless not ``transpose_wide``), which skips ``F.linear``'s GEMM over a
    transposed weight."""
    return [layer_plan(lin.weight, lin.bias, relu, transpose_wide=transpose_wide) for lin, relu in chain]


def run_plan(plan, h: torch.Tensor) -> torch.Tensor:
    """The layers of a plan (``chain_plan``) applied to ``h`` ``[B, in]``."""
    for weight, bias, relu, narrow in plan:
        h = F.linear(h, weight, bias) if narrow else torch.addmm(bias, h, weight)
        if relu:
            h.relu_()
    return h
