"""n-step transitions from a batch of environments, packed into self-contained chunks.

The actor feeds ``NStepChunker.step`` once per batched env step with the NEWEST frame of
each env (the whole observation when ``frame_stack == 1``); the chunker keeps the frame
stacks, the n-step windows and a log of recent frames, and hands back ``Chunk``s of
``chunk_transitions`` transitions, each carrying the distinct frames its stacks use (frames
from before the chunk are copied in, so every chunk stands alone in replay).

Per transition starting at step t of an episode (Sutton & Barto ch. 7; Ape-X):

    reward   = sum_{k<K} gamma^k r_{t+k}          K = min(n, steps left in the episode)
    discount = 0 if the episode TERMINATED within the K steps, else gamma^K
    next_obs = the observation after step t+K-1 (the final observation at an episode end)

so a time-limit truncation bootstraps from its final observation with gamma^K, and at an
episode end every pending transition is flushed with K < n steps. A new episode's first
stack repeats its first frame ``frame_stack`` times (the index repeats; the frame is
stored once).

Episode ends follow gymnasium's SAME_STEP autoreset: the step that ends an episode reports
the final frame and the first frame of the next episode together (``next_frames`` and
``reset_frames``). With ``gymnasium.vector.SyncVectorEnv(..., autoreset_mode=
AutoresetMode.SAME_STEP)`` use ``same_step_frames``; with a plain list of envs, reset the
ended ones yourself and pass their first frames as ``reset_frames``. (gymnasium's default
NEXT_STEP mode spends one extra step per episode on the reset and is not accepted.)

Cost: a step is a fixed handful of NumPy calls over the env batch, whatever its size
(~15 us on this machine; a step where episodes end adds ~20 us, one gather over the
(env, window) pairs); a chunk adds a mark-and-count over the frame log (~30 us). Batch
16+ envs per actor and the chunker costs ~1-3 us per env step.
"""

from __future__ import annotations

import numpy as np

from amprl.wire.transitions import Chunk


class NStepChunker:
    """Builds n-step transitions for ``num_envs`` environments stepped in lockstep.

    Usage::

        chunker = NStepChunker(num_envs, n_step=3, gamma=0.99, frame_stack=4,
                               chunk_transitions=64)
        frames, _ = envs.reset(seed=...)
        chunker.reset(frames)                       # [N, *frame_shape]
        while ...:
            obs = chunker.observations()            # [N, *obs_shape], for the policy
            frames, r, term, trunc, info = envs.step(actions)
            next_frames, reset_frames = same_step_frames(frames, term, trunc, info)
            for chunk in chunker.step(actions, r, term, trunc, next_frames, reset_frames):
                send(chunk)
    """

    def __init__(self, num_envs: int, n_step: int, gamma: float, frame_stack: int,
                 chunk_transitions: int):
        if num_envs < 1:
            raise ValueError(f"num_envs ({num_envs}) must be >= 1")
        if n_step < 1:
            raise ValueError(f"n_step ({n_step}) must be >= 1")
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma ({gamma}) must be in [0, 1]")
        if frame_stack < 1:
            raise ValueError(f"frame_stack ({frame_stack}) must be >= 1")
        if chunk_transitions < 1:
            raise ValueError(f"chunk_transitions ({chunk_transitions}) must be >= 1")
        self.num_envs = int(num_envs)
        self.n_step = int(n_step)
        self.gamma = float(gamma)
        self.frame_stack = int(frame_stack)
        self.chunk_transitions = int(chunk_transitions)
        n = self.n_step
        self._gpow = self.gamma ** np.arange(n + 1, dtype=np.float64)
        # _slot_weights[s] weighs the reward ring when step t has just been written into
        # slot s = t % n: the oldest slot (s + 1) % n gets gamma^0, slot s gets gamma^(n-1).
        self._slot_weights = np.zeros((n, n), dtype=np.float64)
        for s in range(n):
            for k in range(n):
                self._slot_weights[s, (s + 1 + k) % n] = self._gpow[k]
        # _ret_weights[s][:, k]: weights of the ring for the return of the k+1 steps ending
        # at the step just written into slot s (used when episodes end).
        self._ret_weights = np.zeros((n, n, n), dtype=np.float64)
        for s in range(n):
            for k in range(n):
                for m in range(k + 1):
                    self._ret_weights[s, (s - k + m) % n, k] = self._gpow[m]
        self._env_range = np.arange(self.num_envs, dtype=np.int64)
        self._k_short = np.arange(n - 1, dtype=np.int64)
        self._k_full = np.full(self.num_envs, n - 1, dtype=np.int64)
        self._started = False
        self.env_steps = 0
        """Env steps fed so far (num_envs per call of ``step``)."""
        self.transitions_emitted = 0
        """Transitions handed out in chunks so far."""

    @classmethod
    def from_config(cls, cfg, num_envs: int | None = None) -> "NStepChunker":
        """For an ExperimentConfig: the algorithm's n_step and gamma, env.frame_stack,
        actor.chunk_transitions and (unless given) actor.envs_per_actor."""
        return cls(num_envs or cfg.actor.envs_per_actor, cfg.n_step, cfg.gamma,
                   cfg.env.frame_stack, cfg.actor.chunk_transitions)

    # ---------------------------------------------------------------- public API

    def reset(self, frames: np.ndarray) -> None:
        """Starts an episode in every env from its first frame ``[N, *frame_shape]``.

        Call once before the first ``step``. Calling it again abandons the unfinished
        n-step windows (completed transitions are kept for the next chunk).
        """
        frames = np.asarray(frames)
        if frames.shape[0] != self.num_envs:
            raise ValueError(f"frames: {frames.shape[0]} rows, expected num_envs ({self.num_envs})")
        if not self._started:
            self._allocate(frames)
        elif frames.shape[1:] != self.frame_shape:
            raise ValueError(f"frames: frame shape {frames.shape[1:]}, expected {self.frame_shape}")
        ids = self._append(frames)
        self._stack = np.repeat(ids[:, None], self.frame_stack, axis=1)
        self._r_obs[:] = self._stack[:, None, :]
        self._ep_start[:] = self._t
        self._latest_start = self._t
        self._started = True

    def observations(self) -> np.ndarray:
        """The current observations ``[N, *obs_shape]`` (stacked, oldest frame first)."""
        self._require_started()
        if self.frame_stack == 1:
            return self._log[self._stack[:, 0] - self._base]
        return self._log[self._stack - self._base]

    def step(self, actions, rewards, terminated, truncated, next_frames,
             reset_frames=None) -> list[Chunk]:
        """Records one batched env step and returns the chunks completed by it (often none).

        ``actions`` [N] (int) or [N, action_dim] (float): what each env was given.
        ``rewards``, ``terminated``, ``truncated`` [N]: what each env returned.
        ``next_frames`` [N, *frame_shape]: the newest frame after the step; for an env whose
        episode ended, its FINAL frame.
        ``reset_frames`` [N, *frame_shape] or None: for envs whose episode ended, the first
        frame of the next episode (other rows are ignored); needed when any env ended.
        """
        self._require_started()
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        done = terminated | truncated
        any_done = bool(done.any())
        if any_done and reset_frames is None:
            raise ValueError("reset_frames is required when an episode ended "
                             f"(envs {np.flatnonzero(done).tolist()})")
        N, n = self.num_envs, self.n_step
        t = self._t
        s = t % n
        if self._r_act is None:
            self._allocate_actions(actions)
        self._r_obs[:, s] = self._stack
        self._r_act[:, s] = actions
        self._r_rew[:, s] = rewards
        ids = self._append(next_frames)
        if self.frame_stack == 1:
            next_stack = ids[:, None]
        else:
            next_stack = np.concatenate((self._stack[:, 1:], ids[:, None]), axis=1)

        oldest = t - n + 1  # first step of the full n-step window ending at t
        o = (s + 1) % n     # its ring slot

        if not any_done:
            if oldest >= self._latest_start:
                # Common case: every env completes a full window; all rows at once.
                ret = self._r_rew @ self._slot_weights[s]
                self._push(self._r_obs[:, o], self._r_act[:, o], ret, self._gpow[n], next_stack)
            elif oldest >= 0:
                rows = self._ep_start <= oldest
                if rows.any():
                    ret = self._r_rew[rows] @ self._slot_weights[s]
                    self._push(self._r_obs[rows, o], self._r_act[rows, o], ret, self._gpow[n],
                               next_stack[rows])
        else:
            # Windows ending now: the full one (n steps, starting at t-n+1) of every env and,
            # for ended envs, the shorter ones (k+1 steps starting at t-k, k < n-1). One
            # gather over (env, k) pairs, however many envs ended.
            ended = np.flatnonzero(done)
            if n > 1:
                e = np.concatenate((np.repeat(ended, n - 1), self._env_range))
                k = np.concatenate((np.tile(self._k_short, ended.shape[0]), self._k_full))
            else:
                e, k = self._env_range, self._k_full
            valid = (t - k) >= self._ep_start[e]
            e, k = e[valid], k[valid]
            if e.shape[0]:
                g = self._r_rew @ self._ret_weights[s]  # [N, n]: g[:, k] spans steps t-k..t
                sl = (t - k) % n
                disc = np.where(terminated[e], 0.0, self._gpow[k + 1])
                self._push(self._r_obs[e, sl], self._r_act[e, sl], g[e, k], disc, next_stack[e])
            rid = self._append(np.asarray(reset_frames)[ended])
            next_stack[ended] = rid[:, None]
            self._ep_start[ended] = t + 1
            self._latest_start = t + 1
        self._stack = next_stack
        self._t = t + 1
        self.env_steps += N
        return self._take_chunks()

    def flush(self, truncate_pending: bool = False) -> Chunk | None:
        """The completed transitions not yet in a chunk, as one (shorter) chunk, or None.

        ``truncate_pending`` also closes every unfinished window as a truncation (K < n
        steps, bootstrapping from the current observation with gamma^K), e.g. when the actor
        stops; later steps then start new windows from the current state.
        """
        if truncate_pending and self._started and self._r_act is not None:
            t_last = self._t - 1
            first = max(self._t - self.n_step + 1, 0)
            for i in range(self.num_envs):
                start = max(first, int(self._ep_start[i]))
                if start <= t_last:
                    self._flush_env(i, t_last, False, self._stack[i], start=start)
            self._ep_start[:] = self._t
            self._latest_start = self._t
        if not self._started or self._o_count == 0:
            return None
        return self._make_chunk(self._o_count)

    @property
    def pending_transitions(self) -> int:
        """Completed transitions waiting for the next chunk."""
        return self._o_count if self._started else 0

    # ---------------------------------------------------------------- internals

    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("NStepChunker.reset(frames) must be called before step()")

    def _allocate(self, frames: np.ndarray) -> None:
        N, n, S, T = self.num_envs, self.n_step, self.frame_stack, self.chunk_transitions
        self.frame_shape = tuple(frames.shape[1:])
        self.frame_dtype = frames.dtype
        # Frames alive at once: each env's last n + S steps, plus the frames of up to T
        # completed transitions awaiting their chunk; 4x that keeps compaction rare.
        cap = 4 * (T * 2 + N * (n + S + 2))
        self._log = np.empty((cap, *self.frame_shape), dtype=self.frame_dtype)
        self._base = 0    # global id of _log[0]
        self._len = 0     # rows of _log in use
        self._t = 0       # batched steps taken
        self._stack = np.zeros((N, S), dtype=np.int64)
        self._ep_start = np.zeros(N, dtype=np.int64)
        self._latest_start = 0
        self._r_obs = np.zeros((N, n, S), dtype=np.int64)
        self._r_rew = np.zeros((N, n), dtype=np.float64)
        self._r_act: np.ndarray | None = None
        ocap = T + N * n  # at most N * n transitions per step
        self._o_obs = np.zeros((ocap, S), dtype=np.int64)
        self._o_next = np.zeros((ocap, S), dtype=np.int64)
        self._o_rew = np.zeros(ocap, dtype=np.float64)
        self._o_disc = np.zeros(ocap, dtype=np.float64)
        self._o_act: np.ndarray | None = None
        self._o_count = 0

    def _allocate_actions(self, actions) -> None:
        a = np.asarray(actions)
        dtype = np.int64 if a.dtype.kind in "iub" else np.float32
        shape = tuple(a.shape[1:])
        self._r_act = np.zeros((self.num_envs, self.n_step, *shape), dtype=dtype)
        self._o_act = np.zeros((self._o_obs.shape[0], *shape), dtype=dtype)

    def _append(self, frames: np.ndarray) -> np.ndarray:
        m = frames.shape[0]
        if self._len + m > self._log.shape[0]:
            self._compact(m)
        start = self._len
        self._log[start:start + m] = frames
        self._len = start + m
        first = self._base + start
        if m == self.num_envs:
            return self._env_range + first
        return np.arange(first, first + m, dtype=np.int64)

    def _compact(self, incoming: int) -> None:
        """Drops frames no pending or completed transition can still reference."""
        live = [self._stack.min()] if self._started else []
        if self._started:
            live.append(self._r_obs.min())
        if self._o_count:
            live.append(self._o_obs[:self._o_count].min())
        keep_from = (min(int(x) for x in live) if live else self._base + self._len) - self._base
        keep = self._len - keep_from
        cap = self._log.shape[0]
        if keep + incoming > cap // 2:  # grow, so compaction stays amortised O(1) per frame
            new = np.empty((max(2 * cap, 2 * (keep + incoming)), *self.frame_shape),
                           dtype=self.frame_dtype)
            new[:keep] = self._log[keep_from:self._len]
            self._log = new
        elif keep:
            self._log[:keep] = self._log[keep_from:self._len]
        self._base += keep_from
        self._len = keep

    def _push(self, obs_ids, acts, rets, disc, next_ids) -> None:
        c = self._o_count
        k = obs_ids.shape[0]
        self._o_obs[c:c + k] = obs_ids
        self._o_act[c:c + k] = acts
        self._o_rew[c:c + k] = rets
        self._o_disc[c:c + k] = disc
        self._o_next[c:c + k] = next_ids
        self._o_count = c + k

    def _flush_env(self, i: int, t: int, terminated: bool, next_ids: np.ndarray,
                   start: int | None = None) -> None:
        """Emits env i's unfinished windows (steps start..t) ending after step t."""
        n = self.n_step
        if start is None:
            start = max(t - n + 1, int(self._ep_start[i]))
        steps = range(start, t + 1)
        slots = [j % n for j in steps]
        rew = self._r_rew[i, slots]
        rets = np.empty(len(slots), dtype=np.float64)
        g = 0.0
        for k in range(len(slots) - 1, -1, -1):
            g = rew[k] + self.gamma * g
            rets[k] = g
        if terminated:
            disc = np.zeros(len(slots))
        else:
            disc = self._gpow[t + 1 - np.arange(start, t + 1)]
        self._push(self._r_obs[i, slots], self._r_act[i, slots], rets, disc,
                   np.broadcast_to(next_ids, (len(slots), self.frame_stack)))

    def _take_chunks(self) -> list[Chunk]:
        if self._o_count < self.chunk_transitions:
            return []
        out = []
        while self._o_count >= self.chunk_transitions:
            out.append(self._make_chunk(self.chunk_transitions))
        return out

    def _make_chunk(self, T: int) -> Chunk:
        S = self.frame_stack
        # Distinct frame ids in order, and each id's rank among them: ids live in the small
        # window of the frame log, so a mark-and-count over that window beats a sort.
        rel = np.concatenate((self._o_obs[:T].ravel(), self._o_next[:T].ravel())) - self._base
        mark = np.zeros(self._len, dtype=np.int32)
        mark[rel] = 1
        used = np.flatnonzero(mark)
        np.cumsum(mark, out=mark)
        inv = (mark[rel] - 1).reshape(2, T, S)
        chunk = Chunk(
            frames=self._log[used],
            obs_idx=inv[0],
            next_obs_idx=inv[1],
            actions=self._o_act[:T].copy(),
            rewards=self._o_rew[:T].astype(np.float32),
            discounts=self._o_disc[:T].astype(np.float32),
        )
        rest = self._o_count - T
        if rest:
            for a in (self._o_obs, self._o_next, self._o_act, self._o_rew, self._o_disc):
                a[:rest] = a[T:T + rest]
        self._o_count = rest
        self.transitions_emitted += T
        return chunk


def same_step_frames(obs: np.ndarray, terminated, truncated, info: dict
                     ) -> tuple[np.ndarray, np.ndarray | None]:
    """``(next_frames, reset_frames)`` for ``NStepChunker.step`` from a gymnasium vector env
    in SAME_STEP autoreset mode, where ``obs`` already holds the next episode's first frame
    for ended envs and ``info["final_obs"]`` their final frame."""
    done = np.logical_or(terminated, truncated)
    if not done.any():
        return obs, None
    final = info["final_obs"]
    next_frames = np.array(obs, copy=True)
    for i in np.flatnonzero(done):
        next_frames[i] = final[i]
    return next_frames, obs


def stacked(frames: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Observations from a chunk's frames and an index array ``[T, stack]``: ``[T, *obs_shape]``
    (the stack axis dropped when stack == 1, as EnvSpec.obs_shape has it)."""
    return frames[idx[:, 0]] if idx.shape[1] == 1 else frames[idx]
