"""DQN losses: n-step double DQN with a Huber loss weighted by importance weights.

The target for transition i (Hessel et al. 2018; Horgan et al. 2018, Ape-X):

    y_i = R_i + D_i * Q_target(s'_i, argmax_a Q_online(s'_i, a))     (double)
    y_i = R_i + D_i * max_a Q_target(s'_i, a)                         (plain)

with R_i the n-step return sum_{k<n} gamma^k r_{t+k} and D_i = gamma^k (k steps taken, 0
when the episode terminated within them), both computed by the actors; gamma is already
in D, so the loss takes no gamma. No gradient flows through y. The loss is
mean_i(w_i * huber(Q_online(s_i, a_i) - y_i)) and |delta_i| is the new priority.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from amprl.rl.batch import Batch, weights_or_ones


def dqn_targets(online: nn.Module, target: nn.Module, batch: Batch, *,
                double: bool = True) -> torch.Tensor:
    """y = R + D * Q_target(s', a*), a* from the online net (double) or the target net."""
    with torch.no_grad():
        q_next_target = target(batch.next_obs).float()
        if double:
            q_next_online = online(batch.next_obs)
            a_star = q_next_online.argmax(dim=1, keepdim=True)
            q_next = q_next_target.gather(1, a_star).squeeze(1)
        else:
            q_next = q_next_target.max(dim=1).values
        return batch.rewards.float() + batch.discounts.float() * q_next


def dqn_loss(online: nn.Module, target: nn.Module, batch: Batch, *, double: bool = True,
             huber_delta: float = 1.0,
             targets: Callable[[], torch.Tensor] | None = None,
             info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(loss, td_abs)``: the IS-weighted mean Huber loss (scalar, float32, with
    grad through ``online``) and the per-sample |Q(s,a) - y| ([B], float32, detached).

    Runs under the caller's autocast; Q values are promoted to float32 before the loss.
    ``targets``: returns y (``dqn_targets`` of the same batch) when called after the online
    forward pass over s, e.g. the result of a future computing it on another thread.
    ``info``: when given, receives ``"q_mean"`` and ``"q_max"``, the batch's mean and largest
    Q(s, a) (detached float32 scalar tensors, so reading them costs no extra device sync of
    their own).
    """
    q_all = online(batch.obs).float()
    q = q_all.gather(1, batch.actions.long().reshape(-1, 1)).squeeze(1)
    y = (targets() if targets is not None
         else dqn_targets(online, target, batch, double=double))
    delta = q - y
    per_sample = F.huber_loss(q, y, reduction="none", delta=huber_delta)
    loss = (weights_or_ones(batch, per_sample) * per_sample).mean()
    if info is not None:
        info["q_mean"] = q.detach().mean()
        info["q_max"] = q.detach().max()
    return loss, delta.detach().abs()


def dqn_td_abs(online: nn.Module, target: nn.Module, batch: Batch, *,
               double: bool = True) -> torch.Tensor:
    """|delta| without a graph: an actor's initial priorities (pass its network as both)."""
    with torch.no_grad():
        if online is target:
            # One forward over [obs; next_obs]; with one network, double DQN's target is the max.
            b = batch.obs.shape[0]
            q_both = online(torch.cat([batch.obs, batch.next_obs])).float()
            q = q_both[:b].gather(1, batch.actions.long().reshape(-1, 1)).squeeze(1)
            y = batch.rewards.float() + batch.discounts.float() * q_both[b:].max(dim=1).values
            return (q - y).abs()
        q = online(batch.obs).float().gather(1, batch.actions.long().reshape(-1, 1)).squeeze(1)
        return (q - dqn_targets(online, target, batch, double=double)).abs()


def greedy_actions(model: nn.Module, obs: torch.Tensor | np.ndarray) -> torch.Tensor:
    """argmax_a Q(obs, a) for a batch ``[B, *obs_shape]``; int64 [B] on the model's device."""
    with torch.no_grad():
        if isinstance(obs, np.ndarray):
            obs = torch.from_numpy(np.ascontiguousarray(obs))
        device = next(model.parameters()).device
        return model(obs.to(device)).argmax(dim=1)
