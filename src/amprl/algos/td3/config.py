"""The ``td3:`` section of the experiment config (``algo: td3``).

No torch here: the config package imports this, and loading a config stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from amprl.config.bounds import Bound


@dataclass
class TD3Config:
    gamma: Annotated[float, Bound(ge=0, le=1)] = 0.99
    """Discount per environment step."""
    n_step: Annotated[int, Bound(ge=1)] = 1
    """Return horizon computed by actors."""
    tau: Annotated[float, Bound(gt=0, le=1)] = 0.005
    """Polyak factor of the target networks (Fujimoto et al. 2018)."""
    policy_delay: Annotated[int, Bound(ge=1)] = 2
    """Actor and targets are updated every this many critic updates."""
    target_noise: Annotated[float, Bound(ge=0)] = 0.2
    """Std of the target policy smoothing noise, in units of the action half-range."""
    target_noise_clip: Annotated[float, Bound(ge=0)] = 0.5
    """Clip of the target smoothing noise, in units of the action half-range."""
    exploration_noise: Annotated[float, Bound(ge=0)] = 0.1
    """Std of the actors' Gaussian exploration noise, in units of the action half-range."""
    random_steps: int = 1000
    """Each actor acts uniformly at random for its first this-many env steps."""
    hidden_sizes: Annotated[list[int], Bound(ge=1, min_items=1)] = field(default_factory=lambda: [256, 256])
    """Hidden layer widths of the actor and of each critic (network.hidden_sizes is DQN's)."""
