"""DQN's network: Q(s, ·) over a Nature CNN trunk (uint8 (H, W) frames) or an MLP trunk
(vectors), with one linear head or the dueling pair."""

from __future__ import annotations

import torch
from torch import nn

from amprl.algos import check_action_space
from amprl.config import ExperimentConfig
from amprl.envs.spec import EnvSpec
from amprl.rl.networks import MLPTrunk, NatureTrunk, is_image_spec, mlp


class QNetwork(nn.Module):
    """Q(s, ·) for discrete actions: a trunk, then either one linear head ``q`` or the
    dueling pair ``value``/``advantage`` with Q = V + A - mean_a A (Wang et al. 2016).

    For the Nature CNN each head has its own 512-unit hidden layer, as in the Nature DQN
    (one stream) and the dueling paper (two streams); MLP heads are single linear layers
    on the trunk's last hidden layer.
    """

    def __init__(self, trunk: nn.Module, num_actions: int, *, dueling: bool, head_hidden: int = 0):
        super().__init__()
        self.trunk = trunk
        self.dueling = dueling
        self.num_actions = num_actions
        f = trunk.out_features
        sizes = [f, head_hidden] if head_hidden else [f]
        if dueling:
            self.value = mlp([*sizes, 1], final_activation=False)
            self.advantage = mlp([*sizes, num_actions], final_activation=False)
        else:
            self.q = mlp([*sizes, num_actions], final_activation=False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        h = self.trunk(obs)
        if not self.dueling:
            return self.q(h)
        a = self.advantage(h)
        return self.value(h) + a - a.mean(dim=1, keepdim=True)


def build_network(cfg: ExperimentConfig, spec: EnvSpec) -> QNetwork:
    """A QNetwork for ``spec``: a Nature CNN trunk for uint8 (H, W) frames (channels = frame
    stack) or an MLP trunk (``network.hidden_sizes``) over the flattened observation;
    dueling when ``network.dueling``."""
    frame_shape = tuple(spec.frame_shape)
    check_action_space("dqn", spec)
    if is_image_spec(spec):
        trunk: nn.Module = NatureTrunk(spec.frame_stack, *frame_shape)
        return QNetwork(trunk, spec.num_actions, dueling=cfg.network.dueling, head_hidden=512)
    if len(frame_shape) != 1:
        raise ValueError(f"unsupported frame shape {frame_shape} ({spec.frame_dtype}): "
                         f"DQN takes vectors or uint8 (H, W) frames")
    trunk = MLPTrunk(spec.frame_stack * frame_shape[0], list(cfg.network.hidden_sizes))
    return QNetwork(trunk, spec.num_actions, dueling=cfg.network.dueling)
