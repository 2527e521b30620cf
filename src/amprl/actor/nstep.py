"""n-step transitions from a batch of environments, packed into self-contained chunks.

The actor feeds ``NStepChunker.step`` once per batched env step with the NEWEST frame of
each env (the whole observation when ``frame_stack == 1``); the chunker keeps the frame
stacks, the n-step windows, a log of recent frames (``actor/framelog.py``) and the
completed transitions (``actor/completed.py``), and hands back ``Chunk``s of
``chunk_transitions`` transitions, each carrying the distinct frames its stacks use (frames
from before the chunk are copied in, so every chunk stands alone in replay).

Each transition's reward and discount are its n-step return and bootstrap discount
(``rl/returns.py``: K = min(n, steps left in the episode) steps, discount 0 after a
termination, gamma^K otherwise); its next_obs is the observation after step t+K-1 (the
final observation at an episode end). At an episode end every pending transition is
flushed with K < n steps. A new episode's first stack repeats its first frame
``frame_stack`` times (the index repeats; the frame is stored once).

Episode ends follow gymnasium's SAME_STEP autoreset: the step that ends an episode reports
the final frame and the first frame of the next episode together (``next_frames`` and
``reset_frames``). With ``gymnasium.vector.SyncVectorEnv(..., autoreset_mode=
AutoresetMode.SAME_STEP)`` use ``envs.autoreset.same_step_frames``; with a plain list of envs, reset the
ended ones yourself and pass their first frames as ``reset_frames``. (gymnasium's default
NEXT_STEP mode spends one extra step per episode on the reset and is not accepted.)

Ape-X actors score each transition's initial priority with the Q-values they acted on
(``step_scored``): the chunker carries Q(s_t, a_t) of each step through the n-step window and
the bootstrap value V(s_{t+n}) from the acting pass at s_{t+n}, and hands out each chunk with

    td_abs = |reward + discount * V(next_obs) - Q(obs, action)|

so no network runs over the chunk again. A truncated episode's final observation is never
acted on; the caller scores it separately (``final_observations``).

Cost: a step is a fixed handful of NumPy calls over the env batch, whatever its size; a
step where episodes end adds one gather over the (env, window) pairs, and a chunk a
mark-and-count over the frame log. So the cost per env step falls as the envs per actor
grow (``bench/actor.py``).
"""

from __future__ import annotations

import numpy as np

from amprl.actor.completed import CompletedTransitions
from amprl.actor.framelog import FrameLog
from amprl.rl.returns import discount_powers, full_window_weights, short_window_weights, suffix_returns
from amprl.rl.transitions import Chunk


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

    # State that the first reset allocates (_allocate), declared here for type checkers.
    _t: int
    _ep_start: np.ndarray
    _r_obs: np.ndarray
    _r_rew: np.ndarray
    _r_act: np.ndarray | None
    _r_q: np.ndarray
    _completed: CompletedTransitions
    _zeros_v: np.ndarray

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
        self._gpow = discount_powers(self.gamma, n)
        self._slot_weights = full_window_weights(self.gamma, n)  # [slot of t]: window t-n+1..t
        self._ret_weights = short_window_weights(self.gamma, n)  # [slot of t][:, k]: t-k..t
        self._env_range = np.arange(self.num_envs, dtype=np.int64)
        self._all = slice(None)  # _push: every env
        self._k_short = np.arange(n - 1, dtype=np.int64)
        self._k_full = np.full(self.num_envs, n - 1, dtype=np.int64)
        self._started = False
        self._scored: bool | None = None  # step (False) or step_scored (True), fixed by the first call
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
        n-step windows (completed transitions are kept for the next chunk; with
        ``step_scored``, those completed by the last step are dropped too: they bootstrap from
        observations that will never be acted on).
        """
        frames = np.asarray(frames)
        if frames.shape[0] != self.num_envs:
            raise ValueError(f"frames: {frames.shape[0]} rows, expected num_envs ({self.num_envs})")
        if not self._started:
            self._allocate(frames)
        elif frames.shape[1:] != self._log.frame_shape:
            raise ValueError(f"frames: frame shape {frames.shape[1:]}, expected {self._log.frame_shape}")
        elif self._scored:
            self._completed.drop_unscored()
        ids = self._log.append(frames, self._oldest_live)
        self._stack = np.repeat(ids[:, None], self.frame_stack, axis=1)
        self._r_obs[:] = self._stack[:, None, :]
        self._ep_start[:] = self._t
        self._latest_start = self._t
        self._started = True

    def observations(self) -> np.ndarray:
        """The current observations ``[N, *obs_shape]`` (stacked, oldest frame first)."""
        self._require_started()
        return self._log.get(self._stack[:, 0] if self.frame_stack == 1 else self._stack)

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
        self._set_mode(scored=False)
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        self._record(actions, rewards, terminated, truncated, terminated | truncated, next_frames,
                     reset_frames)
        out = []
        while self._completed.count >= self.chunk_transitions:
            out.append(self._make_chunk(self.chunk_transitions))
        return out

    def step_scored(self, actions, rewards, terminated, truncated, next_frames, reset_frames=None,
                    *, q_taken, values, final_values=None) -> list[tuple[Chunk, np.ndarray]]:
        """``step`` for an actor that scores transitions with the Q-values it acted on:
        returns ``(chunk, td_abs)`` pairs, ``td_abs`` float32 [T] (see the module doc).

        ``q_taken`` [N]: Q(s_t, a) of the action each env was given; ``values`` [N]: the
        bootstrap value V(s_t) of the observations acted on (max_a Q(s_t, a): with one
        network as online and target, also the double-DQN value); both from the acting pass
        over ``observations()``. ``final_values`` [N] or None: for envs TRUNCATED by this
        step, V of their final observation (``final_observations``), other rows ignored;
        needed when any env was truncated without terminating (a termination bootstraps
        with discount 0).

        Transitions completed by this step bootstrap from the observations the NEXT call
        acts on, so they are scored, and their chunk handed out, one call later than
        ``step`` would hand it out. Use ``step`` or ``step_scored`` for a chunker's lifetime.
        """
        self._set_mode(scored=True)
        self._require_started()
        # The transitions completed by the previous call bootstrap from the observations
        # acted on now: their values arrive with this call.
        self._completed.receive_values(values)
        out = []
        while self._completed.scored >= self.chunk_transitions:
            td = self._completed.td_abs(self.chunk_transitions)
            out.append((self._make_chunk(self.chunk_transitions), td))
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        done = terminated | truncated
        self._step_q = np.asarray(q_taken, dtype=np.float32)
        if done.any():
            self._step_wait = np.where(done, -1, self._env_range)
            cut = truncated & ~terminated
            if cut.any() and final_values is None:
                raise ValueError("final_values is required when an episode was truncated "
                                 f"(envs {np.flatnonzero(cut).tolist()})")
            self._step_v = (np.where(cut, np.asarray(final_values, dtype=np.float32), 0.0)
                            .astype(np.float32) if cut.any() else self._zeros_v)
        else:
            self._step_wait = self._env_range
            self._step_v = self._zeros_v
        self._record(actions, rewards, terminated, truncated, done, next_frames, reset_frames)
        return out

    def final_observations(self, next_frames: np.ndarray, rows) -> np.ndarray:
        """The observations ``[len(rows), *obs_shape]`` that end the episodes of envs ``rows``
        (their stacks with the final frames of ``next_frames`` pushed in), for scoring
        truncations with ``step_scored``. Call before ``step_scored`` records the step."""
        self._require_started()
        final = np.asarray(next_frames)[rows]
        if self.frame_stack == 1:
            return final
        return np.concatenate((self._log.get(self._stack[rows, 1:]), final[:, None]), axis=1)

    def _record(self, actions, rewards, terminated, truncated, done, next_frames,
                reset_frames) -> None:
        self._require_started()
        any_done = bool(done.any())
        if any_done and reset_frames is None:
            raise ValueError("reset_frames is required when an episode ended "
                             f"(envs {np.flatnonzero(done).tolist()})")
        N, n = self.num_envs, self.n_step
        t = self._t
        s = t % n
        if self._r_act is None:
            self._r_act = self._allocate_actions(actions)
        self._r_obs[:, s] = self._stack
        self._r_act[:, s] = actions
        self._r_rew[:, s] = rewards
        if self._scored:
            self._r_q[:, s] = self._step_q
        ids = self._log.append(next_frames, self._oldest_live)
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
                self._push(self._all, o, ret, self._gpow[n], next_stack)
            elif oldest >= 0:
                rows = np.flatnonzero(self._ep_start <= oldest)
                if rows.shape[0]:
                    ret = self._r_rew[rows] @ self._slot_weights[s]
                    self._push(rows, o, ret, self._gpow[n], next_stack[rows])
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
                disc = np.where(terminated[e], 0.0, self._gpow[k + 1])
                self._push(e, (t - k) % n, g[e, k], disc, next_stack[e])
            rid = self._log.append(np.asarray(reset_frames)[ended], self._oldest_live)
            next_stack[ended] = rid[:, None]
            self._ep_start[ended] = t + 1
            self._latest_start = t + 1
        self._stack = next_stack
        self._t = t + 1
        self.env_steps += N

    def flush(self, truncate_pending: bool = False) -> Chunk | None:
        """The completed transitions not yet in a chunk, as one (shorter) chunk, or None.

        ``truncate_pending`` also closes every unfinished window as a truncation (K < n
        steps, bootstrapping from the current observation with gamma^K), e.g. when the actor
        stops; later steps then start new windows from the current state.
        Not for ``step_scored``: the last step's transitions await values no call brings.
        """
        if self._scored:
            raise RuntimeError("flush: a chunker fed by step_scored hands out scored chunks only")
        if truncate_pending and self._started and self._r_act is not None:
            t_last = self._t - 1
            first = max(self._t - self.n_step + 1, 0)
            for i in range(self.num_envs):
                start = max(first, int(self._ep_start[i]))
                if start <= t_last:
                    self._flush_env(i, t_last, False, self._stack[i], start=start)
            self._ep_start[:] = self._t
            self._latest_start = self._t
        if not self._started or self._completed.count == 0:
            return None
        return self._make_chunk(self._completed.count)

    @property
    def pending_transitions(self) -> int:
        """Completed transitions waiting for the next chunk."""
        return self._completed.count if self._started else 0

    # ---------------------------------------------------------------- internals

    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("NStepChunker.reset(frames) must be called before step()")

    def _set_mode(self, scored: bool) -> None:
        if self._scored is None:
            self._scored = scored
        elif self._scored != scored:
            raise RuntimeError("NStepChunker: step and step_scored cannot be mixed on one chunker")

    def _allocate(self, frames: np.ndarray) -> None:
        N, n, S, T = self.num_envs, self.n_step, self.frame_stack, self.chunk_transitions
        # Frames alive at once: each env's last n + S steps, plus the frames of up to T
        # completed transitions awaiting their chunk; 4x that keeps compaction rare.
        self._log = FrameLog(frames.shape[1:], frames.dtype, 4 * (T * 2 + N * (n + S + 2)), N)
        self._t = 0       # batched steps taken
        self._stack = np.zeros((N, S), dtype=np.int64)
        self._ep_start = np.zeros(N, dtype=np.int64)
        self._latest_start = 0
        self._r_obs = np.zeros((N, n, S), dtype=np.int64)
        self._r_rew = np.zeros((N, n), dtype=np.float64)
        self._r_act = None
        self._r_q = np.zeros((N, n), dtype=np.float32)  # step_scored: Q(s_t, a_t)
        self._r_obs_flat = self._r_obs.reshape(N * n, S)  # views, row = env * n + slot
        self._r_q_flat = self._r_q.reshape(N * n)
        self._completed = CompletedTransitions(T + N * n, S)  # at most N * n per step
        self._zeros_v = np.zeros(N, dtype=np.float32)
        self._step_q = self._zeros_v
        self._step_v = self._zeros_v
        self._step_wait = np.full(N, -1, dtype=np.int64)

    def _allocate_actions(self, actions) -> np.ndarray:
        """The actions ring (``_r_act``), shaped and typed as the first step's ``actions``."""
        a = np.asarray(actions)
        dtype = np.int64 if a.dtype.kind in "iub" else np.float32
        shape = tuple(a.shape[1:])
        r_act = np.zeros((self.num_envs, self.n_step, *shape), dtype=dtype)
        self._r_act_flat = r_act.reshape(self.num_envs * self.n_step, *shape)
        self._completed.allocate_actions(shape, dtype)
        return r_act

    def _oldest_live(self) -> int:
        """The oldest frame id a stack, a pending window or a completed transition uses."""
        live = [self._stack.min(), self._r_obs.min()] if self._started else []
        if self._completed.count:
            live.append(self._completed.oldest_frame())
        return min(int(x) for x in live) if live else self._log.end()

    def _push(self, envs, slots, rets, disc, next_ids) -> None:
        """Completes the transitions of ``envs`` (indices, or ``_all``) that start in ring
        ``slots`` (one slot, or one per env)."""
        rings: tuple[np.ndarray, ...]
        if envs is not self._all:
            # one flat gather per ring: cheaper than indexing with two arrays
            slots = envs * self.n_step + slots
            rings = (self._r_obs_flat, self._r_act_flat, self._r_q_flat)
        else:
            assert self._r_act is not None  # allocated by the first _record
            rings = (self._r_obs, self._r_act, self._r_q)
            slots = (self._all, slots)
        scores = (rings[2][slots], self._step_v[envs], self._step_wait[envs]) if self._scored else None
        self._completed.add(rings[0][slots], rings[1][slots], rets, disc, next_ids, scores)

    def _flush_env(self, i: int, t: int, terminated: bool, next_ids: np.ndarray,
                   start: int | None = None) -> None:
        """Emits env i's unfinished windows (steps start..t) ending after step t."""
        n = self.n_step
        if start is None:
            start = max(t - n + 1, int(self._ep_start[i]))
        slots = [j % n for j in range(start, t + 1)]
        rets = suffix_returns(self._r_rew[i, slots], self.gamma)
        if terminated:
            disc = np.zeros(len(slots))
        else:
            disc = self._gpow[t + 1 - np.arange(start, t + 1)]
        self._push(np.full(len(slots), i), np.asarray(slots), rets, disc,
                   np.broadcast_to(next_ids, (len(slots), self.frame_stack)))

    def _make_chunk(self, T: int) -> Chunk:
        self.transitions_emitted += T
        return self._completed.take(T, self._log)
