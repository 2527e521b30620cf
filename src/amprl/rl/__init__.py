"""What the algorithms (``amprl.algos``) share: network building blocks (``networks``),
batches, target networks, the acting fast path (``acting``), exploration and seeding
(``exploration``), n-step transitions and the optimizer rule. Pure PyTorch, no gRPC.
"""

from amprl.rl.batch import Batch
from amprl.rl.targets import TargetNetwork, hard_update, make_target, soft_update

__all__ = ["Batch", "TargetNetwork", "hard_update", "make_target", "soft_update"]
