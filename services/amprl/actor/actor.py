"""The actor loop: step a batch of envs with one batched forward pass per step, explore
(DQN: ε-greedy, Ape-X ε from a hash of the actor's identity; TD3: Gaussian noise on the
deterministic policy, uniform random actions for the first ``td3.random_steps``), build
n-step transitions, score their initial priorities with the actor's own network copy
(DQN: |δ| of double DQN; TD3: |Q1 - y| of its own critic, no smoothing noise) and stream
them to replay.

Neither sending nor weight refreshes block the env loop: chunks go through a bounded queue
to a sender thread (so a rate-limited replay slows the actor down instead of flooding
memory), and new weights are pulled by a background thread and swapped in between steps.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from amprl import errors
from amprl.actor.exploration import apex_epsilon, derive_seed, gaussian_exploration, seed_everything
from amprl.actor.nstep import NStepChunker
from amprl.actor.policy import q_values
from amprl.config import ExperimentConfig
from amprl.envs.factory import make_env
from amprl.envs.spec import EnvSpec
from amprl.rl import td3
from amprl.rl.batch import Batch
from amprl.rl.models import build_model

log = logging.getLogger(__name__)


@dataclass
class ActorStats:
    env_steps: int = 0
    episodes: int = 0
    transitions_sent: int = 0
    insert_errors: int = 0


class Actor:
    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, actor_id: str, replay, paramserver):
        self.cfg = cfg
        self.spec = spec
        self.actor_id = actor_id
        self.replay = replay
        self.ps = paramserver
        self.seed = derive_seed(cfg.run.seed, actor_id)
        seed_everything(self.seed)
        self.rng = np.random.default_rng(self.seed)
        n = cfg.actor.envs_per_actor
        # Ape-X ε per environment: u from a hash of "<actor id>/<env index>", so a fleet of any
        # size (even 2 local actors) spans the schedule without coordination.
        self.epsilons = np.array([apex_epsilon(f"{actor_id}/{j}", cfg.actor.epsilon_base, cfg.actor.epsilon_alpha)
                                  for j in range(n)])
        self.envs = [make_env(cfg.env, training=True) for _ in range(n)]
        self.discrete = spec.discrete
        if not self.discrete:
            self._low = np.asarray(spec.action_low, dtype=np.float32)
            self._high = np.asarray(spec.action_high, dtype=np.float32)
        self.model = build_model(cfg, spec).eval()
        self._params = dict(self.model.named_parameters())
        self.version = 0
        self.stats = ActorStats()
        self.returns: collections.deque = collections.deque(maxlen=20)
        self._ep_return = np.zeros(n)
        self.chunker = NStepChunker(n, cfg.n_step, cfg.gamma, spec.frame_stack, cfg.actor.chunk_transitions)
        self._outbox: queue.Queue = queue.Queue(maxsize=8)
        self._pending: tuple[int, dict] | None = None
        self._pending_lock = threading.Lock()
        self._want_pull = threading.Event()
        self._stop = threading.Event()
        self._steps_since_send = 0
        self._run_stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- weights ---------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, version: int, weights: dict) -> None:
        for name, value in weights.items():
            self._params[name].copy_(value)
        self.version = version

    def _pull_loop(self) -> None:
        while not self._stop.is_set():
            if not self._want_pull.wait(timeout=0.5):
                continue
            self._want_pull.clear()
            try:
                have = self._pending[0] if self._pending else self.version
                version, weights = self.ps.pull(have_version=have, encoding="fp32", timeout=30.0)
            except errors.AmprlError as exc:
                log.warning("weight pull failed: %s", exc)
                self._stop.wait(0.5)
                continue
            if weights is not None:
                with self._pending_lock:
                    self._pending = (version, weights)

    def _swap_weights(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None and pending[0] > self.version:
            self._load(*pending)

    # -- sending ---------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while not (self._stop.is_set() and self._outbox.empty()):
            try:
                first = self._outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            items = [first]
            while len(items) < 16:
                try:
                    items.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            while True:
                try:
                    reply = self.replay.insert(self.actor_id, items, timeout=5.0)
                    self.stats.transitions_sent += int(reply.transitions_stored)
                    break
                except errors.DeadlineExceeded:
                    if self._stop.is_set():
                        break  # rate-limited at shutdown: drop
                except errors.Unavailable as exc:
                    log.warning("replay unavailable: %s", exc)
                    if self._stop.wait(1.0):
                        break
                except errors.AmprlError as exc:
                    self.stats.insert_errors += 1
                    log.error("insert rejected: %s", exc)
                    break

    def _enqueue(self, chunks) -> None:
        for chunk in chunks:
            prios = self.initial_priorities(chunk)
            env_steps, self._steps_since_send = self._steps_since_send, 0
            item = (chunk, prios, env_steps)
            while not (self._stop.is_set() or self._run_stop.is_set()):
                try:
                    self._outbox.put(item, timeout=0.5)
                    break
                except queue.Full:
                    continue

    @torch.inference_mode()
    def initial_priorities(self, chunk) -> np.ndarray:
        """Ape-X: |δ| of each transition under the actor's own network, + ε."""
        if self.discrete:
            td = self._dqn_td_abs(chunk)
        else:
            batch = Batch.from_chunk(chunk, frame_stack=self.spec.frame_stack)
            td = td3.td3_td_abs(self.model, self.model, batch, noise=0.0)
        return td.numpy().astype(np.float32) + np.float32(self.cfg.replay.priority_epsilon)

    def _dqn_td_abs(self, chunk) -> torch.Tensor:
        """|R + D max_a Q(s', a) - Q(s, a)| with the actor's network as online and target
        (``dqn.dqn_td_abs(model, model, ...)``), from ONE forward pass over the chunk's
        distinct observations: the next observation of one transition is the observation
        of another, so scoring [obs; next_obs] would run the network twice per transition.
        """
        rows = len(chunk.rewards)
        if self.spec.frame_stack == 1:
            obs, obs_i, next_i = chunk.frames, chunk.obs_idx[:, 0], chunk.next_obs_idx[:, 0]
        else:  # distinct stacks (rows of frame indices)
            stacks, inv = np.unique(np.concatenate((chunk.obs_idx, chunk.next_obs_idx)), axis=0,
                                    return_inverse=True)
            inv = inv.reshape(-1)
            obs, obs_i, next_i = chunk.frames[stacks], inv[:rows], inv[rows:]
        q = self.model(torch.from_numpy(np.ascontiguousarray(obs))).float()
        obs_i, next_i = torch.from_numpy(obs_i), torch.from_numpy(next_i)
        q_sa = q[obs_i, torch.from_numpy(np.asarray(chunk.actions, dtype=np.int64))]
        y = (torch.from_numpy(chunk.rewards) + torch.from_numpy(chunk.discounts)
             * q[next_i].max(dim=1).values)
        return (q_sa - y).abs()

    # -- the loop --------------------------------------------------------------------------

    def start(self) -> None:
        try:
            version, weights = self.ps.pull(have_version=0, timeout=60.0)
            self._load(version, weights)
        except errors.AmprlError as exc:
            log.warning("initial pull failed (%s); acting with the seeded initial weights", exc)
        for target, name in ((self._send_loop, "send"), (self._pull_loop, "pull")):
            t = threading.Thread(target=target, name=f"actor-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5.0)

    def run(self, stop: threading.Event, max_steps: int | None = None) -> None:
        self._run_stop = stop
        n = len(self.envs)
        first = []
        for i, env in enumerate(self.envs):
            frame, _ = env.reset(seed=self.seed + i)
            env.action_space.seed(self.seed + i)
            first.append(frame)
        self.chunker.reset(np.stack(first))
        envs = self.envs
        refresh = self.cfg.actor.weight_refresh_steps
        next_refresh = refresh
        while not stop.is_set() and (max_steps is None or self.stats.env_steps < max_steps):
            self._swap_weights()
            actions = self.act(self.chunker.observations())
            # Per env step only env.step itself runs in Python: Python ints for discrete
            # actions (gymnasium's Discrete.contains is slow on NumPy scalars), results
            # gathered into arrays once per batched step.
            results = [env.step(a) for env, a in
                       zip(envs, actions.tolist() if self.discrete else actions)]
            frames, rews, terms, truncs, _ = zip(*results)
            next_frames = np.stack(frames)
            rewards = np.array(rews, dtype=np.float64)
            terminated = np.array(terms, dtype=bool)
            truncated = np.array(truncs, dtype=bool)
            ended = terminated | truncated
            reset_frames = None
            if ended.any():
                reset_frames = np.empty_like(next_frames)
                for i in np.flatnonzero(ended):
                    reset_frames[i], _ = envs[i].reset()
            ready = self.chunker.step(actions, rewards, terminated, truncated, next_frames,
                                      reset_frames)
            self._ep_return += rewards
            if ended.any():
                for i in np.flatnonzero(ended):
                    self.returns.append(self._ep_return[i])
                    self._ep_return[i] = 0.0
                self.stats.episodes += int(ended.sum())
            self.stats.env_steps += n
            self._steps_since_send += n
            if ready:
                self._enqueue(ready)
            if self.stats.env_steps >= next_refresh:
                next_refresh += refresh
                self._want_pull.set()

    def act(self, obs: np.ndarray) -> np.ndarray:
        """ε-greedy over one batched forward pass of the actor's network (DQN), or the
        deterministic policy plus Gaussian noise, clipped to the bounds (TD3)."""
        if not self.discrete:
            return self._act_continuous(obs)
        actions = q_values(self.model, obs).argmax(dim=1).numpy()
        explore = self.rng.random(len(actions)) < self.current_epsilons()
        if explore.any():
            actions = np.where(explore, self.rng.integers(self.spec.num_actions, size=len(actions)), actions)
        return actions

    @torch.inference_mode()
    def _act_continuous(self, obs: np.ndarray) -> np.ndarray:
        n = obs.shape[0]
        if self.stats.env_steps < self.cfg.td3.random_steps:
            # uniform exploration before the policy means anything (Fujimoto et al.: 25k/1k)
            return self.rng.uniform(self._low, self._high, size=(n, len(self._low))).astype(np.float32)
        actions = self.model.actor(torch.from_numpy(np.ascontiguousarray(obs))).numpy()
        return gaussian_exploration(actions, self.cfg.td3.exploration_noise, self._low, self._high,
                                    self.rng)

    def current_epsilons(self) -> np.ndarray:
        """Each env's ε, raised towards 1 during the first epsilon_warmup_steps env steps."""
        warmup = self.cfg.actor.epsilon_warmup_steps
        if warmup <= 0 or self.stats.env_steps >= warmup:
            return self.epsilons
        return self.epsilons + (1.0 - self.epsilons) * (1.0 - self.stats.env_steps / warmup)

    @property
    def epsilon(self) -> float:
        """Mean ε (DQN) or the Gaussian noise std in half-ranges (TD3), for status reports."""
        if not self.discrete:
            return float(self.cfg.td3.exploration_noise)
        return float(self.current_epsilons().mean())

    @property
    def recent_return(self) -> float:
        return float(np.mean(self.returns)) if self.returns else 0.0
