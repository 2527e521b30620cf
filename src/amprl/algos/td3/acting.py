"""How TD3 acts: the deterministic policy of a replica through the acting fast path, with
its critics' TD errors (``ActingPolicy``, also the evaluator's greedy policy), and the
actors' exploring behaviour (``TD3Behaviour``).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from amprl.algos.td3.networks import TD3Model
from amprl.config import ExperimentConfig
from amprl.envs.spec import EnvSpec
from amprl.rl.acting import chain_plan, linear_chain, run_plan
from amprl.rl.batch import Batch
from amprl.rl.exploration import gaussian_exploration
from amprl.rl.transitions import Chunk


class ActingPolicy:
    """pi(s) of a TD3 replica as float32 NumPy, for an actor's acting pass, and the critic
    TD errors that are its transitions' initial priorities.

    The policy MLP runs as an ``addmm``/``relu_`` chain (``amprl.rl.acting``), then tanh,
    scale and bias as ``DeterministicActor`` does; the critics likewise (``td_abs``). ``sync`` refreshes
    the plans' weights after the replica's weights change.
    """

    def __init__(self, model: torch.nn.Module):
        td3 = isinstance(model, TD3Model)
        # a TD3Model, or a module answering to its attributes (then off the fast path)
        self.model = cast(TD3Model, model)
        self._chain = linear_chain(self.model.actor.net) if td3 else None
        critics = ([linear_chain(self.model.critic1.net), linear_chain(self.model.critic2.net)]
                   if td3 else None)
        self._critics = critics if critics and all(critics) else None
        self.sync()

    @torch.inference_mode()
    def sync(self) -> None:
        if self._chain is not None:
            self._plan = chain_plan(self._chain)
        if self._critics is not None:
            self._critic_plans = [chain_plan(chain) for chain in self._critics]

    @torch.inference_mode()
    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """[B, action_dim] float32 deterministic actions of observations ``[B, *obs_shape]``."""
        x = torch.from_numpy(np.ascontiguousarray(obs))
        if self._chain is None or x.dtype != torch.float32:
            return self.model.actor(x).float().numpy()
        actor = self.model.actor
        h = torch.tanh(run_plan(self._plan, x.reshape(x.shape[0], -1)))
        return (h * actor.action_scale + actor.action_bias).numpy()

    def _q(self, critic: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Q_critic(s, a) [B] (critic 0 or 1) of flat float observations and actions."""
        if self._critics is None or x.dtype != torch.float32:
            net = self.model.critic1 if critic == 0 else self.model.critic2
            return net(x, a).float()
        return run_plan(self._critic_plans[critic], torch.cat((x, a), dim=1)).squeeze(1)

    @torch.inference_mode()
    def td_abs(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, discounts: np.ndarray,
               next_obs: np.ndarray) -> np.ndarray:
        """|Q1(s, a) - y|, float32 [T], with y = R + D * min(Q1, Q2)(s', pi(s')): the TD3
        target without smoothing noise, the replica as model and target (what
        ``losses.td3_td_abs`` computes from a Batch), an actor's initial priorities of a
        chunk's transitions. One pass of the policy chain over s', of critic 1 over (s, a)
        and (s', pi(s')) together and of critic 2 over (s', pi(s'))."""
        x = torch.from_numpy(np.ascontiguousarray(obs))
        x = x.reshape(x.shape[0], -1)
        x2 = torch.from_numpy(np.ascontiguousarray(next_obs))
        x2 = x2.reshape(x2.shape[0], -1)
        n = x.shape[0]
        a = torch.from_numpy(np.ascontiguousarray(actions, dtype=np.float32))
        p = torch.from_numpy(self(next_obs))
        q1 = self._q(0, torch.cat((x, x2)), torch.cat((a, p)))
        bootstrap = torch.minimum(q1[n:], self._q(1, x2, p))
        y = (torch.from_numpy(np.asarray(rewards, dtype=np.float32))
             + torch.from_numpy(np.asarray(discounts, dtype=np.float32)) * bootstrap)
        return (q1[:n] - y).abs().numpy()


class TD3Behaviour:
    """An actor's TD3 behaviour over its batch of envs: uniform random actions for its first
    ``td3.random_steps`` env steps, then the deterministic policy plus Gaussian noise
    (``td3.exploration_noise`` half-ranges), clipped to the bounds. Initial priorities:
    |Q1 - y| of its own critics over each chunk, no smoothing noise (``ActingPolicy.td_abs``).
    """

    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, model: torch.nn.Module, actor_id: str,
                 rng: np.random.Generator):
        self.cfg = cfg.td3
        self.frame_stack = spec.frame_stack
        self.rng = rng
        self._low = np.asarray(spec.action_low, dtype=np.float32)
        self._high = np.asarray(spec.action_high, dtype=np.float32)
        self.policy = ActingPolicy(model)

    def sync(self) -> None:
        self.policy.sync()

    def act(self, obs: np.ndarray, env_steps: int) -> tuple[np.ndarray, np.ndarray]:
        n = obs.shape[0]
        if env_steps < self.cfg.random_steps:
            # uniform exploration before the policy means anything (Fujimoto et al.: 25k/1k)
            actions = self.rng.uniform(self._low, self._high, size=(n, len(self._low))).astype(np.float32)
        else:
            actions = gaussian_exploration(self.policy(obs), self.cfg.exploration_noise, self._low,
                                           self._high, self.rng)
        return actions, actions

    def observe(self, chunker, actions, rewards, terminated, truncated, next_frames,
                reset_frames) -> list[tuple[Chunk, np.ndarray]]:
        return [(c, self._td_abs(c)) for c in chunker.step(
            actions, rewards, terminated, truncated, next_frames, reset_frames)]

    @torch.inference_mode()
    def _td_abs(self, chunk: Chunk) -> np.ndarray:
        """|Q1(s, a) - y| of each transition under the actor's own TD3 networks."""
        batch = Batch.from_chunk(chunk, frame_stack=self.frame_stack)
        return self.policy.td_abs(batch.obs.numpy(), batch.actions.numpy(), batch.rewards.numpy(),
                                  batch.discounts.numpy(), batch.next_obs.numpy())

    def epsilon(self, env_steps: int) -> float:
        """The Gaussian noise std, in half-ranges."""
        return float(self.cfg.exploration_noise)
