"""TD3 losses (Fujimoto et al. 2018), n-step and prioritized.

Critic target, with target policy smoothing:

    a' = clip(pi_target(s') + clip(N(0, sigma^2), -c, c) * half_range, low, high)
    y  = R + D * min(Q1_target(s', a'), Q2_target(s', a'))

R is the n-step return and D = gamma^k (0 after a terminal), both from the actors. sigma
(0.2) and c (0.5) are in units of the action half-range, so one config fits any bounds.
Critic loss: sum over both critics of mean_i(w_i * (Q_j(s_i, a_i) - y_i)^2); the priority
is |Q1(s, a) - y|. Actor loss: -mean Q1(s, pi(s)), every ``policy_delay`` critic updates,
when the targets also move by tau (``amprl.rl.targets.soft_update``).

The actor loss reads the critic with detached parameters, so its gradient reaches the
actor only: ``critic_loss + actor_loss`` backpropagated once gives the critic gradient
of the critic loss and the actor gradient of the actor loss, as TD3 prescribes (both
computed on the same critic weights; the original updates the critic first).
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from amprl.algos.td3.networks import TD3Model
from amprl.rl.batch import Batch, weights_or_ones


def smoothed_target_actions(target: TD3Model, next_obs: torch.Tensor, *, noise: float,
                            noise_clip: float,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """pi_target(s') plus clipped Gaussian noise, clipped to the action bounds (float32)."""
    with torch.no_grad():
        a = target.actor(next_obs).float()
        if noise > 0.0:
            eps = torch.randn(a.shape, generator=generator, device=a.device, dtype=a.dtype)
            eps = (eps * noise).clamp_(-noise_clip, noise_clip)
            a = a + eps * target.action_scale
        return torch.maximum(torch.minimum(a, target.action_high), target.action_low)


def td3_targets(target: TD3Model, batch: Batch, *, noise: float = 0.2, noise_clip: float = 0.5,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """y = R + D * min(Q1', Q2')(s', a') with smoothed a'; float32 [B], no grad."""
    with torch.no_grad():
        a = smoothed_target_actions(target, batch.next_obs, noise=noise, noise_clip=noise_clip,
                                    generator=generator)
        q1, q2 = target.q(batch.next_obs, a)
        return batch.rewards.float() + batch.discounts.float() * torch.minimum(q1, q2).float()


def td3_critic_loss(model: TD3Model, target: TD3Model, batch: Batch, *, noise: float = 0.2,
                    noise_clip: float = 0.5, generator: torch.Generator | None = None,
                    info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(loss, td_abs)``: the IS-weighted twin-critic MSE (scalar, grad through
    the critics only) and |Q1(s, a) - y| ([B], float32, detached) as the new priority.
    ``info``: when given, receives ``"q_mean"`` and ``"q_max"``, the batch's mean and largest
    Q1(s, a) (detached)."""
    y = td3_targets(target, batch, noise=noise, noise_clip=noise_clip, generator=generator)
    q1, q2 = model.q(batch.obs, batch.actions)
    d1, d2 = q1.float() - y, q2.float() - y
    w = weights_or_ones(batch, d1)
    loss = (w * d1.square()).mean() + (w * d2.square()).mean()
    if info is not None:
        info["q_mean"] = q1.detach().float().mean()
        info["q_max"] = q1.detach().float().max()
    return loss, d1.detach().abs()


def td3_actor_loss(model: TD3Model, obs: torch.Tensor) -> torch.Tensor:
    """-mean Q1(s, pi(s)); its gradient reaches ``model.actor`` only (critic1 detached)."""
    frozen = {name: p.detach() for name, p in model.critic1.named_parameters()}
    q = functional_call(model.critic1, frozen, (obs, model.actor(obs)))
    return -q.float().mean()


def td3_td_abs(model: TD3Model, target: TD3Model, batch: Batch, *, noise: float = 0.0,
               noise_clip: float = 0.5) -> torch.Tensor:
    """|Q1(s, a) - y| without a graph: an actor's initial priorities (its own network as
    both model and target; no smoothing noise by default, so priorities are repeatable)."""
    with torch.no_grad():
        y = td3_targets(target, batch, noise=noise, noise_clip=noise_clip)
        return (model.critic1(batch.obs, batch.actions).float() - y).abs()


def policy_update_due(critic_updates: int, policy_delay: int) -> bool:
    """True when the actor and the targets update after critic update number
    ``critic_updates`` (counted from 1): every ``policy_delay``-th one, as in TD3."""
    return critic_updates >= 1 and critic_updates % policy_delay == 0
