"""The transitions whose n-step window has closed, in order, until a chunk takes them.

The chunker (``actor/nstep.py``) adds each transition as its window closes: observation and
next observation as frame-id stacks, action, n-step return and discount. An actor that
scores its transitions with the Q-values it acted on (Ape-X initial priorities,
``NStepChunker.step_scored``) adds Q(obs, action) too; V(next_obs) comes only with the
acting pass over next_obs, one step later, so a transition waits for it, and only the
first ``scored`` transitions can be handed out.
"""

from __future__ import annotations

import numpy as np

from amprl.actor.framelog import FrameLog
from amprl.rl.transitions import Chunk


class CompletedTransitions:
    """Up to ``capacity`` completed transitions over stacks of ``frame_stack`` frame ids."""

    def __init__(self, capacity: int, frame_stack: int):
        self.obs = np.zeros((capacity, frame_stack), dtype=np.int64)
        self.next_obs = np.zeros((capacity, frame_stack), dtype=np.int64)
        self.actions: np.ndarray | None = None  # shaped by the first step's actions
        self.rewards = np.zeros(capacity, dtype=np.float64)
        self.discounts = np.zeros(capacity, dtype=np.float64)
        # Scoring: Q(obs, action), V(next_obs), and the env whose next acting pass brings
        # V(next_obs) (-1: known already).
        self.q = np.zeros(capacity, dtype=np.float32)
        self.v = np.zeros(capacity, dtype=np.float32)
        self.wait = np.full(capacity, -1, dtype=np.int64)
        self.count = 0
        """Transitions held."""
        self.scored = 0
        """The first ``scored`` of them have their V(next_obs)."""

    def allocate_actions(self, shape: tuple, dtype) -> None:
        self.actions = np.zeros((self.obs.shape[0], *shape), dtype=dtype)

    def add(self, obs, actions, rewards, discounts, next_obs, scores=None) -> None:
        """Appends ``len(rewards)`` transitions; ``scores``: their (Q, V, waiting env), for
        a scoring actor."""
        c, k = self.count, rewards.shape[0]
        assert self.actions is not None, "allocate_actions first"
        self.obs[c:c + k] = obs
        self.actions[c:c + k] = actions
        self.rewards[c:c + k] = rewards
        self.discounts[c:c + k] = discounts
        self.next_obs[c:c + k] = next_obs
        if scores is not None:
            self.q[c:c + k], self.v[c:c + k], self.wait[c:c + k] = scores
        self.count = c + k

    def receive_values(self, values) -> None:
        """V(next_obs) for the transitions waiting for it, from the acting pass now
        (``values`` [N], a row per env); every transition held is then scored."""
        c0, c = self.scored, self.count
        if c > c0:
            wait = self.wait[c0:c]
            rows = np.flatnonzero(wait >= 0)
            self.v[c0 + rows] = np.asarray(values, dtype=np.float32)[wait[rows]]
        self.scored = c

    def drop_unscored(self) -> None:
        """Forgets the transitions still waiting for V (their next_obs is never acted on)."""
        self.count = self.scored

    def oldest_frame(self) -> int | None:
        """The oldest frame id an observation held uses (None when none is held)."""
        return int(self.obs[:self.count].min()) if self.count else None

    def td_abs(self, T: int) -> np.ndarray:
        """|reward + discount * V(next_obs) - Q(obs, action)| of the first ``T``, float32
        [T], as the learner computes its TD errors from the chunk's float32 fields."""
        return np.abs(self.rewards[:T].astype(np.float32) + self.discounts[:T].astype(np.float32)
                      * self.v[:T] - self.q[:T])

    def take(self, T: int, frames: FrameLog) -> Chunk:
        """The first ``T`` transitions as a chunk, with the distinct ``frames`` they use."""
        assert self.actions is not None, "allocate_actions first"
        used, idx = frames.pack(np.concatenate((self.obs[:T], self.next_obs[:T])))
        chunk = Chunk(
            frames=used,
            obs_idx=idx[:T],
            next_obs_idx=idx[T:],
            actions=self.actions[:T].copy(),
            rewards=self.rewards[:T].astype(np.float32),
            discounts=self.discounts[:T].astype(np.float32),
        )
        rest = self.count - T
        if rest:
            for a in (self.obs, self.next_obs, self.actions, self.rewards, self.discounts,
                      self.q, self.v, self.wait):
                a[:rest] = a[T:T + rest]
        self.count = rest
        self.scored = max(self.scored - T, 0)
        return chunk
