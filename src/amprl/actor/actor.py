"""The actor loop: step a batch of envs with one batched forward pass per step, explore,
build n-step transitions, score their initial priorities with the actor's own network copy
and stream them to replay.

How it acts, explores and scores is the algorithm's behaviour (``amprl.core.Behaviour``,
from ``amprl.algos``). DQN: ε-greedy, Ape-X ε from a hash of the actor's identity, and
priorities from the Q-values of the acting passes (``algos/dqn/acting.py``); TD3: Gaussian
noise on the deterministic policy, uniform random actions for the first
``td3.random_steps``, and priorities from its critics (``algos/td3/acting.py``).

Neither sending nor weight refreshes block the env loop: chunks go through a bounded queue
to a sender thread (so a rate-limited replay slows the actor down instead of flooding
memory), and new weights are pulled by a background thread and swapped in between steps.
"""

from __future__ import annotations

import collections
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from amprl import algos, errors
from amprl.rl.exploration import derive_seed, seed_everything
from amprl.actor.nstep import NStepChunker
from amprl.common.backoff import Backoff
from amprl.common.supervise import Supervisor
from amprl.config import ExperimentConfig
from amprl.core import TransitionSink, WeightSource
from amprl.envs.factory import make_env
from amprl.envs.spec import EnvSpec

log = logging.getLogger(__name__)

_SEND_LINGER_S = 0.02
"""How long the sender waits for more chunks to share an Insert call (adds <= 20 ms of latency)."""
INSERT_TIMEOUT_S = 60.0
"""Deadline of one Insert call, rate-limiter waits included. A waiting insert costs replay
nothing but a suspended call, and the limiter lets waiting inserts through oldest first; a
deadline shorter than the fleet's turn would send the actor to the back of the queue to
resend the same chunks, so it is long."""


@dataclass
class ActorStats:
    env_steps: int = 0
    episodes: int = 0
    transitions_sent: int = 0
    insert_errors: int = 0
    """Inserts rejected for good (a bad chunk); their transitions are dropped."""
    insert_retries: int = 0
    """Inserts tried again after RESOURCE_EXHAUSTED, UNAVAILABLE or DEADLINE_EXCEEDED."""


class Actor:
    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, actor_id: str, replay: TransitionSink,
                 paramserver: WeightSource):
        self.cfg = cfg
        self.spec = spec
        self.actor_id = actor_id
        self.replay = replay
        self.ps = paramserver
        self.seed = derive_seed(cfg.run.seed, actor_id)
        seed_everything(self.seed)
        self.rng = np.random.default_rng(self.seed)
        n = cfg.actor.envs_per_actor
        self.envs = [make_env(cfg.env, training=True) for _ in range(n)]
        self.model = algos.build_model(cfg, spec).eval()
        self._params = dict(self.model.named_parameters())
        self.behaviour = algos.builder(cfg.algo).make_behaviour(cfg, spec, self.model, actor_id, self.rng)
        self.version = 0
        self.incarnation = 0  # the server's incarnation the weights came from (0: none yet)
        self._synced = False  # holds the server's weights (of self.version), not the seeded init
        self.stats = ActorStats()
        self.returns: collections.deque = collections.deque(maxlen=20)
        self._ep_return = np.zeros(n)
        self.chunker = NStepChunker(n, cfg.n_step, cfg.gamma, spec.frame_stack, cfg.actor.chunk_transitions)
        # Chunks built but not yet acknowledged by replay (queued or in an Insert call), in
        # transitions; the env loop waits while they exceed actor.max_unacked_transitions.
        # (chunk, priorities, env_steps, sequence): chunks numbered 1, 2, ... in this process
        # (its random incarnation_id), so a resent call is stored at most once
        self._outbox: queue.Queue = queue.Queue()
        self.incarnation_id = secrets.randbelow(2**63 - 1) + 1
        self._sequence = 0
        self._unacked = 0
        self._unacked_cv = threading.Condition()
        self._pending: tuple[int, int, dict] | None = None  # (version, incarnation, weights)
        self._pending_lock = threading.Lock()
        self._want_pull = threading.Event()
        self._stop = threading.Event()
        self._steps_since_send = 0
        self._run_stop = threading.Event()
        self._threads = Supervisor("actor")

    # -- weights ---------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, version: int, incarnation: int, weights: dict) -> None:
        for name, value in weights.items():
            self._params[name].copy_(value)
        self.behaviour.sync()
        self.version, self.incarnation = version, incarnation
        self._synced = True

    def _pull_loop(self) -> None:
        """Pulls when the env loop asks (every actor.weight_refresh_steps) and at least every
        actor.weight_refresh_s, also while the env loop waits on replay."""
        backoff = Backoff()
        every = self.cfg.actor.weight_refresh_s
        due = time.monotonic() + every
        while not self._stop.is_set():
            # wake at least every 0.5 s to see _stop
            asked = self._want_pull.wait(timeout=min(0.5, max(0.0, due - time.monotonic())))
            if not asked and time.monotonic() < due:
                continue
            self._want_pull.clear()
            due = time.monotonic() + every
            try:
                have, have_incarnation = ((self._pending[0], self._pending[1]) if self._pending
                                          else (self.version, self.incarnation))
                if have == 0 and self._synced and self.ps.info(timeout=30.0).version == 0:
                    # The server reads have_version 0 as "none" and would resend the initial
                    # weights we hold (13 MB for the Nature CNN) on every refresh until the
                    # learner's first update.
                    continue
                version, incarnation, weights = self.ps.pull_versioned(
                    have, have_incarnation, encoding="fp32", timeout=30.0)
            except errors.AmprlError as exc:
                log.warning("weight pull failed: %s", exc)
                self._want_pull.set()  # try again after the pause
                self._stop.wait(backoff.next())
                continue
            backoff.reset()
            if weights is not None:
                with self._pending_lock:
                    self._pending = (version, incarnation, weights)

    def _swap_weights(self) -> None:
        """Loads pulled weights that are newer, or of another server incarnation (a restarted
        parameter server may count versions again from a lower number)."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None and (pending[0] > self.version or pending[1] != self.incarnation
                                    or not self._synced):
            self._load(*pending)

    # -- sending ---------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while not (self._stop.is_set() and self._outbox.empty()):
            try:
                first = self._outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            # Up to 16 chunks per Insert call, lingering up to _SEND_LINGER_S for them: each
            # call costs the actor's core a gRPC stream and a request-iterator thread.
            items = [first]
            linger_until = time.monotonic() + _SEND_LINGER_S
            while len(items) < 16 and not self._stop.is_set():
                try:
                    items.append(self._outbox.get(timeout=max(0.0, linger_until - time.monotonic())))
                except queue.Empty:
                    break
            try:
                self._insert(items)
            finally:
                with self._unacked_cv:
                    self._unacked -= sum(len(chunk.actions) for chunk, _, _, _ in items)
                    self._unacked_cv.notify_all()

    def _insert(self, items) -> None:
        """Sends ``items`` until replay stores them (or the actor stops). A full shard
        (RESOURCE_EXHAUSTED), an unreachable one (UNAVAILABLE) and a rate-limited wait that
        outlasted the call (DEADLINE_EXCEEDED) are retried with the same items after a
        jittered, growing pause, so a fleet refused together does not come back together."""
        backoff = Backoff()
        while True:
            try:
                reply = self.replay.insert(self.actor_id, [item[:3] for item in items],
                                           timeout=INSERT_TIMEOUT_S, cancel=self._stop,
                                           incarnation=self.incarnation_id,
                                           first_sequence=items[0][3])
                self.stats.transitions_sent += int(reply.transitions_stored)
                return
            except (errors.DeadlineExceeded, errors.ResourceExhausted, errors.Unavailable) as exc:
                if self._stop.is_set():
                    return  # shutting down: drop what replay would not take
                self.stats.insert_retries += 1
                if not isinstance(exc, errors.DeadlineExceeded):  # that one is the limiter
                    log.warning("insert not taken, retrying: %s", exc)
                if self._stop.wait(backoff.next()):
                    return
            except errors.AmprlError as exc:
                self.stats.insert_errors += 1
                log.error("insert rejected: %s", exc)
                return

    def _enqueue(self, scored) -> None:
        """Queues ``(chunk, |δ|)`` pairs for the sender, with priorities |δ| + ε."""
        eps = np.float32(self.cfg.replay.priority_epsilon)
        for chunk, td_abs in scored:
            prios = td_abs + eps
            env_steps, self._steps_since_send = self._steps_since_send, 0
            self._sequence += 1
            item = (chunk, prios, env_steps, self._sequence)
            size = len(chunk.actions)
            limit = self.cfg.actor.max_unacked_transitions
            with self._unacked_cv:
                # Back-pressure from replay's rate limiter reaches the env loop here, so the
                # data replay receives is never more than ``limit`` env steps old (a chunk
                # larger than the limit goes alone).
                while (self._unacked and self._unacked + size > limit
                       and not (self._stop.is_set() or self._run_stop.is_set())):
                    self._threads.check()  # a dead sender acknowledges nothing
                    self._unacked_cv.wait(timeout=0.5)
                if self._stop.is_set() or self._run_stop.is_set():
                    return
                self._unacked += size
            self._outbox.put(item)

    # -- the loop --------------------------------------------------------------------------

    def start(self) -> None:
        try:
            pulled = self.ps.pull_versioned(0, 0, timeout=60.0)
            assert pulled.weights is not None  # have_version 0 means none held: weights always come
            self._load(pulled.version, pulled.incarnation, pulled.weights)
        except errors.AmprlError as exc:
            log.warning("initial pull failed (%s); acting with the seeded initial weights", exc)
        for target, name in ((self._send_loop, "send"), (self._pull_loop, "pull")):
            self._threads.start(target, name)

    def stop(self) -> None:
        self._stop.set()
        self._threads.join(timeout_s=5.0)

    def run(self, stop: threading.Event, max_steps: int | None = None) -> None:
        """Steps the envs until ``stop`` is set (or ``max_steps`` env steps in all). Raises
        ThreadDied once the sender or the weight thread has died (the process should end)."""
        self._run_stop = stop
        # torch's (OpenMP) thread count is per OS thread: a thread that never set it runs
        # every op on a team of one thread per core, which spins against the env loop.
        torch.set_num_threads(self.cfg.deploy.actor_torch_threads)
        n = len(self.envs)
        first = []
        for k, env in enumerate(self.envs):
            frame, _ = env.reset(seed=self.seed + k)
            env.action_space.seed(self.seed + k)
            first.append(frame)
        self.chunker.reset(np.stack(first))
        envs = self.envs
        behaviour = self.behaviour
        refresh = self.cfg.actor.weight_refresh_steps
        next_refresh = refresh
        while not stop.is_set() and (max_steps is None or self.stats.env_steps < max_steps):
            self._threads.check()
            self._swap_weights()
            obs = self.chunker.observations()
            actions, env_actions = behaviour.act(obs, self.stats.env_steps)
            # Per env step only env.step itself runs in Python; results are gathered into
            # arrays once per batched step.
            results = [env.step(a) for env, a in zip(envs, env_actions)]
            frames, rews, terms, truncs, _ = zip(*results)
            next_frames = np.array(frames)
            rewards = np.array(rews, dtype=np.float64)
            terminated = np.array(terms, dtype=bool)
            truncated = np.array(truncs, dtype=bool)
            ended = terminated | truncated
            any_ended = bool(ended.any())
            reset_frames = None
            if any_ended:
                reset_frames = np.empty_like(next_frames)
                for i in np.flatnonzero(ended):
                    reset_frames[i], _ = envs[i].reset()
            ready = behaviour.observe(self.chunker, actions, rewards, terminated, truncated,
                                      next_frames, reset_frames)
            self._ep_return += rewards
            if any_ended:
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
        """The behaviour's actions for ``obs`` now, exploration included."""
        return self.behaviour.act(obs, self.stats.env_steps)[0]

    @property
    def epsilon(self) -> float:
        """How much the actor explores now (DQN: mean ε; TD3: the Gaussian noise std in
        half-ranges), for status reports."""
        return self.behaviour.epsilon(self.stats.env_steps)

    @property
    def recent_return(self) -> float:
        return float(np.mean(self.returns)) if self.returns else 0.0
