"""Sender-side error feedback: the state a sender keeps across steps so that what the
compressor drops now is sent later, and (for 1-bit) the preconditioner that lets the
server's optimizer stay linear in what it receives.

The maths of one tensor's encoding is in ``amprl.compression.codecs``; this keeps, per
parameter, the residual and the second moment between steps and answers each step's
``Encoded`` tensors. ``amprl.wire.compressed.ErrorFeedback`` is the same state answering
``amprl.v1.CompressedTensor`` messages, what a learner pushes.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from amprl.compression.codecs import (DEFAULT_BLOCK_SIZE, DEFAULT_MIN_ELEMENTS, DENSE_DTYPES,
                                      Encoded, check_encoding, encode_tensor, nonfinite,
                                      onebit_compress, to_bytes, to_wire)
from amprl.errors import InvalidArgument


class ErrorFeedback:
    """Sender-side error feedback: what the compressor drops now is sent later.

    For each parameter (by name) a residual r is kept across steps::

        e = g + r;   send C(e);   r <- e - D(C(e))

    so after T steps  sum_t D(C(e_t)) = sum_t g_t - r_T : the receiver has seen every
    gradient except the last residual, which stays bounded (1-bit with mean-|e| block scales
    is a contraction: ||e - D(C(e))||^2 <= ||e||^2 - ||e||_1^2/n per block).

    ``encoding`` "fp32" is lossless and keeps no residual; "bf16"/"fp16"/"onebit" do.
    Tensors with fewer than ``min_elements`` elements always go dense fp32 and keep a zero
    residual.

    ``precondition`` (onebit only; learners always turn it on):
    each 1-bit tensor is first divided element-wise by the root of its running mean square,
    Adam's bias-corrected second moment kept here with ``beta2`` and ``eps``::

        v <- beta2 v + (1 - beta2) g^2;   u = g / (sqrt(v / (1 - beta2^t)) + eps)

    (t counting this tensor's own steps), and u, not g, goes through error feedback with
    ``preconditioned`` set on what is sent. Why: Adam on the parameter server would divide by
    the root mean square of the *decoded* gradient, whose elements in a block all have the
    block's magnitude, so it steps large- and small-gradient elements alike and its step is
    no longer linear in the gradient, which breaks error feedback's promise through the
    optimizer (measured on CartPole: 1 of 3 seeds solved). The sender still has the exact
    gradient, so it computes the second moment; the server applies momentum and lr to the
    already-normalised u (RMSprop-with-momentum arrangement of Adam). Same idea as 1-bit Adam
    (Tang et al. 2021), which freezes the variance instead of moving it to the sender.

    Learner restart: residuals live only in the learner's memory and start at zero in a new
    process. That is deliberate. A residual is less than one step's worth of gradient
    (bounded as above), it refers to weights the parameter server has since moved past, and
    persisting it would tie learner checkpoints to server versions for no measurable gain:
    losing it drops under one step of error, once. The preconditioner's second moments start
    at zero too (with its bias correction, like Adam's first steps). A learner that re-syncs
    (a stale or lost push) keeps residuals and second moments: they are still the error of
    what it sent and the statistics of its gradients; ``reset()`` exists for callers that
    want to forget them.
    """

    def __init__(self, encoding: str = "onebit", block_size: int = DEFAULT_BLOCK_SIZE,
                 min_elements: int = DEFAULT_MIN_ELEMENTS, *, precondition: bool = False,
                 beta2: float = 0.999, eps: float = 1e-8):
        self.encoding = check_encoding(encoding)
        if block_size < 1:
            raise InvalidArgument(f"block_size ({block_size}) must be >= 1")
        if not 0.0 <= beta2 < 1.0 or eps <= 0.0:
            raise InvalidArgument(f"beta2 ({beta2}) must be in [0, 1) and eps ({eps}) > 0")
        self.block_size = block_size
        self.min_elements = max(0, int(min_elements))
        self.precondition = bool(precondition) and self.encoding == "onebit"
        self.beta2, self.eps = float(beta2), float(eps)
        self.residuals: dict[str, torch.Tensor] = {}
        """name -> residual (read-only for callers: bf16/fp16 ones are views into a flat buffer)."""
        self.second_moments: dict[str, tuple[int, torch.Tensor]] = {}
        """name -> (steps, running mean of g^2) for preconditioned tensors."""
        self.decoded: dict[str, torch.Tensor] = {}
        """name -> D(C(e)) of the last ``compress``: exactly what decoding what it sent
        gives (float32, on the gradients' device), kept so that a sender that mirrors the
        receiver's step (``learner.sync: local_replica``) need not decode its own messages."""
        self._flat_residual: tuple | None = None
        """bf16/fp16: (key, flat buffer, views) of the last step's residuals (_compress_lowp)."""

    def reset(self) -> None:
        """Forgets every residual and second moment."""
        self.residuals.clear()
        self.second_moments.clear()
        self._flat_residual = None

    def _precondition(self, name: str, g: torch.Tensor) -> torch.Tensor:
        steps, v = self.second_moments.get(name, (0, None))
        if v is None or v.shape != g.shape or v.device != g.device:
            steps, v = 0, torch.zeros_like(g)
        steps += 1
        v.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        self.second_moments[name] = (steps, v)
        denom = (v / (1.0 - self.beta2 ** steps)).sqrt_().add_(self.eps)
        return g / denom

    def residual_norm(self) -> float:
        """L2 norm of all residuals together (for logging)."""
        if not self.residuals:
            return 0.0
        return float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(r.float()) for r in self.residuals.values()])))

    def _dense(self, numel: int) -> bool:
        return self.encoding == "fp32" or numel < self.min_elements

    def compress(self, grads: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 *, known_finite: bool = False) -> list[Encoded]:
        """Encodes one step's gradients (name -> tensor, any device) and updates residuals
        (and, with ``precondition``, second moments).

        Raises InvalidArgument, leaving every residual untouched, if any gradient holds NaN
        or Inf: such a step must be skipped, not folded into the residual forever.
        ``known_finite``: the caller has checked that already (a learner's finite total
        gradient norm), so the per-tensor check is skipped.
        """
        items = list(grads.items() if isinstance(grads, Mapping) else grads)
        if items and not known_finite:
            bad = [items[i][0] for i in nonfinite([g for _, g in items])]
            if bad:
                raise InvalidArgument(f"non-finite gradient in {', '.join(bad)}; step not encoded")
        out: list = [None] * len(items)
        self.decoded = decoded = {}
        lowp = []  # bf16 / fp16 tensors: encoded together, as one flat buffer (_compress_lowp)
        for i, (name, g) in enumerate(items):
            g = g.detach()
            if self._dense(g.numel()):
                self.residuals.pop(name, None)
                out[i] = encode_tensor(name, g, "fp32")
                decoded[name] = g.to(torch.float32)
                continue
            if self.encoding != "onebit":
                lowp.append(i)
                continue
            e = g.to(torch.float32)
            if self.precondition:
                e = self._precondition(name, e)
            # e + r is built in the residual's own buffer, which then becomes the new
            # residual in place (e - decoded): no full-size temporaries per step, which count
            # for a 3.3M-parameter Nature CNN; never in the caller's gradient
            r = self.residuals.get(name)
            if r is not None and r.shape == g.shape and r.device == g.device:
                e = r.add_(e)
            elif e is g:
                e = e.clone()
            packed, scales, approx = onebit_compress(e, self.block_size)
            out[i] = Encoded(name, self.encoding, tuple(g.shape), to_bytes(packed), to_bytes(scales),
                             self.block_size, self.precondition)
            self.residuals[name] = e.sub_(approx.view(e.shape))
            decoded[name] = approx.view(g.shape)
        if lowp:
            for i, msg in zip(lowp, self._compress_lowp([(items[i][0], items[i][1].detach()) for i in lowp])):
                out[i] = msg
        return out

    def _compress_lowp(self, items: list[tuple[str, torch.Tensor]]) -> list[Encoded]:
        """bf16 / fp16 with error feedback for several tensors at once: the same element-wise
        steps as one tensor at a time (e = g + r, send e rounded, r <- e - rounded), each run
        once over all of them in one flat buffer: add, round, widen, subtract and the byte
        copy once per step instead of once per tensor (on a CPU learner with a handful of
        256-wide layers the per-operation cost, not the arithmetic, was most of the
        encoding's time).

        The residuals of the step's tensors live in one flat fp32 buffer, ``residuals[name]``
        being views into it, kept while the next steps carry the same tensors; a step with a
        different set (TD3's critic-only steps between its actor-and-critic ones) first
        copies them into a buffer of its own (one copy)."""
        wire_dtype, int_view, _ = DENSE_DTYPES[self.encoding]
        names = [n for n, _ in items]
        shapes = [g.shape for _, g in items]
        device = items[0][1].device
        key = (tuple(names), tuple(shapes), device)
        cached = self._flat_residual
        sizes = [math.prod(s) for s in shapes]
        if cached is not None and cached[0] == key:
            flat_r, views = cached[1], cached[2]
        else:  # the residuals of these tensors (zero where none fits) in one buffer
            parts = []
            for (name, g) in items:
                r = self.residuals.get(name)
                if r is not None and r.shape == g.shape and r.device == g.device:
                    parts.append(r.reshape(-1))
                else:
                    parts.append(torch.zeros(g.numel(), device=device))
            flat_r = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            views = [v.view(s) for v, s in zip(flat_r.split(sizes), shapes)]
            self.residuals.update(zip(names, views))
            self._flat_residual = (key, flat_r, views)
        torch._foreach_add_(views, [g for _, g in items])  # e = g + r, in r's buffer
        e = flat_r
        lowp = to_wire(e, wire_dtype)
        approx = lowp.to(torch.float32)
        e.sub_(approx)  # the new residuals, in place (their views stay valid)
        wire = lowp.view(int_view).cpu().numpy()
        out, offset = [], 0
        for name, shape, a in zip(names, shapes, approx.split(sizes)):
            n = a.numel()
            out.append(Encoded(name, self.encoding, tuple(shape), wire[offset:offset + n].tobytes()))
            self.decoded[name] = a.view(shape)
            offset += n
        return out

    encode = compress
