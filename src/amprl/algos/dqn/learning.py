"""DQN's side of the learner (an ``amprl.core.Algorithm``): its loss, its target network and,
with ``learner.overlap_targets``, the bootstrap targets on a second thread. The learner's
loop (``amprl.learner.learner``) is the same for every algorithm."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from amprl.algos.dqn import losses
from amprl.config import ExperimentConfig
from amprl.rl.transitions import SampledBatch
from amprl.rl.batch import Batch, sampled_to_tensors
from amprl.rl.targets import TargetNetwork, hard_update


def _caller_autocast(device: torch.device) -> torch.autocast:
    """An autocast context like the calling thread's current one on ``device``'s type."""
    kind = device.type
    return torch.autocast(kind, dtype=torch.get_autocast_dtype(kind), enabled=torch.is_autocast_enabled(kind))


class DQNAlgo:
    """Double / dueling / n-step DQN with a target network synced every K versions
    (or by Polyak averaging when dqn.tau > 0)."""

    def __init__(self, cfg: ExperimentConfig, model: torch.nn.Module, device: torch.device):
        self.cfg = cfg.dqn
        self.model = model
        self.device = device
        self.target = TargetNetwork(model, tau=cfg.dqn.tau, period=cfg.dqn.target_update_period)
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]
        self._target_args = dict(double=cfg.dqn.double)  # how y is formed, both paths
        # learner.overlap_targets: y on a second thread, overlapped with the online forward
        # over s. Both only read the weights, which change between updates, never during one.
        self._targets_thread = None
        if cfg.learner.overlap_targets:
            self._targets_thread = ThreadPoolExecutor(
                1, thread_name_prefix="learner-targets",
                # torch's thread count is per OS thread (a thread that never set it uses every core)
                initializer=torch.set_num_threads, initargs=(cfg.deploy.learner_torch_threads,))

    def to_tensors(self, s: SampledBatch, pin: bool = False) -> tuple[Batch, np.ndarray]:
        """A sampled replay batch as device tensors, plus its keys (kept on the host)."""
        return sampled_to_tensors(s, self.device, pin)

    def trainable_names(self, update_index: int) -> list[str]:
        return self._names

    def loss(self, batch: Batch, update_index: int, info: dict | None = None):
        """``(loss, td_abs)`` of ``batch``; ``info`` receives ``q_mean`` and ``q_max`` (see dqn_loss)."""
        targets = None
        if self._targets_thread is not None:
            targets = self._targets_thread.submit(self._targets, batch, _caller_autocast(self.device)).result
        return losses.dqn_loss(self.model, self.target.module, batch, **self._target_args,
                               huber_delta=self.cfg.huber_delta, targets=targets, info=info)

    def _targets(self, batch: Batch, autocast) -> torch.Tensor:
        with autocast:  # autocast is per thread: the update thread's, passed on
            return losses.dqn_targets(self.model, self.target.module, batch, **self._target_args)

    def close(self) -> None:
        if self._targets_thread is not None:
            self._targets_thread.shutdown(wait=True)

    @torch.no_grad()
    def on_weights(self, version: int, initial: bool = False) -> None:
        """Called whenever the model replica received the weights of ``version``."""
        if initial:
            hard_update(self.target.module, self.model)
            self.target.version = version
        else:
            self.target.maybe_update(self.model, version)
