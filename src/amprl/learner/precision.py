"""Mixed precision for a learner whose optimizer lives elsewhere (the parameter server).

``torch.autocast`` runs the forward pass in bf16 or fp16. fp16 needs loss scaling: we use
``torch.amp.GradScaler`` (initial scale 65536, growth factor 2.0, growth interval 2000, as in
the seeds) for ``scale`` / ``unscale_`` / ``update``. The scaler's bookkeeping needs an
optimizer object that owns the parameters; the learner never steps it (the parameter
server's Adam does the step), so it is a zero-lr SGD used only as the scaler's handle.
"""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, precision: str, device: torch.device, params: list[torch.nn.Parameter]):
        self.precision = precision
        self.device = device
        self.scaler = None
        self._handle = None
        if precision == "fp16":
            self.scaler = torch.amp.GradScaler(device.type, init_scale=65536.0, growth_factor=2.0,
                                               backoff_factor=0.5, growth_interval=2000)
            self._handle = torch.optim.SGD(params, lr=0.0)

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            assert self._handle is not None  # made with the scaler
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self._handle)  # grads are true gradients from here on
        else:
            loss.backward()

    def update(self) -> None:
        """Adjusts the loss scale after a step (backs off when the grads were non-finite)."""
        if self.scaler is not None:
            self.scaler.update()

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 0.0
