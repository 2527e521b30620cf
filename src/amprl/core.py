"""The few interfaces the actor, learner and evaluator depend on (Acme's ``core.py`` is the
model): where transitions go, where batches come from, where weights come from and go to,
and what an algorithm gives the learner, the actors and the evaluator.

The services' clients implement them over gRPC (``amprl.replay.client.ReplayClient``,
``amprl.paramserver.client.ParameterClient``), the algorithms in ``amprl.algos.<name>``,
and the tests' fakes in memory. A reader (or a type checker) can
follow a gradient from ``Algorithm.loss`` through ``WeightSink.push_future`` to the
server without knowing how the wire carries it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Iterable, NamedTuple, Protocol, Sequence

import numpy as np
import torch

from amprl.rl.batch import Batch
from amprl.rl.transitions import Chunk, SampledBatch
from amprl.v1 import paramserver_pb2, replay_pb2, tensor_pb2


class Pulled(NamedTuple):
    """Weights as a weight source hands them out."""

    version: int
    incarnation: int
    """The server's incarnation (0 from a server too old to say)."""
    weights: dict[str, torch.Tensor] | None
    """fp32 tensors by name, in the server's order; None when the caller's were current."""


class TransitionSink(Protocol):
    """Where an actor sends its chunks (replay)."""

    def insert(self, actor_id: str, items: Iterable[tuple[Chunk, np.ndarray, int]],
               timeout: float | None = None, cancel: threading.Event | None = None, *,
               incarnation: int = 0, first_sequence: int = 0) -> replay_pb2.InsertResponse:
        """Stores ``(chunk, priorities, env_steps)`` items; returns once all are stored.
        Items numbered from ``first_sequence`` under an ``incarnation`` are stored at most
        once, however often they are sent."""
        ...

    def info(self, timeout: float | None = None) -> replay_pb2.ReplayServiceInfoResponse: ...


class BatchSource(Protocol):
    """Where a learner draws prioritized batches from, and sends new priorities to (replay)."""

    def sample(self, batch_size: int, beta: float, timeout: float | None = None) -> SampledBatch:
        """A batch drawn with P(i) ∝ p_i^α, with importance weights for ``beta``."""
        ...

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray,
                          timeout: float | None = None) -> replay_pb2.UpdatePrioritiesResponse: ...

    def info(self, timeout: float | None = None) -> replay_pb2.ReplayServiceInfoResponse: ...


class WeightSource(Protocol):
    """Where actors, the evaluator and learners get the current weights (the parameter
    server, or a pull-only follower)."""

    def pull(self, have_version: int = 0, encoding: str = "fp32", timeout: float | None = None,
             device: torch.device | str | None = None
             ) -> tuple[int, dict[str, torch.Tensor] | None]:
        """(version, weights), or (version, None) when ``have_version`` is the newest."""
        ...

    def pull_versioned(self, have_version: int = 0, have_incarnation: int = 0, *,
                       encoding: str = "fp32", timeout: float | None = None,
                       device: torch.device | str | None = None) -> Pulled:
        """As ``pull``, also across server restarts: another incarnation's weights come
        whatever their version."""
        ...

    def info(self, timeout: float | None = None) -> paramserver_pb2.ParameterServiceInfoResponse: ...


class WeightSink(Protocol):
    """Where a learner sends its gradients (the parameter server)."""

    def push_future(self, base_version: int, grads: Sequence[tensor_pb2.CompressedTensor],
                    batch_size: int = 0, timeout: float | None = None, *,
                    return_weights: bool = False,
                    more_steps: Sequence[tuple[Sequence[tensor_pb2.CompressedTensor], int]] = ()
                    ) -> concurrent.futures.Future[paramserver_pb2.PushGradientsResponse]:
        """Sends a gradient computed on ``base_version`` (and ``more_steps``, each computed
        on the version the one before makes); the future yields the server's reply or
        raises FailedPrecondition (too stale), InvalidArgument, Unavailable, ..."""
        ...


class ParameterServer(WeightSource, WeightSink, Protocol):
    """What a learner needs of the parameter server: weights in and gradients out."""


class Algorithm(Protocol):
    """What an algorithm gives the learner: batches as tensors, a loss, and what to do when
    the weights change (target networks). One per algorithm, ``amprl.algos.<name>.learning``."""

    def to_tensors(self, sampled: SampledBatch, pin: bool = False) -> tuple[Batch, np.ndarray]:
        """The sampled batch as tensors on the learner's device, and its replay keys."""
        ...

    def trainable_names(self, update_index: int) -> list[str]:
        """The parameters this update trains (TD3's actor only every ``policy_delay``)."""
        ...

    def loss(self, batch: Batch, update_index: int, info: dict | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(loss, |TD error| per sample, or None); ``info`` receives ``q_mean`` and ``q_max``."""
        ...

    def on_weights(self, version: int, initial: bool = False) -> None:
        """The replica's weights are now ``version`` (targets follow them)."""
        ...

    def close(self) -> None: ...


class Behaviour(Protocol):
    """What an algorithm gives an actor: its behaviour policy (the one that makes the data,
    exploration included) over the actor's batch of envs, and the initial priorities of
    the transitions it makes. One per algorithm, ``amprl.algos.<name>.acting``. The
    actor's loop::

        actions, env_actions = behaviour.act(obs, env_steps)
        ...  # each env steps with its env_action
        scored = behaviour.observe(chunker, actions, rewards, terminated, truncated,
                                   next_frames, reset_frames)
    """

    def act(self, obs: np.ndarray, env_steps: int) -> tuple[np.ndarray, Sequence | np.ndarray]:
        """Actions for observations ``[N, *obs_shape]`` after the actor's first
        ``env_steps`` env steps: as an array (what the chunker stores) and as the envs
        take them."""
        ...

    def observe(self, chunker, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray,
                truncated: np.ndarray, next_frames: np.ndarray, reset_frames: np.ndarray | None
                ) -> list[tuple[Chunk, np.ndarray]]:
        """Feeds the step ``act`` chose (its ``actions``) to the actor's n-step ``chunker``;
        returns the chunks it completed with |δ| of each transition, float32 [T]."""
        ...

    def sync(self) -> None:
        """The replica's weights changed."""
        ...

    def epsilon(self, env_steps: int) -> float:
        """How much it explores now, for status reports (DQN: the mean ε)."""
        ...


class Policy(Protocol):
    """What an algorithm gives the evaluator: greedy actions of a model replica. One per
    algorithm, ``amprl.algos.<name>.acting``."""

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Actions for observations ``[B, *obs_shape]`` ([B] int64 or [B, action_dim] float32)."""
        ...

    def sync(self) -> None:
        """The replica's weights changed."""
        ...
