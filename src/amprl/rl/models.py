"""The networks: DQN Q-networks (MLP or Nature CNN trunk, optional dueling head) and TD3.

``build_model(cfg, spec)`` is the one constructor every service calls, so the learner, the
actors, the evaluator and the parameter server agree on the architecture. State-dict names
are the wire names of the parameter server: they hold parameters only (constants such as
the action bounds are non-persistent buffers) and they depend on nothing but the config and
the EnvSpec.

Inputs: a batch of observations ``[B, *spec.obs_shape]``. uint8 observations are cast to
float and divided by 255 inside the model, so frames stay uint8 until they reach the
device that runs the network (4x less to copy than float32).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from amprl.config import ExperimentConfig
from amprl.envs.spec import EnvSpec


def _to_float(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.uint8:
        return x.float().div_(255.0)
    return x if x.is_floating_point() else x.float()


NARROW_FEATURES = 64
"""A Linear layer with fewer input or output features than this stays float32 under CPU
autocast (``Linear``)."""


class Linear(nn.Linear):
    """``nn.Linear`` that stays float32 under CPU autocast when one of its sides is narrower
    than ``NARROW_FEATURES`` (an MLP's input layer on a vector observation, the Q-value,
    value, advantage and action heads): on the CPU a bf16 GEMM that narrow is slower than
    the fp32 one -- the low-precision kernel's fixed cost and the casts outweigh the
    arithmetic saved, while wide layers (256->256, the Nature CNN's 3136->512) are faster
    in bf16 and keep it. Such a layer also gives the loss its Q-values at fp32 precision. Same parameters
    and state-dict names as ``nn.Linear``; without autocast, or on CUDA, it is ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.narrow = min(in_features, out_features) < NARROW_FEATURES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.narrow and x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return nn.functional.linear(x.float(), self.weight, self.bias)
        return super().forward(x)


def _mlp(sizes: list[int], *, final_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or final_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def is_image_spec(spec: EnvSpec) -> bool:
    """Frames of two dimensions (H, W), uint8: Atari-style screens, the CNN trunk's input."""
    return len(spec.frame_shape) == 2 and str(spec.frame_dtype) == "uint8"


class NatureTrunk(nn.Module):
    """Mnih et al. 2015: 32x8x8/4, 64x4x4/2, 64x3x3/1 convolutions (ReLU), flattened.

    Input ``[B, stack, H, W]`` (uint8 or float); output ``[B, out_features]``.
    """

    def __init__(self, in_channels: int, height: int, width: int):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(in_channels, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(),
        )
        h, w = height, width
        for k, s in ((8, 4), (4, 2), (3, 1)):
            h, w = (h - k) // s + 1, (w - k) // s + 1
        if h < 1 or w < 1:
            raise ValueError(f"frame size {height}x{width} is too small for the Nature CNN "
                             f"(needs at least 36x36)")
        self.out_features = 64 * h * w
        self._in_shape = (in_channels, height, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _to_float(x).reshape(x.shape[0], *self._in_shape)
        return self.convs(x)


class MLPTrunk(nn.Module):
    """Flattens the observation (all stacked frames) and applies Linear+ReLU layers."""

    def __init__(self, in_features: int, hidden_sizes: list[int]):
        super().__init__()
        self.layers = _mlp([in_features, *hidden_sizes], final_activation=True)
        self.out_features = hidden_sizes[-1] if hidden_sizes else in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(_to_float(x).reshape(x.shape[0], -1))


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
            self.value = _mlp([*sizes, 1], final_activation=False)
            self.advantage = _mlp([*sizes, num_actions], final_activation=False)
        else:
            self.q = _mlp([*sizes, num_actions], final_activation=False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        h = self.trunk(obs)
        if not self.dueling:
            return self.q(h)
        a = self.advantage(h)
        return self.value(h) + a - a.mean(dim=1, keepdim=True)


class DeterministicActor(nn.Module):
    """pi(s) = tanh(MLP(s)) scaled to [action_low, action_high]."""

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int],
                 low: torch.Tensor, high: torch.Tensor):
        super().__init__()
        self.net = _mlp([obs_dim, *hidden_sizes, action_dim], final_activation=False)
        # Not persistent: constants from the EnvSpec are not weights the server owns.
        self.register_buffer("action_scale", (high - low) / 2.0, persistent=False)
        self.register_buffer("action_bias", (high + low) / 2.0, persistent=False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = _to_float(obs).reshape(obs.shape[0], -1)
        return torch.tanh(self.net(x)) * self.action_scale + self.action_bias


class Critic(nn.Module):
    """Q(s, a): an MLP over the concatenated (flattened) observation and action."""

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int]):
        super().__init__()
        self.net = _mlp([obs_dim + action_dim, *hidden_sizes, 1], final_activation=False)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = _to_float(obs).reshape(obs.shape[0], -1)
        return self.net(torch.cat([x, action.to(x.dtype)], dim=1)).squeeze(1)


class TD3Model(nn.Module):
    """TD3 (Fujimoto et al. 2018): ``actor`` pi(s), twin critics ``critic1``/``critic2``.

    ``model(obs)`` is the deterministic policy. ``action_low``/``action_high`` (and the
    actor's scale/bias) are non-persistent buffers: they follow ``.to(device)`` but are not
    in the state dict.
    """

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int],
                 action_low: tuple[float, ...], action_high: tuple[float, ...]):
        super().__init__()
        low = torch.as_tensor(action_low, dtype=torch.float32)
        high = torch.as_tensor(action_high, dtype=torch.float32)
        if low.shape != (action_dim,) or high.shape != (action_dim,):
            raise ValueError(f"action bounds must have action_dim ({action_dim}) entries, got "
                             f"{tuple(low.shape)} and {tuple(high.shape)}")
        if not (torch.isfinite(low).all() and torch.isfinite(high).all() and (high > low).all()):
            raise ValueError(f"action bounds must be finite with high > low, got "
                             f"low={action_low} high={action_high}")
        self.actor = DeterministicActor(obs_dim, action_dim, hidden_sizes, low, high)
        self.critic1 = Critic(obs_dim, action_dim, hidden_sizes)
        self.critic2 = Critic(obs_dim, action_dim, hidden_sizes)
        self.register_buffer("action_low", low, persistent=False)
        self.register_buffer("action_high", high, persistent=False)

    @property
    def action_scale(self) -> torch.Tensor:
        """Half the action range per dimension: the unit of TD3's noise settings."""
        return self.actor.action_scale

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(obs)

    def q(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.critic1(obs, action), self.critic2(obs, action)


def build_model(cfg: ExperimentConfig, spec: EnvSpec) -> nn.Module:
    """The network of ``cfg.algo`` for ``spec``; deterministic given ``torch.manual_seed``.

    dqn: a QNetwork with a Nature CNN trunk for uint8 (H, W) frames (channels = frame
    stack) or an MLP trunk (``network.hidden_sizes``) over the flattened observation;
    dueling when ``network.dueling``. td3: a TD3Model with ``td3.hidden_sizes`` layers.
    """
    frame_shape = tuple(spec.frame_shape)
    image = is_image_spec(spec)
    if cfg.algo == "dqn":
        if not spec.discrete:
            raise ValueError("algo dqn needs a discrete action space; use algo td3 for "
                             "continuous actions")
        if image:
            trunk: nn.Module = NatureTrunk(spec.frame_stack, *frame_shape)
            return QNetwork(trunk, spec.num_actions, dueling=cfg.network.dueling, head_hidden=512)
        if len(frame_shape) != 1:
            raise ValueError(f"unsupported frame shape {frame_shape} ({spec.frame_dtype}): "
                             f"DQN takes vectors or uint8 (H, W) frames")
        trunk = MLPTrunk(spec.frame_stack * frame_shape[0], list(cfg.network.hidden_sizes))
        return QNetwork(trunk, spec.num_actions, dueling=cfg.network.dueling)
    if cfg.algo == "td3":
        if spec.discrete:
            raise ValueError("algo td3 needs a continuous (Box) action space")
        if len(frame_shape) != 1:
            raise ValueError(f"unsupported frame shape {frame_shape}: TD3 takes vector "
                             f"observations")
        obs_dim = spec.frame_stack * math.prod(frame_shape)
        return TD3Model(obs_dim, spec.action_dim, list(cfg.td3.hidden_sizes),
                        spec.action_low, spec.action_high)
    raise ValueError(f"algo: unknown algorithm {cfg.algo!r}")
