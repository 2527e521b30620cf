"""Network building blocks the algorithms' networks share (``amprl.algos.<name>.networks``):
a Linear layer that stays float32 where bf16 would be slower, MLPs, and the MLP and Nature
CNN trunks.

State-dict names are the wire names of the parameter server: a network holds parameters
only (constants such as the action bounds are non-persistent buffers), and its names depend
on nothing but the config and the EnvSpec (``amprl.algos.build_model``).

Inputs: a batch of observations ``[B, *spec.obs_shape]``. uint8 observations are cast to
float and divided by 255 inside the model (``to_float``), so frames stay uint8 until they
reach the device that runs the network (4x less to copy than float32).
"""

from __future__ import annotations

import torch
from torch import nn

from amprl.envs.spec import EnvSpec


def to_float(x: torch.Tensor) -> torch.Tensor:
    """Observations as float: uint8 frames scaled to [0, 1], integers cast."""
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


def mlp(sizes: list[int], *, final_activation: bool) -> nn.Sequential:
    """``Linear`` layers of widths ``sizes``, a ReLU after each but (unless
    ``final_activation``) the last."""
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
        x = to_float(x).reshape(x.shape[0], *self._in_shape)
        return self.convs(x)


class MLPTrunk(nn.Module):
    """Flattens the observation (all stacked frames) and applies Linear+ReLU layers."""

    def __init__(self, in_features: int, hidden_sizes: list[int]):
        super().__init__()
        self.layers = mlp([in_features, *hidden_sizes], final_activation=True)
        self.out_features = hidden_sizes[-1] if hidden_sizes else in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(to_float(x).reshape(x.shape[0], -1))
