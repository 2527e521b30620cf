"""TD3's side of the learner (an ``amprl.core.Algorithm``): twin critics every update, the
actor and the target networks every ``policy_delay``-th. The learner's loop
(``amprl.learner.learner``) is the same for every algorithm."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from amprl.algos.td3 import losses
from amprl.algos.td3.networks import TD3Model
from amprl.config import ExperimentConfig
from amprl.rl.transitions import SampledBatch
from amprl.rl.batch import Batch, sampled_to_tensors
from amprl.rl.targets import TargetNetwork, hard_update


class TD3Algo:
    """TD3 (Fujimoto et al. 2018) on a TD3Model: twin critics trained every update, the
    actor every ``policy_delay``-th update, target networks moved by tau on the same clock.

    An update that trains the critics only pushes the critic parameters (the parameter
    server's Adam leaves absent ones untouched); a policy update pushes both, from one
    backward pass of ``critic_loss + actor_loss`` (``td3_actor_loss`` detaches the critic, so
    each part gets only its own gradient).

    The targets follow the server's version clock: with one learner every push makes a
    version, so ``version // policy_delay`` counts policy updates and the Polyak step with
    tau per policy update (TargetNetwork turns a jump of k into tau_eff = 1 - (1 - tau)^k).
    """

    def __init__(self, cfg: ExperimentConfig, model: torch.nn.Module, device: torch.device):
        if not isinstance(model, TD3Model):
            raise TypeError(f"TD3Algo needs a TD3Model, got {type(model).__name__}")
        self.cfg = cfg.td3
        self.model = model
        self.device = device
        self.target = TargetNetwork(model, tau=self.cfg.tau)
        self._all = [n for n, p in model.named_parameters() if p.requires_grad]
        self._critic = [n for n in self._all if n.startswith(("critic1.", "critic2."))]

    def to_tensors(self, s: SampledBatch, pin: bool = False) -> tuple[Batch, np.ndarray]:
        """A sampled replay batch as device tensors, plus its keys (kept on the host)."""
        return sampled_to_tensors(s, self.device, pin)

    def close(self) -> None:
        """Nothing to release (TD3 runs its whole update on the calling thread)."""

    def policy_step(self, update_index: int) -> bool:
        """Update ``update_index`` (from 0) also trains the actor: every policy_delay-th."""
        return losses.policy_update_due(update_index + 1, self.cfg.policy_delay)

    def trainable_names(self, update_index: int) -> list[str]:
        return self._all if self.policy_step(update_index) else self._critic

    def loss(self, batch: Batch, update_index: int, info: dict | None = None):
        """``(loss, td_abs)`` of ``batch``; ``info`` receives ``q_mean`` and ``q_max`` (see td3_critic_loss)."""
        target = cast(TD3Model, self.target.module)  # a copy of self.model
        loss, td_abs = losses.td3_critic_loss(self.model, target, batch,
                                              noise=self.cfg.target_noise,
                                              noise_clip=self.cfg.target_noise_clip, info=info)
        if self.policy_step(update_index):
            loss = loss + losses.td3_actor_loss(self.model, batch.obs)
        return loss, td_abs

    @torch.no_grad()
    def on_weights(self, version: int, initial: bool = False) -> None:
        """Called whenever the model replica received the weights of ``version``."""
        clock = version // self.cfg.policy_delay
        if initial:
            hard_update(self.target.module, self.model)
            self.target.version = clock
        else:
            self.target.maybe_update(self.model, clock)
