"""Per-algorithm pieces of the learner: batch conversion, loss, target networks, and which
parameters an update trains. The loop in ``learner.py`` is the same for every algorithm."""

from __future__ import annotations

import copy

import numpy as np
import torch

from amprl.config import ExperimentConfig
from amprl.rl import dqn
from amprl.rl.batch import Batch


def _tensor(x: np.ndarray, device: torch.device, pin: bool) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x))
    if pin:
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class DQNAlgo:
    """Double / dueling / n-step DQN with a target network synced every K versions
    (or by Polyak averaging when dqn.tau > 0)."""

    def __init__(self, cfg: ExperimentConfig, model: torch.nn.Module, device: torch.device):
        self.cfg = cfg.dqn
        self.model = model
        self.device = device
        self.target = copy.deepcopy(model).requires_grad_(False)
        self._synced_version = 0
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]

    def to_tensors(self, s, pin: bool = False) -> tuple[Batch, np.ndarray]:
        """A sampled replay batch as device tensors, plus its keys (kept on the host)."""
        d = self.device
        return Batch(obs=_tensor(s.obs, d, pin), actions=_tensor(s.actions, d, pin),
                     rewards=_tensor(s.rewards, d, pin), discounts=_tensor(s.discounts, d, pin),
                     next_obs=_tensor(s.next_obs, d, pin), weights=_tensor(s.weights, d, pin)), s.keys

    def trainable_names(self, update_index: int) -> list[str]:
        return self._names

    def loss(self, batch: Batch, update_index: int):
        return dqn.dqn_loss(self.model, self.target, batch, double=self.cfg.double,
                            huber_delta=self.cfg.huber_delta)

    @torch.no_grad()
    def on_weights(self, version: int, initial: bool = False) -> None:
        """Called whenever the model replica received the weights of ``version``."""
        if initial or (self.cfg.tau == 0 and version - self._synced_version >= self.cfg.target_update_period):
            self.target.load_state_dict(self.model.state_dict())
            self._synced_version = version
        elif self.cfg.tau > 0:
            for t, o in zip(self.target.parameters(), self.model.parameters()):
                t.lerp_(o, self.cfg.tau)


def make_algo(cfg: ExperimentConfig, model: torch.nn.Module, device: torch.device):
    if cfg.algo == "dqn":
        return DQNAlgo(cfg, model, device)
    raise NotImplementedError(f"algo {cfg.algo!r} is not implemented in the learner yet")
