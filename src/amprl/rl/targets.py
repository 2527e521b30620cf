"""Target networks: a periodic hard copy (DQN) or Polyak averaging (TD3, optional for DQN).

The learner holds the target network; the online weights come from the parameter server,
whose version counter is the clock. Versions can jump by more than one between two pulls
(several learners push to the same server), so the Polyak rule is applied per version
elapsed: tau_eff = 1 - (1 - tau)^k after k versions, which equals k successive updates
with an unchanged online network.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


@torch.no_grad()
def soft_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    """theta' <- tau * theta + (1 - tau) * theta' for every parameter; buffers are copied."""
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau ({tau}) must be in [0, 1]")
    t_params: list[torch.Tensor] = list(target.parameters())
    o_params: list[torch.Tensor] = list(online.parameters())
    if len(t_params) != len(o_params):
        raise ValueError(f"target has {len(t_params)} parameters, online has {len(o_params)}")
    if t_params:
        torch._foreach_lerp_(t_params, o_params, tau)
    for tb, ob in zip(target.buffers(), online.buffers()):
        tb.copy_(ob)


@torch.no_grad()
def hard_update(target: nn.Module, online: nn.Module) -> None:
    """theta' <- theta (parameters and buffers)."""
    for tp, op in zip(target.parameters(), online.parameters()):
        tp.copy_(op)
    for tb, ob in zip(target.buffers(), online.buffers()):
        tb.copy_(ob)


def make_target(online: nn.Module) -> nn.Module:
    """A frozen copy of ``online``: no gradients, eval mode."""
    target = copy.deepcopy(online)
    target.requires_grad_(False)
    target.eval()
    return target


class TargetNetwork:
    """A target copy of an online network that follows it on a version clock.

    ``tau > 0``: Polyak averaging each time ``maybe_update`` sees a newer version, with
    tau_eff = 1 - (1 - tau)^(versions elapsed). ``tau == 0``: a hard copy once ``period``
    versions have passed since the last copy (Mnih et al. 2015; Ape-X copies every 2,500
    learner steps).

    Typical use, DQN (``version`` = the parameter server's version of the online weights)::

        target = TargetNetwork(online, tau=cfg.dqn.tau, period=cfg.dqn.target_update_period)
        ...  # after loading new online weights at version v
        target.maybe_update(online, v)

    TD3 updates its targets with tau on each delayed policy update: it passes a counter of
    policy updates as ``version`` (``amprl.algos.td3.learning``).
    """

    def __init__(self, online: nn.Module, *, tau: float = 0.0, period: int = 1, version: int = 0):
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"tau ({tau}) must be in [0, 1]")
        if period < 1:
            raise ValueError(f"period ({period}) must be >= 1")
        self.module = make_target(online)
        self.tau = float(tau)
        self.period = int(period)
        self.version = int(version)
        """Version of the online weights the target last moved towards (or copied)."""
        self.updates = 0
        """Hard copies or soft updates done."""

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def maybe_update(self, online: nn.Module, version: int) -> bool:
        """Moves the target towards ``online`` (at ``version``) if the rule says so."""
        elapsed = int(version) - self.version
        if elapsed <= 0:
            if elapsed < 0:  # the online weights went back (server restored a checkpoint)
                hard_update(self.module, online)
                self.version = int(version)
                self.updates += 1
                return True
            return False
        if self.tau > 0.0:
            soft_update(self.module, online, 1.0 - (1.0 - self.tau) ** elapsed)
        elif elapsed >= self.period:
            hard_update(self.module, online)
        else:
            return False
        self.version = int(version)
        self.updates += 1
        return True
