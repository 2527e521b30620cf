"""Batched greedy actions from a model replica (actors and the evaluator), and the Q-network
copy an actor acts with."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from amprl.config import ExperimentConfig
from amprl.rl.models import MLPTrunk, NatureTrunk, QNetwork, TD3Model


def native_bf16() -> bool:
    """True when this CPU computes bf16 matrix products natively (AVX512-BF16 or AMX)."""
    cpu = getattr(torch, "cpu", None)
    try:
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    except AttributeError:  # an older torch without the probes: assume not
        return False


def acting_dtype(cfg: ExperimentConfig) -> torch.dtype:
    """The dtype of a DQN actor's forward pass: the run's forward precision
    (``learner.precision``) when it is bf16 and the CPU computes bf16 natively, else fp32
    (CPUs emulate fp16, and bf16 without AVX512-BF16/AMX, slower than fp32)."""
    if cfg.learner.precision == "bf16" and native_bf16():
        return torch.bfloat16
    return torch.float32


def _linear_chain(seq: torch.nn.Module) -> list[tuple[torch.nn.Linear, bool]] | None:
    """``[(linear, relu after it)]`` of a Sequential of biased Linear and ReLU layers, or None."""
    if not isinstance(seq, torch.nn.Sequential):
        return None
    chain: list[list] = []
    for layer in seq:
        if isinstance(layer, torch.nn.Linear) and layer.bias is not None:
            chain.append([layer, False])
        elif isinstance(layer, torch.nn.ReLU) and chain and not chain[-1][1]:
            chain[-1][1] = True
        else:
            return None
    return [(linear, relu) for linear, relu in chain]


_NARROW = 16
"""Layers with at most this many outputs run as ``F.linear`` on the ``[out, in]`` weight:
MKL's ``addmm`` over a transposed weight takes a slow path there, several times slower,
while wide layers are faster as ``addmm`` (see _plan)."""


def _layer(weight: torch.Tensor, bias: torch.Tensor, relu: bool, *, transpose_wide: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor, bool, bool]:
    """One layer of a plan, a copy of the current weights: ``(weight, bias, relu, narrow)``
    with the weight ``[out, in]`` for narrow layers (and for every layer unless
    ``transpose_wide``: over the Nature CNN's 3,136 features ``F.linear`` is the faster,
    ~1.5 against ~1.9 ms for 16 rows x 1,024 outputs in fp32) and transposed ``[in, out]``
    otherwise."""
    weight, bias = weight.detach(), bias.detach().clone()
    if weight.shape[0] <= _NARROW or not transpose_wide:
        return weight.clone(), bias, relu, True
    return weight.t().contiguous(), bias, relu, False


def _plan(chain, *, transpose_wide: bool = True) -> list[tuple[torch.Tensor, torch.Tensor, bool, bool]]:
    """The chain's current weights as layers for ``_run_plan``: wide ones transposed for
    ``addmm`` (unless not ``transpose_wide``), which skips ``F.linear``'s GEMM over a
    transposed weight."""
    return [_layer(lin.weight, lin.bias, relu, transpose_wide=transpose_wide) for lin, relu in chain]


def _run_plan(plan, h: torch.Tensor) -> torch.Tensor:
    for weight, bias, relu, narrow in plan:
        h = F.linear(h, weight, bias) if narrow else torch.addmm(bias, h, weight)
        if relu:
            h.relu_()
    return h


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
            return [_layer(weight, a.bias - a.bias.mean() + v.bias, False, transpose_wide=transpose_wide)]
        if depth == 2:
            (vh, _), (v, _) = value
            (ah, _), (a, _) = advantage
            hidden = _layer(torch.cat((vh.weight, ah.weight)), torch.cat((vh.bias, ah.bias)), True,
                            transpose_wide=transpose_wide)
            weight = torch.cat((v.weight.expand(a.out_features, -1),
                                a.weight - a.weight.mean(dim=0, keepdim=True)), dim=1)
            return [hidden, _layer(weight, a.bias - a.bias.mean() + v.bias, False, transpose_wide=transpose_wide)]
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
        if self._convs is not None:
            self._in_shape = model.trunk._in_shape
        if dtype != torch.float32 and self._convs is None:
            self._net = copy.deepcopy(model).to(dtype=dtype)
            self._pairs = list(zip(self._net.parameters(), model.parameters()))
        self.sync()

    @staticmethod
    def _heads(model):
        """[value, advantage] (dueling) or [q] chains of a QNetwork's heads, or None."""
        heads = [_linear_chain(getattr(model, h, None))
                 for h in (["value", "advantage"] if model.dueling else ["q"])]
        return None if any(not h for h in heads) else heads

    @classmethod
    def _mlp_chains(cls, model):
        """[trunk, value, advantage] (dueling) or [trunk, q] chains of an MLP QNetwork whose
        forward is ``trunk.layers(x.reshape(B, -1))`` then its heads, else None."""
        if not (isinstance(model, QNetwork) and isinstance(model.trunk, MLPTrunk)):
            return None
        trunk, heads = _linear_chain(model.trunk.layers), cls._heads(model)
        return None if not trunk or heads is None else [trunk, *heads]

    @classmethod
    def _cnn_parts(cls, model):
        """(convolutions, head chains) of a Nature-CNN QNetwork whose heads form one chain
        (``_dueling_heads``, or a plain ``q`` head), else (None, None)."""
        if not (isinstance(model, QNetwork) and isinstance(model.trunk, NatureTrunk)):
            return None, None
        heads = cls._heads(model)
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
            fused = _dueling_heads(*heads) if len(heads) == 2 else _plan(heads[0])
            self._plans = [_plan(trunk) + fused] if fused is not None else [_plan(c) for c in self._chains]
        if self._convs is not None:
            dt = self.dtype
            # uint8 frames x: conv(x / 255, W) = conv(x, W / 255)
            scale = [1.0 / 255.0] + [1.0] * (len(self._convs) - 1)
            self._conv_plan = [((c.weight.detach() * k).to(dt), c.bias.detach().to(dt), c.stride)
                               for c, k in zip(self._convs, scale)]
            heads = (_dueling_heads(*self._heads, transpose_wide=False) if len(self._heads) == 2
                     else _plan(self._heads[0], transpose_wide=False))
            self._head_plan = [(w.to(dt), b.to(dt), relu, narrow) for w, b, relu, narrow in heads]

    @torch.inference_mode()
    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """[B, num_actions] float32 Q-values of observations ``[B, *obs_shape]``."""
        x = torch.from_numpy(np.ascontiguousarray(obs))
        if self._chains is not None and x.dtype == torch.float32:
            h = _run_plan(self._plans[0], x.reshape(x.shape[0], -1))
            if len(self._plans) == 1:  # one chain: trunk and head(s) folded together
                return h.numpy()
            a = _run_plan(self._plans[2], h)
            return (_run_plan(self._plans[1], h) + a - a.mean(dim=1, keepdim=True)).numpy()
        if self._convs is not None and x.dtype == torch.uint8:
            h = x.reshape(x.shape[0], *self._in_shape).to(self.dtype)
            for weight, bias, stride in self._conv_plan:
                h = F.conv2d(h, weight, bias, stride=stride).relu_()
            return _run_plan(self._head_plan, h.reshape(h.shape[0], -1)).float().numpy()
        if self._net is not self.model:
            # the model scales uint8 frames itself only when it casts them to fp32
            x = x.to(self.dtype).div_(255.0) if x.dtype == torch.uint8 else x.to(self.dtype)
        return self._net(x).float().numpy()


class ActingPolicy:
    """pi(s) of a TD3 replica as float32 NumPy, for an actor's acting pass, and the critic
    TD errors that are its transitions' initial priorities.

    The policy MLP runs as an ``addmm``/``relu_`` chain (see ActingQNetwork), then tanh,
    scale and bias as ``DeterministicActor`` does; the critics likewise (``td_abs``). ``sync`` refreshes
    the plans' weights after the replica's weights change.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        td3 = isinstance(model, TD3Model)
        self._chain = _linear_chain(model.actor.net) if td3 else None
        critics = [_linear_chain(model.critic1.net), _linear_chain(model.critic2.net)] if td3 else None
        self._critics = critics if critics and all(critics) else None
        self.sync()

    @torch.inference_mode()
    def sync(self) -> None:
        if self._chain is not None:
            self._plan = _plan(self._chain)
        if self._critics is not None:
            self._critic_plans = [_plan(chain) for chain in self._critics]

    @torch.inference_mode()
    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """[B, action_dim] float32 deterministic actions of observations ``[B, *obs_shape]``."""
        x = torch.from_numpy(np.ascontiguousarray(obs))
        if self._chain is None or x.dtype != torch.float32:
            return self.model.actor(x).float().numpy()
        actor = self.model.actor
        h = torch.tanh(_run_plan(self._plan, x.reshape(x.shape[0], -1)))
        return (h * actor.action_scale + actor.action_bias).numpy()

    def _q(self, critic: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Q_critic(s, a) [B] (critic 0 or 1) of flat float observations and actions."""
        if self._critics is None or x.dtype != torch.float32:
            net = self.model.critic1 if critic == 0 else self.model.critic2
            return net(x, a).float()
        return _run_plan(self._critic_plans[critic], torch.cat((x, a), dim=1)).squeeze(1)

    @torch.inference_mode()
    def td_abs(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, discounts: np.ndarray,
               next_obs: np.ndarray) -> np.ndarray:
        """|Q1(s, a) - y|, float32 [T], with y = R + D * min(Q1, Q2)(s', pi(s')): the TD3
        target without smoothing noise, the replica as model and target (what
        ``rl.td3.td3_td_abs`` computes from a Batch), an actor's initial priorities of a
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


class GreedyPolicy:
    """Greedy actions of a replica through the actors' fast paths (fp32): argmax of
    ``ActingQNetwork`` (DQN, [B] int64) or ``ActingPolicy``'s deterministic action (TD3,
    [B, action_dim] float32), for the evaluator, at a fraction of the module's cost.
    ``sync`` after the replica's weights change."""

    def __init__(self, model: torch.nn.Module, discrete: bool):
        self.discrete = discrete
        self._net = ActingQNetwork(model) if discrete else ActingPolicy(model)

    def sync(self) -> None:
        self._net.sync()

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        out = self._net(obs)
        return out.argmax(axis=1) if self.discrete else out
