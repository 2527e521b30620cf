"""Per-algorithm pieces of the learner: batch conversion, loss, target networks, and which
parameters an update trains. The loop in ``learner.py`` is the same for every algorithm."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from amprl.config import ExperimentConfig
from amprl.core import Algorithm
from amprl.rl import dqn, td3
from amprl.rl.batch import Batch
from amprl.rl.targets import TargetNetwork, hard_update
from amprl.rl.models import TD3Model


def _caller_autocast(device: torch.device) -> torch.autocast:
    """An autocast context like the calling thread's current one on ``device``'s type."""
    kind = device.type
    return torch.autocast(kind, dtype=torch.get_autocast_dtype(kind), enabled=torch.is_autocast_enabled(kind))


def _tensor(x: np.ndarray, device: torch.device, pin: bool) -> torch.Tensor:
    # sampled arrays may be read-only views of the gRPC message; torch needs its own memory
    x = np.ascontiguousarray(x) if x.flags.writeable else np.array(x)
    t = torch.from_numpy(x)
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
        self.target = TargetNetwork.for_dqn(model, cfg.dqn)
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

    def to_tensors(self, s, pin: bool = False) -> tuple[Batch, np.ndarray]:
        """A sampled replay batch as device tensors, plus its keys (kept on the host)."""
        d = self.device
        return Batch(obs=_tensor(s.obs, d, pin), actions=_tensor(s.actions, d, pin),
                     rewards=_tensor(s.rewards, d, pin), discounts=_tensor(s.discounts, d, pin),
                     next_obs=_tensor(s.next_obs, d, pin), weights=_tensor(s.weights, d, pin)), s.keys

    def trainable_names(self, update_index: int) -> list[str]:
        return self._names

    def loss(self, batch: Batch, update_index: int, info: dict | None = None):
        """``(loss, td_abs)`` of ``batch``; ``info`` receives ``q_mean`` (see dqn_loss)."""
        targets = None
        if self._targets_thread is not None:
            targets = self._targets_thread.submit(self._targets, batch, _caller_autocast(self.device)).result
        return dqn.dqn_loss(self.model, self.target, batch, **self._target_args,
                            huber_delta=self.cfg.huber_delta, targets=targets, info=info)

    def _targets(self, batch: Batch, autocast) -> torch.Tensor:
        with autocast:  # autocast is per thread: the update thread's, passed on
            return dqn.dqn_targets(self.model, self.target, batch, **self._target_args)

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


class TD3Algo:
    """TD3 (Fujimoto et al. 2018) on a TD3Model: twin critics trained every update, the
    actor every ``policy_delay``-th update, target networks moved by tau on the same clock.

    An update that trains the critics only pushes the critic parameters (the parameter
    server's Adam leaves absent ones untouched); a policy update pushes both, from one
    backward pass of ``critic_loss + actor_loss`` (``td3_actor_loss`` detaches the critic, so
    each part gets only its own gradient).

    The targets follow the server's version clock: with one learner every push makes a
    version, so ``version // policy_delay`` counts policy updates and the Polyak step with
    tau per policy update (TargetNetwork turns a jump of k into tau_eff = 1 - (1 - tau)^k).
    """

    def __init__(self, cfg: ExperimentConfig, model: torch.nn.Module, device: torch.device):
        if not isinstance(model, TD3Model):
            raise TypeError(f"TD3Algo needs a TD3Model, got {type(model).__name__}")
        self.cfg = cfg.td3
        self.model = model
        self.device = device
        self.target = TargetNetwork.for_td3(model, self.cfg)
        self._all = [n for n, p in model.named_parameters() if p.requires_grad]
        self._critic = [n for n in self._all if n.startswith(("critic1.", "critic2."))]

    to_tensors = DQNAlgo.to_tensors

    def close(self) -> None:
        """Nothing to release (TD3 runs its whole update on the calling thread)."""

    def policy_step(self, update_index: int) -> bool:
        """Update ``update_index`` (from 0) also trains the actor: every policy_delay-th."""
        return td3.policy_update_due(update_index + 1, self.cfg.policy_delay)

    def trainable_names(self, update_index: int) -> list[str]:
        return self._all if self.policy_step(update_index) else self._critic

    def loss(self, batch: Batch, update_index: int, info: dict | None = None):
        """``(loss, td_abs)`` of ``batch``; ``info`` receives ``q_mean`` (see td3_critic_loss)."""
        loss, td_abs = td3.td3_critic_loss(self.model, self.target.module, batch,
                                           noise=self.cfg.target_noise,
                                           noise_clip=self.cfg.target_noise_clip, info=info)
        if self.policy_step(update_index):
            loss = loss + td3.td3_actor_loss(self.model, batch.obs)
        return loss, td_abs

    @torch.no_grad()
    def on_weights(self, version: int, initial: bool = False) -> None:
        """Called whenever the model replica received the weights of ``version``."""
        clock = version // self.cfg.policy_delay
        if initial:
            hard_update(self.target.module, self.model)
            self.target.version = clock
        else:
            self.target.maybe_update(self.model, clock)


def make_algo(cfg: ExperimentConfig, model: torch.nn.Module, device: torch.device) -> Algorithm:
    if cfg.algo == "dqn":
        return DQNAlgo(cfg, model, device)
    if cfg.algo == "td3":
        return TD3Algo(cfg, model, device)
    raise NotImplementedError(f"algo {cfg.algo!r} is not implemented in the learner yet")
