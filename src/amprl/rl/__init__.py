"""The RL core: networks, batches, losses and target networks, the fast acting copies of a
network (``acting``) and exploration and seeding (``exploration``). Pure PyTorch, no gRPC.

Learner, actors and evaluator call these; ``build_model(cfg, spec)`` is the one
constructor, so every process agrees on the architecture and the parameter names.
"""

from amprl.rl.batch import Batch
from amprl.rl.dqn import dqn_loss, dqn_td_abs, dqn_targets, greedy_actions
from amprl.rl.models import QNetwork, TD3Model, build_model
from amprl.rl.targets import TargetNetwork, hard_update, make_target, soft_update
from amprl.rl.td3 import (policy_update_due, td3_actor_loss, td3_critic_loss, td3_targets,
                          td3_td_abs)

__all__ = [
    "Batch", "QNetwork", "TD3Model", "TargetNetwork", "build_model", "dqn_loss", "dqn_td_abs",
    "dqn_targets", "greedy_actions", "hard_update", "make_target", "policy_update_due",
    "soft_update", "td3_actor_loss", "td3_critic_loss", "td3_targets", "td3_td_abs",
]
