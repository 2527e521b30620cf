"""The ``dqn:`` section of the experiment config (``algo: dqn``).

No torch here: the config package imports this, and loading a config stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from amprl.config.bounds import Bound


@dataclass
class DQNConfig:
    gamma: Annotated[float, Bound(ge=0, le=1)] = 0.99
    """Discount per environment step."""
    n_step: Annotated[int, Bound(ge=1)] = 3
    """Return horizon computed by actors (Ape-X: 3)."""
    double: bool = True
    """Double DQN: the online network picks the bootstrap action, the target net scores it."""
    huber_delta: Annotated[float, Bound(gt=0)] = 1.0
    """Huber loss threshold on the TD error."""
    target_update_period: Annotated[int, Bound(ge=1)] = 250
    """Copy online -> target every this many parameter versions (ignored when tau > 0)."""
    tau: Annotated[float, Bound(ge=0, le=1)] = 0.0
    """Polyak factor for a soft target update every version; 0 = periodic hard copy."""
