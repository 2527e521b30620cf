"""How DQN acts: Q-values of a replica through the acting fast path (``ActingQNetwork``),
the actors' ε-greedy behaviour with its Ape-X initial priorities (``DQNBehaviour``), and
the evaluator's greedy policy (``GreedyQPolicy``).
"""

from __future__ import annotations

import copy
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from amprl.algos.dqn.networks import QNetwork
from amprl.config import ExperimentConfig
from amprl.envs.spec import EnvSpec
from amprl.rl.acting import chain_plan, layer_plan, linear_chain, native_bf16, run_plan
from amprl.rl.exploration import apex_epsilon
from amprl.rl.networks import MLPTrunk, NatureTrunk
from amprl.rl.transitions import Chunk


def acting_dtype(cfg: ExperimentConfig) -> torch.dtype:
    """The dtype of a DQN actor's forward pass: the run's forward precision
    (``learner.precision``) when it is bf16 and the CPU computes bf16 natively, else fp32
    (CPUs emulate fp16, and bf16 without AVX512-BF16/AMX, slower than fp32)."""
    if cfg.learner.precision == "bf16" and native_bf16():
        return torch.bfloat16
    return torch.float32


def _dueling_heads(value, advantage, *, transpose_wide: bool = True
                   ) -> list[tuple[torch.Tensor, torch.Tensor, bool, bool]] | None:
    """The dueling pair as one chain of layers, or None when it has another shape.

    Q = V + A - mean_a A is linear in the heads' last layers. Single linear heads on the
    same features h fold into one layer, with weight W_A - mean_a W_A + w_V and bias
    b_A - mean_a b_A + b_V. Heads with one hidden layer each (Linear, ReLU, Linear: the
    Nature CNN's, 512 units) run their hidden layers as one GEMM over h, giving
    z = [z_V, z_A], then one output layer [w_V per action | W_A - mean_a W_A] with the same
    bias. Equal to the two heads and the combination up to float rounding; one GEMM per
    level instead of two, and no element-wise combination."""
    depth = _foldable_depth(value, advantage)
    with torch.no_grad():
        if depth == 1:
            ((v, _),), ((a, _),) = value, advantage
            weight = a.weight - a.weight.mean(dim=0, keepdim=True) + v.weight
            return [layer_plan(weight, a.bias - a.bias.mean() + v.bias, False, transpose_wide=transpose_wide)]
        if depth == 2:
            (vh, _), (v, _) = value
            (ah, _), (a, _) = advantage
            hidden = layer_plan(torch.cat((vh.weight, ah.weight)), torch.cat((vh.bias, ah.bias)), True,
                                transpose_wide=transpose_wide)
            weight = torch.cat((v.weight.expand(a.out_features, -1),
                                a.weight - a.weight.mean(dim=0, keepdim=True)), dim=1)
            return [hidden, layer_plan(weight, a.bias - a.bias.mean() + v.bias, False,
                                       transpose_wide=transpose_wide)]
    return None


def _foldable_depth(value, advantage) -> int | None:
    """1 or 2 (layers per head) when ``_dueling_heads`` can fold the pair, else None."""
    if any(chain[-1][1] for chain in (value, advantage)):
        return None  # an activation after a head's output: not linear in its last layer
    if len(value) == 1 and len(advantage) == 1:
        return 1
    if (len(value) == 2 and len(advantage) == 2 and value[0][1] and advantage[0][1]
            and value[0][0].out_features == advantage[0][0].out_features):
        return 2
    return None


class ActingQNetwork:
    """Q(s, ·) as float32 NumPy from a replica's weights, for an actor's acting pass.

    The replica's own function, run one of three ways:

    * MLP Q-networks (vector observations, MLP trunk, linear heads), fp32: one chain of
      ``addmm``/``relu_`` over weights kept transposed, the dueling heads and their
      combination folded into one narrow layer (``_dueling_heads``): the modules'
      function (equal up to float rounding, ~1e-7) without the module calls, the
      transposed-weight GEMM of ``F.linear`` on wide layers and MKL's slow path for narrow
      ones (a pass costs about as much as the env steps it acts for, so the module's
      overhead mattered);
    * Nature-CNN Q-networks on uint8 frames, in ``dtype`` (bf16 for a bf16 run where the
      CPU computes it natively, else fp32): copies of the convolutions with the 1/255
      frame scaling folded into the first one's weights (uint8 values are exact in bf16),
      run NCHW, then the heads as one chain (``_dueling_heads``: both 512-unit hidden
      layers in one GEMM), faster than a bf16 copy of the module in channels-last (whose
      input permute alone is a noticeable share) and than fp32; Q-values within ~1% of
      fp32 (the learner of a bf16 run computes in bf16 too). At batch 16 the
      heads' 6.4 MB of bf16 weights are read from memory once per pass: more envs per
      actor share that read;
    * otherwise a ``dtype`` copy of the replica (or the replica itself in fp32).

    ``sync`` refreshes the copies after the replica's weights change.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.float32):
        self.model = model
        self.dtype = dtype
        self._net = model
        self._chains = self._mlp_chains(model) if dtype == torch.float32 else None
        self._convs, self._heads = self._cnn_parts(model)
        if self._convs is not None:  # a QNetwork on a NatureTrunk (_cnn_parts)
            self._in_shape = cast(NatureTrunk, model.trunk)._in_shape
        if dtype != torch.float32 and self._convs is None:
            self._net = copy.deepcopy(model).to(dtype=dtype)
            self._pairs = list(zip(self._net.parameters(), model.parameters()))
        self.sync()

    @staticmethod
    def _head_chains(model):
        """[value, advantage] (dueling) or [q] chains of a QNetwork's heads, or None."""
        heads = [linear_chain(getattr(model, h, None))
                 for h in (["value", "advantage"] if model.dueling else ["q"])]
        return None if any(not h for h in heads) else heads

    @classmethod
    def _mlp_chains(cls, model):
        """[trunk, value, advantage] (dueling) or [trunk, q] chains of an MLP QNetwork whose
        forward is ``trunk.layers(x.reshape(B, -1))`` then its heads, else None."""
        if not (isinstance(model, QNetwork) and isinstance(model.trunk, MLPTrunk)):
            return None
        trunk, heads = linear_chain(model.trunk.layers), cls._head_chains(model)
        return None if not trunk or heads is None else [trunk, *heads]

    @classmethod
    def _cnn_parts(cls, model):
        """(convolutions, head chains) of a Nature-CNN QNetwork whose heads form one chain
        (``_dueling_heads``, or a plain ``q`` head), else (None, None)."""
        if not (isinstance(model, QNetwork) and isinstance(model.trunk, NatureTrunk)):
            return None, None
        heads = cls._head_chains(model)
        if heads is None or (len(heads) == 2 and _foldable_depth(*heads) is None):
            return None, None
        convs = [m for m in model.trunk.convs if isinstance(m, torch.nn.Conv2d)]
        return convs, heads

    @torch.inference_mode()
    def sync(self) -> None:
        """Copies the replica's current weights into the fast paths' copies."""
        if self._net is not self.model:
            for mine, theirs in self._pairs:
                mine.copy_(theirs)
        if self._chains is not None:
            trunk, *heads = self._chains
            fused = _dueling_heads(*heads) if len(heads) == 2 else chain_plan(heads[0])
            self._plans = ([chain_plan(trunk) + fused] if fused is not None
                           else [chain_plan(c) for c in self._chains])
        if self._convs is not None:
            dt = self.dtype
            # uint8 frames x: conv(x / 255, W) = conv(x, W / 255)
            scale = [1.0 / 255.0] + [1.0] * (len(self._convs) - 1)
            self._conv_plan = [((c.weight.detach() * k).to(dt), c.bias.detach().to(dt), c.stride)
                               for c, k in zip(self._convs, scale)]
            heads = (_dueling_heads(*self._heads, transpose_wide=False) if len(self._heads) == 2
                     else chain_plan(self._heads[0], transpose_wide=False))
            assert heads is not None  # _cnn_parts took only heads that fold
            self._head_plan = [(w.to(dt), b.to(dt), relu, narrow) for w, b, relu, narrow in heads]

    @torch.inference_mode()
    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """[B, num_actions] float32 Q-values of observations ``[B, *obs_shape]``."""
        x = torch.from_numpy(np.ascontiguousarray(obs))
        if self._chains is not None and x.dtype == torch.float32:
            h = run_plan(self._plans[0], x.reshape(x.shape[0], -1))
            if len(self._plans) == 1:  # one chain: trunk and head(s) folded together
                return h.numpy()
            a = run_plan(self._plans[2], h)
            return (run_plan(self._plans[1], h) + a - a.mean(dim=1, keepdim=True)).numpy()
        if self._convs is not None and x.dtype == torch.uint8:
            h = x.reshape(x.shape[0], *self._in_shape).to(self.dtype)
            for weight, bias, stride in self._conv_plan:
                h = F.conv2d(h, weight, bias, stride=stride).relu_()
            return run_plan(self._head_plan, h.reshape(h.shape[0], -1)).float().numpy()
        if self._net is not self.model:
            # the model scales uint8 frames itself only when it casts them to fp32
            x = x.to(self.dtype).div_(255.0) if x.dtype == torch.uint8 else x.to(self.dtype)
        return self._net(x).float().numpy()


class GreedyQPolicy:
    """argmax_a Q(s, a) of a replica through ``ActingQNetwork`` (fp32), [B] int64: the
    evaluator's greedy actions at a fraction of the module's cost. ``sync`` after the
    replica's weights change."""

    def __init__(self, model: torch.nn.Module):
        self._net = ActingQNetwork(model)

    def sync(self) -> None:
        self._net.sync()

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self._net(obs).argmax(axis=1)


class DQNBehaviour:
    """An actor's ε-greedy behaviour over its batch of envs, and the Ape-X initial
    priorities of the transitions it makes (Horgan et al. 2018).

    Each env explores with its own Ape-X ε: u from a hash of "<actor id>/<env index>"
    (``rl/exploration.py``), so a fleet of any size (even 2 local actors) spans the schedule
    without coordination; ε starts at 1 and falls to it over the actor's first
    ``actor.epsilon_warmup_steps`` env steps.

    Priorities: |R + γ^K max_a Q(s_{t+K}, a) - Q(s_t, a_t)| (double DQN with the actor's
    one network as online and target) from the Q-values of the acting passes at s_t and
    s_{t+K}, which the n-step chunker carries (``NStepChunker.step_scored``); only a
    truncated episode's final observation, never acted on, costs a forward pass of its
    own. Actors of a bf16 run act in bf16 where the CPU computes it natively
    (``acting_dtype``).
    """

    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, model: torch.nn.Module, actor_id: str,
                 rng: np.random.Generator):
        self.cfg = cfg.actor
        self.num_actions = spec.num_actions
        self.rng = rng
        n = cfg.actor.envs_per_actor
        self.epsilons = np.array([apex_epsilon(f"{actor_id}/{j}", cfg.actor.epsilon_base,
                                               cfg.actor.epsilon_alpha) for j in range(n)])
        self.q_net = ActingQNetwork(model, acting_dtype(cfg))
        self._rows = np.arange(n)
        self._q: np.ndarray | None = None  # Q-values of the last acting pass

    def sync(self) -> None:
        self.q_net.sync()

    def act(self, obs: np.ndarray, env_steps: int) -> tuple[np.ndarray, list]:
        """ε-greedy over one batched forward pass of the actor's network."""
        self._q = q = self.q_net(obs)
        actions = self._explore(q.argmax(axis=1), env_steps)
        # Python ints: gymnasium's Discrete.contains is slow on NumPy scalars
        return actions, actions.tolist()

    def observe(self, chunker, actions, rewards, terminated, truncated, next_frames,
                reset_frames) -> list[tuple[Chunk, np.ndarray]]:
        q = self._q
        assert q is not None, "act before observe"
        return chunker.step_scored(
            actions, rewards, terminated, truncated, next_frames, reset_frames,
            q_taken=q[self._rows, actions], values=q.max(axis=1),
            final_values=self._final_values(chunker, next_frames, terminated, truncated)
            if reset_frames is not None else None)

    def _final_values(self, chunker, next_frames, terminated, truncated) -> np.ndarray | None:
        """max_a Q of the final observations of the episodes truncated by this step (the
        bootstrap of their last transitions), or None when none was."""
        cut = truncated & ~terminated
        if not cut.any():
            return None
        values = np.zeros(len(cut), dtype=np.float32)
        values[cut] = self.q_net(chunker.final_observations(next_frames, cut)).max(axis=1)
        return values

    def _explore(self, greedy: np.ndarray, env_steps: int) -> np.ndarray:
        """Each env's greedy action, replaced by a uniform random one with its ε."""
        u = self.rng.random((2, len(greedy)))  # one draw for both: each call has a fixed cost
        explore = u[0] < self.current_epsilons(env_steps)
        if explore.any():
            return np.where(explore, (u[1] * self.num_actions).astype(np.int64), greedy)
        return greedy

    def current_epsilons(self, env_steps: int) -> np.ndarray:
        """Each env's ε, raised towards 1 during the first epsilon_warmup_steps env steps."""
        warmup = self.cfg.epsilon_warmup_steps
        if warmup <= 0 or env_steps >= warmup:
            return self.epsilons
        return self.epsilons + (1.0 - self.epsilons) * (1.0 - env_steps / warmup)

    def epsilon(self, env_steps: int) -> float:
        """The mean ε."""
        return float(self.current_epsilons(env_steps).mean())
