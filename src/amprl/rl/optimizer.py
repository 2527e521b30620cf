"""The run's optimizer rule: one Adam step (or a momentum step for preconditioned 1-bit
gradients) that makes the next version of the weights. The parameter server steps its
master weights with it; a learner that applies its pushes to its own replica
(``learner.sync: local_replica``) steps the replica with the same rule, so both land on the same
weights.

Preconditioned gradients (learners send their 1-bit tensors so, see
``amprl.compression.ErrorFeedback``): the sender has already divided the gradient by the
root of its own Adam second moment, so such a parameter takes Adam's step without a second
moment here, ``m <- b1 m + (1 - b1) u;  p <- p - lr m / (1 - b1^t)``, its momentum and step
count kept apart from Adam's (``precond_avg``, ``precond_step`` in the optimizer state,
checkpointed with it), so a run that changes encoding on resume mixes no units. The step is
linear in u, which is what lets error feedback's deferred error arrive intact.

A step may name a subset of the parameters (TD3 pushes critic-only gradients between actor
updates): the others are not stepped and their moments and step counts stay as they are.

The learning rate is a function of the version the step makes (``lr_at``): constant, or
falling linearly from ``lr`` to ``lr_final`` over ``lr_decay_versions``, so a server resumed
from a checkpoint continues the schedule.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.optim.adam import adam as functional_adam


class OptimizerRule:
    """Adam over named parameters, stepped in place one version at a time (not thread-safe:
    the caller holds its own lock)."""

    def __init__(self, params: Mapping[str, nn.Parameter], *, lr: float = 1e-3,
                 adam_eps: float = 1e-8, lr_final: float | None = None,
                 lr_decay_versions: int = 0, betas: tuple[float, float] = (0.9, 0.999)):
        self.params = dict(params)
        # fused: one kernel for the whole step (CPU and CUDA), faster than foreach's and a
        # Python loop's; it runs on the server for every push and on a learner with a local
        # replica for every update.
        self.optimizer = _adam(list(self.params.values()), lr=lr, betas=betas, eps=adam_eps)
        self.lr = float(lr)
        self.lr_final = (None if lr_final is None or lr_final < 0 or lr_decay_versions <= 0
                         else float(lr_final))
        self.lr_decay_versions = int(lr_decay_versions)

    @classmethod
    def from_config(cls, cfg, params: Mapping[str, nn.Parameter]) -> "OptimizerRule":
        """The rule of a run (an ExperimentConfig's ``paramserver`` section)."""
        ps = cfg.paramserver
        return cls(params, lr=ps.lr, adam_eps=ps.adam_eps, lr_final=ps.lr_final,
                   lr_decay_versions=ps.lr_decay_versions)

    def lr_at(self, version: int) -> float:
        """The learning rate of the step that makes ``version + 1``."""
        if self.lr_final is None:
            return self.lr
        frac = min(1.0, max(0, version) / self.lr_decay_versions)
        return self.lr + (self.lr_final - self.lr) * frac

    def step(self, grads: Mapping[str, torch.Tensor], version: int, *,
             preconditioned: frozenset[str] | set[str] = frozenset(), scale: float = 1.0) -> None:
        """One optimizer step on the weights of ``version`` with ``grads`` (by name, on any
        device or float dtype; read, never written), each multiplied by ``scale``."""
        if self.lr_final is not None:
            lr = self.lr_at(version)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        momentum_only = []
        params: list[torch.Tensor] = []  # nn.Parameters, as torch's functional Adam takes them
        tensors: list[torch.Tensor] = []
        for name, g in grads.items():
            p = self.params[name]
            g = g.to(p.device, torch.float32)
            g = g * scale if scale != 1.0 else g
            if name in preconditioned:
                momentum_only.append((p, g))
                continue
            params.append(p)
            tensors.append(g)
        if params:
            self._adam_step(params, tensors)
        for p, g in momentum_only:
            self._momentum_step(p, g)

    @torch.no_grad()
    def _adam_step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """``self.optimizer.step()`` for ``params`` with ``grads``, through torch's functional
        Adam on the optimizer's own state (the same tensors, initialised as torch does, so
        checkpoints and ``torch.optim.Adam`` see no difference). The optimizer object's
        ``step`` and ``zero_grad`` add bookkeeping per call (profiler scopes, hooks, a scan of
        every parameter's ``.grad``) that costs as much as the fused kernel itself on a small
        MLP, paid per push on the server and per update by a learner with
        ``sync: local_replica``."""
        group = self.optimizer.param_groups[0]
        fused = bool(group.get("fused"))
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.optimizer.state[p]
            if "step" not in state:
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                 else torch.tensor(0.0, dtype=torch.float32))
            if "exp_avg" not in state:  # first Adam step (maybe after preconditioned ones)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        functional_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                        foreach=group.get("foreach"), fused=group.get("fused"),
                        amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    @torch.no_grad()
    def _momentum_step(self, p: nn.Parameter, u: torch.Tensor) -> None:
        """Adam's step for a preconditioned gradient u: bias-corrected momentum times lr,
        no second moment (module docstring)."""
        group = self.optimizer.param_groups[0]
        beta1 = group["betas"][0]
        state = self.optimizer.state[p]
        if "precond_avg" not in state:
            # Adam's own count stays (at 0 if it never stepped p): torch's Adam expects a
            # "step" in every non-empty state (its __setstate__ reads it on a checkpoint load)
            # (fused Adam keeps it on the parameter's device)
            state.setdefault("step", torch.zeros((), device=p.device if group.get("fused") else "cpu"))
            state["precond_step"] = torch.zeros(())
            state["precond_avg"] = torch.zeros_like(p)
        state["precond_step"] += 1
        m = state["precond_avg"].lerp_(u, 1.0 - beta1)
        p.add_(m, alpha=-group["lr"] / (1.0 - beta1 ** float(state["precond_step"])))

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` output; this rule's hyperparameters (lr, eps, betas)
        win over the saved ones (a resumed run may change its lr)."""
        hyper = [{k: g[k] for k in ("lr", "eps", "betas")} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        for g, h in zip(self.optimizer.param_groups, hyper):
            g.update(h)


def _adam(params: list[torch.Tensor], **kw) -> torch.optim.Adam:
    """Fused Adam where the device has the kernel, else the multi-tensor (foreach) one."""
    try:
        return torch.optim.Adam(params, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.Adam(params, foreach=True, **kw)
