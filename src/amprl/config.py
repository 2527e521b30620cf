"""The experiment config: one YAML file maps onto these dataclasses.

Every service reads the same file (a ConfigMap on Kubernetes). ``load_config`` rejects an
unknown key or a bad value with a ConfigError naming the key, before any process starts.
Overrides use dotted keys: ``--set learner.batch_size=64``; values are YAML scalars, and a key
that wants a number also takes exponent notation as Python writes it (``1e-6``, which YAML 1.1
itself reads as a string). NaN and infinities are refused.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from amprl.errors import ConfigError


@dataclass
class EnvConfig:
    id: str = "CartPole-v1"
    """Gymnasium id: classic control ("CartPole-v1"), Atari ("ALE/Pong-v5") or MuJoCo ("HalfCheetah-v5")."""
    frame_stack: int = 1
    """Frames per observation (Atari: 4). 1 means the observation is the frame itself."""
    max_episode_steps: int = 0
    """Time limit per episode; 0 keeps the environment's own."""
    atari_noop_max: int = 30
    """Atari: at most this many no-ops at reset."""
    atari_frame_skip: int = 4
    """Atari: repeat each action this many frames, max-pooling the last two."""
    atari_screen_size: int = 84
    """Atari: frames are resized to a square of this many pixels, grayscale."""
    atari_terminal_on_life_loss: bool = True
    """Atari: training episodes end at a life loss (evaluation never does)."""
    atari_clip_rewards: bool = True
    """Atari: training rewards are clipped to their sign (evaluation reports the real score)."""
    atari_sticky_action_prob: float = 0.25
    """Atari: probability of repeating the previous action (v5 default)."""


@dataclass
class NetworkConfig:
    hidden_sizes: list[int] = field(default_factory=lambda: [128, 128])
    """Hidden layer widths of MLP trunks (vector observations)."""
    dueling: bool = True
    """DQN: separate value and advantage heads (Wang et al. 2016)."""


@dataclass
class DQNConfig:
    gamma: float = 0.99
    """Discount per environment step."""
    n_step: int = 3
    """Return horizon computed by actors (Ape-X: 3)."""
    double: bool = True
    """Double DQN: the online network picks the bootstrap action, the target net scores it."""
    clipped_double: bool = False
    """With double: bootstrap from the lower of the target and online nets' values of the
    chosen action (clipped double Q, Fujimoto et al. 2018), against over-estimation. Not in
    the CartPole config: it learnt faster but diverged no less (docs/experiments/2026-12-tuning-diary.md, "The low
    endings that are left")."""
    bootstrap_max: float | None = None
    """Cap on the bootstrap value Q(s', a*) in the learner's targets: a bound no return can
    exceed, r_max / (1 - gamma) for rewards at most r_max (CartPole, rewards 1 at gamma
    0.995: 200). null = no cap. Not in the CartPole config: it removed the over-estimation
    there but not the low endings that came with it (docs/experiments/2026-12-tuning-diary.md, "The low endings that
    are left")."""
    huber_delta: float = 1.0
    """Huber loss threshold on the TD error."""
    target_update_period: int = 250
    """Copy online -> target every this many parameter versions (ignored when tau > 0)."""
    tau: float = 0.0
    """Polyak factor for a soft target update every version; 0 = periodic hard copy."""


@dataclass
class TD3Config:
    gamma: float = 0.99
    """Discount per environment step."""
    n_step: int = 1
    """Return horizon computed by actors."""
    tau: float = 0.005
    """Polyak factor of the target networks (Fujimoto et al. 2018)."""
    policy_delay: int = 2
    """Actor and targets are updated every this many critic updates."""
    target_noise: float = 0.2
    """Std of the target policy smoothing noise, in units of the action half-range."""
    target_noise_clip: float = 0.5
    """Clip of the target smoothing noise, in units of the action half-range."""
    exploration_noise: float = 0.1
    """Std of the actors' Gaussian exploration noise, in units of the action half-range."""
    random_steps: int = 1000
    """Each actor acts uniformly at random for its first this-many env steps."""
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    """Hidden layer widths of the actor and of each critic (network.hidden_sizes is DQN's)."""


@dataclass
class ReplayConfig:
    capacity: int = 100_000
    """Transitions kept; beyond it the oldest are evicted (FIFO)."""
    alpha: float = 0.6
    """Priority exponent: P(i) = p_i^alpha / sum_j p_j^alpha (Schaul et al. 2016)."""
    priority_epsilon: float = 1e-6
    """Added to |TD error|: p_i = |delta_i| + epsilon, so no transition becomes unsampleable."""
    max_priority: float = 1.0e6
    """Largest priority replay accepts, from actors' inserts and learners' updates
    (|delta| + epsilon); a larger one is refused with INVALID_ARGUMENT, because one huge
    priority would make nearly every draw sample its transition."""
    max_abs_reward: float = 1.0e6
    """Largest |reward| (an n-step return) a transition may carry; larger ones are refused
    with INVALID_ARGUMENT (finite but absurd rewards would swamp the learner's targets)."""
    beta_start: float = 0.4
    """Importance-sampling exponent at the start of training."""
    beta_end: float = 1.0
    """Importance-sampling exponent reached after beta_anneal_updates."""
    beta_anneal_updates: int = 100_000
    """Learner updates over which beta goes linearly from beta_start to beta_end."""
    is_weight_normalization: Literal["table", "batch"] = "table"
    """What the importance weights w_i = (N * P(i))^-beta are divided by: ``table``, the
    largest weight any stored transition could get (Schaul et al. 2016; all weights <= 1,
    and far below 1 when some priority is near ``priority_epsilon``); ``batch``, the largest
    in each training batch (Dopamine, Rainbow), so the batch's largest weight is 1. The
    table's sampled weights scale the whole gradient down, by 4-25x in a Pong run; with an
    Adam epsilon that is not small next to the gradient's root mean square (Ape-X/Rainbow's
    1.5e-4) that lowers the effective learning rate by as much, so the Atari configs use
    ``batch``."""
    min_size_to_sample: int = 1000
    """Sampling waits until the table holds this many transitions."""
    samples_per_insert: float = 0.0
    """Target sampled / inserted ratio (Reverb-style rate limiter); 0 disables it."""
    samples_per_insert_error_buffer: float = 0.0
    """Allowed deviation from the ratio, in samples; 0 = max(1, min_size * ratio)."""
    redis_url: str = ""
    """External Redis ("redis://:password@host:6379/0"); empty = the launcher's embedded one."""
    cache_max_bytes: int = 2 * 1024**3
    """Bound on the in-memory copy of stored frames kept in front of Redis."""
    compression: Literal["auto", "none", "lz4"] = "auto"
    """Frame compression in Redis: auto = lz4 for image frames, none for vectors."""
    port: int = 0
    """Listen port; 0 = any free port (the launcher passes one)."""
    durability: Literal["everysec", "always"] = "everysec"
    """What an acknowledged insert survives. ``everysec``: Redis appends each write to its
    AOF and fsyncs once a second, so a killed replay or Redis process loses nothing
    acknowledged (the kernel holds the file) and a machine crash up to the last second of
    inserts (counted as missing when replay reopens). ``always``: Redis fsyncs each write
    before it replies, so not even a machine crash loses an acknowledged insert, at the
    cost of an fsync per insert. Replay sets Redis's ``appendfsync`` to match."""
    max_insert_streams: int = 1024
    """Insert streams one replay shard serves at once (one per actor sending, each a few
    KiB of memory and no thread); a stream beyond it is refused with RESOURCE_EXHAUSTED and
    its actor backs off and retries. Raise it, or add shards, for a larger fleet."""
    max_pending_insert_bytes: int = 256 * 1024**2
    """Frame bytes of received chunks not yet stored (groups waiting on the rate limiter)
    one shard holds at most; beyond it streams read no further chunk until stored ones make
    room, and HTTP/2 flow control holds their actors back. Bounds what a fleet waiting on
    the limiter costs in memory, whatever its size."""
    insert_idle_timeout_s: float = 30.0
    """An Insert stream that sends no chunk for this long is ended with DEADLINE_EXCEEDED
    (what it sent before is stored), so a stuck client cannot hold a stream slot."""
    keepalive_s: float = 20.0
    """Replay pings every connection this often and closes one whose peer does not answer
    within half of it, ending the calls of an actor that died without closing them."""


@dataclass
class LearnerConfig:
    batch_size: int = 128
    """Transitions per update."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype of the forward pass; fp16 adds a GradScaler (init 65536, x2 every 2000)."""
    device: str = "auto"
    """"auto" = CUDA when present, else CPU; or an explicit torch device string."""
    grad_clip_norm: float = 10.0
    """Global L2 gradient-norm clip; the pre-clip norm is recorded."""
    prefetch_batches: int = 4
    """Sampled batches kept ready in the background."""
    max_pushes_in_flight: int = 2
    """Push window: gradient pushes awaiting the parameter server's reply at once. 0 = auto,
    max(1, paramserver.max_staleness // 2): a push in flight costs up to ~2 versions of
    staleness (its own trip plus the pull that follows), so this is the widest window the
    staleness rule accepts; see ``amprl.learner.learner``."""
    max_batches_per_push: int = 1
    """While the push window is full, the gradients of up to this many batches are averaged
    into the next push instead of waiting for a free slot (1 = wait). Hides round trips:
    at 300 ms RTT the learner keeps training at its own rate and each push (one optimizer
    step on the server) carries a larger effective batch."""
    push_timeout_s: float = 10.0
    """Deadline of one push, including waiting for a lost connection to come back; a push
    past it is dropped (never resent) and frees its window slot."""
    sync: Literal["overlapped", "synchronous", "local_replica"] = "overlapped"
    """How the learner's weights follow the parameter server (see ``amprl.learner.learner``):
    ``overlapped``: new weights are pulled in the background (or come in a push's reply)
    while updates go on, so gradients are a few versions stale; ``synchronous``: each update
    waits for its push's reply and loads the weights it made (staleness 0, one round trip
    per update: for small models on a fast link); ``local_replica``: each push is also
    applied to the learner's own replica with the server's optimizer rule and the replica
    re-bases onto the server's weights every ``pull_lag_versions`` pushes (staleness 0 for
    one learner at any round trip, with the overlap of ``overlapped``)."""
    pull_lag_versions: int = 1
    """``overlapped``: pull new weights once the server is this many versions ahead of the
    learner's replica (1 = after every push; larger values trade staleness for fewer weight
    transfers). ``local_replica``: re-base onto the server's weights every this many pushes.
    Not used by ``synchronous``."""
    sample_batches_per_call: int = 1
    """Batches drawn per Sample RPC (split on the learner; amortises the call's cost)."""
    priority_flush_s: float = 0.02
    """New priorities are sent to replay at most this often, all batches' since the last
    send in one UpdatePriorities call (amortises the call's cost; 0 = send as they come)."""
    grad_encoding: Literal["fp32", "bf16", "fp16", "onebit"] = "fp32"
    """Encoding of pushed gradients."""
    onebit_block_size: int = 2048
    """Elements per scale block of the 1-bit encoding."""
    onebit_min_elements: int = 64
    """Tensors smaller than this (biases) are sent dense (fp32), where 1 bit saves ~nothing."""
    steps_per_push: int = 1
    """With ``sync: local_replica``: consecutive optimizer steps sent in one PushGradients call
    (``more_steps``), each still its own Adam step and version on the server, applied in
    order. Shares the call's fixed cost (gRPC and request handling on both sides, ~1 ms of
    CPU per call for the CartPole network) among the steps; the server's weights trail the
    learner's replica by up to this many - 1 steps (actors and the evaluator see them that
    much later). Steps not yet sent go out when the prefetch queue runs dry or the learner
    stops. 1 = a call per step."""
    onebit_precondition: bool = True
    """With ``grad_encoding: onebit``: the learner divides each 1-bit tensor by the root of its
    own Adam second moment (beta2 0.999, eps = ``paramserver.adam_eps``) before error
    feedback, and the parameter server steps it with momentum and lr only (see
    amprl.compression.ErrorFeedback). false: plain 1-bit gradients into the server's Adam,
    which learns CartPole worse (1 of 3 seeds solved vs 3 of 3)."""
    torch_threads: int = 1
    """torch.set_num_threads for the learner process."""
    pin_update_thread: bool = False
    """Gives the update thread a CPU of its own: the thread that runs the updates is pinned
    to the lowest-numbered CPU the process may use (``os.sched_getaffinity``; in a
    Kubernetes pod with dedicated cores, the first of its cpuset) and every other thread of
    the learner process (prefetch, priorities, pushes, gRPC; re-checked every 0.5 s for new
    ones) to the others. For a learner with at least 2 dedicated cores, or on a host where
    ``taskset`` keeps the other processes off that CPU: on a shared pair of cores, at equal
    priority, the update thread otherwise spends ~1 ms of a ~6 ms MLP update runnable but
    waiting for a core that a service process or a helper thread took (docs/experiments/2026-12-tuning-diary.md;
    ``run.nice``'s default priorities bring that to ~0.13 ms without pinning). Needs 2 or
    more allowed CPUs."""
    overlap_targets: bool = False
    """DQN: compute the bootstrap targets (the target and online nets over s') on a second
    thread while the update thread runs the online net over s, then join them for the loss.
    Uses a second core where the update is large next to a thread hand-off (the Nature CNN
    on CPU: 99 -> 87 ms per update at batch 64 on a busy 2-core machine); for small MLPs
    the hand-off costs more than it saves (5.3 -> 6.0 ms), so off by default."""
    port: int = 0
    """Status (Info) port; 0 = any."""


@dataclass
class ParamServerConfig:
    optimizer: Literal["adam"] = "adam"
    """Optimizer owned by the server."""
    lr: float = 1e-3
    """Adam learning rate."""
    adam_eps: float = 1e-8
    """Adam epsilon (Ape-X uses 1.5e-4 with a smaller lr on Atari)."""
    lr_final: float = -1.0
    """With ``lr_decay_versions`` > 0: the lr falls linearly from ``lr`` to this over the first
    ``lr_decay_versions`` parameter versions, then stays (SB3's linear schedule, by optimizer
    steps). Negative = no schedule (constant ``lr``)."""
    lr_decay_versions: int = 0
    """Versions (optimizer steps) over which the lr decays to ``lr_final``; 0 = constant lr."""
    max_staleness: int = 16
    """Gradients older than this many versions are rejected with FAILED_PRECONDITION."""
    staleness_scaling: bool = False
    """Scale an accepted stale gradient by 1 / (1 + staleness)."""
    checkpoint_interval_s: float = 30.0
    """Seconds between checkpoints (also one at shutdown); 0 disables them. A server killed
    without warning loses at most this much training (or ``checkpoint_interval_versions``
    steps, whichever comes first)."""
    checkpoint_interval_versions: int = 0
    """Also checkpoint once this many versions were applied since the last checkpoint;
    0 = by seconds only."""
    checkpoint_dir: str = ""
    """Where checkpoints go; empty = <run_dir>/checkpoints."""
    checkpoints_kept: int = 2
    """Newest checkpoints kept on disk."""
    port: int = 0
    """Listen port; 0 = any."""


@dataclass
class ActorConfig:
    num_actors: int = 2
    """Actor processes `amprl run` starts."""
    envs_per_actor: int = 4
    """Environments each actor steps as one batch."""
    epsilon_base: float = 0.4
    """Ape-X: eps_i = epsilon_base ** (1 + epsilon_alpha * u_i), u_i from a hash of the actor id."""
    epsilon_alpha: float = 7.0
    """Ape-X exponent range (Horgan et al. 2018: 0.4 and 7). u comes from "<actor id>/<env index>"."""
    epsilon_warmup_steps: int = 0
    """Each actor's ε starts at 1 and falls linearly to its Ape-X value over this many of its env steps."""
    chunk_transitions: int = 64
    """Transitions per chunk sent to replay."""
    max_unacked_transitions: int = 512
    """Transitions built but not yet acknowledged by replay (queued for the sender or in an
    Insert call) at most; beyond it the env loop waits. This is how replay's rate limiter
    holds actors back, and it bounds the policy lag of the data: what replay receives is at
    most this many of the actor's env steps old. A deep pipeline here (3,000 transitions
    per actor) kept CartPole DQN from settling: the learner trained on data from a policy
    ~20 s older than its own."""
    weight_refresh_steps: int = 400
    """Env steps between weight pulls (a watch notification also triggers one)."""
    torch_threads: int = 1
    """torch threads per actor process."""


@dataclass
class EvaluatorConfig:
    interval_s: float = 5.0
    """Seconds between evaluations (each starts when new weights exist)."""
    episodes: int = 10
    """Greedy episodes per evaluation."""
    epsilon: float = 0.0
    """Exploration during evaluation (Atari convention: 0.001-0.05)."""
    port: int = 0
    """Status (Info) port; 0 = any."""


@dataclass
class NiceConfig:
    """CPU priority of each process that ``amprl run`` (and ``bench/learner.py``) starts on
    this machine, in nice steps below the launcher's own (0 = the same, 19 = the lowest).
    Each service runs in a session of its own, so where the kernel groups sessions
    (``autogroup``, on by default in most distributions) the value is set on the session's
    group -- a plain per-process nice would then only rank threads inside one service --
    and on every thread of the process.

    Why the learner comes first: its update thread is the only latency-critical thread of
    the system. The others serve it through queues (prefetch, pushes in flight, priorities
    sent in the background) or are paced by the rate limiter, so a few milliseconds' wait
    costs them nothing, while every millisecond the update thread waits for a core is a
    millisecond of lost updates. On 2 shared cores, equal priorities had the update thread
    wait ~0.4-0.5 ms per MLP update for a core a service held; with the services at nice
    19, ~0.13 ms (nice 10: ~0.24 ms; docs/experiments/2026-12-tuning-diary.md, "Who gets the core first"). Lower than
    0 needs CAP_SYS_NICE, so the others are raised instead. Ignored on Kubernetes, where
    each pod's CPU requests and limits rank them."""

    learner: int = 0
    replay: int = 19
    paramserver: int = 19
    redis: int = 19
    """The embedded Redis only (``replay.redis_url`` unset)."""
    actor: int = 19
    evaluator: int = 19

    def of(self, service: str) -> int:
        """The value for a service by its process name ("replay", "actor-3", ...)."""
        return getattr(self, service.split("-")[0])


@dataclass
class RunConfig:
    seed: int = 0
    """Run seed; every actor and env derives its seed from it and the actor id."""
    total_env_steps: int = 100_000
    """Step budget of the whole actor fleet."""
    target_return: float = 475.0
    """Eval mean return that counts as solved."""
    stop_at_target: bool = True
    """Stop the run when the eval return first reaches target_return."""
    max_wall_seconds: float = 0.0
    """Stop after this many seconds; 0 = no limit."""
    run_dir: str = "runs"
    """Parent folder of the run folders."""
    nice: NiceConfig = field(default_factory=NiceConfig)
    """CPU priority of each local process (NiceConfig)."""


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    """Name of the experiment (used in the run folder name)."""
    algo: Literal["dqn", "td3"] = "dqn"
    """Algorithm family."""
    env: EnvConfig = field(default_factory=EnvConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    dqn: DQNConfig = field(default_factory=DQNConfig)
    td3: TD3Config = field(default_factory=TD3Config)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    paramserver: ParamServerConfig = field(default_factory=ParamServerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def n_step(self) -> int:
        return self.dqn.n_step if self.algo == "dqn" else self.td3.n_step

    @property
    def gamma(self) -> float:
        return self.dqn.gamma if self.algo == "dqn" else self.td3.gamma


# Range checks: dotted key -> (predicate, reason).
_CHECKS: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "env.frame_stack": (lambda v: v >= 1, "must be >= 1"),
    "replay.capacity": (lambda v: v >= 1, "must be a positive integer"),
    "replay.alpha": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "replay.priority_epsilon": (lambda v: v > 0, "must be > 0"),
    "replay.beta_start": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "replay.beta_end": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "replay.min_size_to_sample": (lambda v: v >= 1, "must be >= 1"),
    "replay.samples_per_insert": (lambda v: v >= 0, "must be >= 0"),
    "replay.cache_max_bytes": (lambda v: v >= 0, "must be >= 0"),
    "replay.max_insert_streams": (lambda v: v >= 1, "must be >= 1"),
    "replay.max_pending_insert_bytes": (lambda v: v >= 1, "must be >= 1"),
    "replay.insert_idle_timeout_s": (lambda v: v > 0, "must be > 0"),
    "replay.keepalive_s": (lambda v: v >= 1, "must be >= 1 (the server refuses pings from its "
                                              "peers more often than every 10 s, and its own "
                                              "should not be much more frequent)"),
    "learner.batch_size": (lambda v: v >= 1, "must be >= 1"),
    "learner.grad_clip_norm": (lambda v: v > 0, "must be > 0"),
    "learner.prefetch_batches": (lambda v: v >= 1, "must be >= 1"),
    "learner.max_pushes_in_flight": (lambda v: 0 <= v <= 256, "must be in [0, 256] (0 = auto)"),
    "learner.max_batches_per_push": (lambda v: v >= 1, "must be >= 1"),
    "learner.push_timeout_s": (lambda v: v > 0, "must be > 0"),
    "learner.pull_lag_versions": (lambda v: v >= 1, "must be >= 1 (the synchronous mode is learner.sync: synchronous)"),
    "learner.sample_batches_per_call": (lambda v: v >= 1, "must be >= 1"),
    "learner.steps_per_push": (lambda v: 1 <= v <= 64, "must be in [1, 64]"),
    "learner.priority_flush_s": (lambda v: 0 <= v <= 5, "must be in [0, 5] seconds"),
    "learner.onebit_block_size": (lambda v: v >= 1, "must be >= 1"),
    "replay.max_priority": (lambda v: v > 0, "must be > 0"),
    "replay.max_abs_reward": (lambda v: v > 0, "must be > 0"),
    "paramserver.lr": (lambda v: v > 0, "must be > 0"),
    "paramserver.lr_final": (lambda v: v < 0 or v > 0, "must be > 0 (or negative: no schedule)"),
    "paramserver.lr_decay_versions": (lambda v: v >= 0, "must be >= 0 (0 = constant lr)"),
    "paramserver.max_staleness": (lambda v: v >= 0, "must be >= 0"),
    "paramserver.checkpoint_interval_versions": (lambda v: v >= 0, "must be >= 0 (0 = by seconds only)"),
    "actor.num_actors": (lambda v: v >= 0, "must be >= 0"),
    "actor.envs_per_actor": (lambda v: v >= 1, "must be >= 1"),
    "actor.epsilon_base": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "actor.chunk_transitions": (lambda v: v >= 1, "must be >= 1"),
    "actor.max_unacked_transitions": (lambda v: v >= 1, "must be >= 1"),
    "actor.epsilon_warmup_steps": (lambda v: v >= 0, "must be >= 0"),
    "dqn.gamma": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "dqn.n_step": (lambda v: v >= 1, "must be >= 1"),
    "dqn.tau": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "dqn.target_update_period": (lambda v: v >= 1, "must be >= 1"),
    "td3.gamma": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "td3.n_step": (lambda v: v >= 1, "must be >= 1"),
    "td3.tau": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "td3.policy_delay": (lambda v: v >= 1, "must be >= 1"),
    "td3.hidden_sizes": (lambda v: len(v) >= 1 and all(h >= 1 for h in v),
                         "must be a non-empty list of positive widths"),
    "network.hidden_sizes": (lambda v: all(h >= 1 for h in v), "widths must be >= 1"),
    "td3.target_noise": (lambda v: v >= 0, "must be >= 0"),
    "td3.target_noise_clip": (lambda v: v >= 0, "must be >= 0"),
    "td3.exploration_noise": (lambda v: v >= 0, "must be >= 0"),
    "dqn.huber_delta": (lambda v: v > 0, "must be > 0"),
    "evaluator.episodes": (lambda v: v >= 1, "must be >= 1"),
    "evaluator.interval_s": (lambda v: v > 0, "must be > 0"),
    "run.total_env_steps": (lambda v: v >= 1, "must be >= 1"),
}


# YAML 1.1 (PyYAML) reads 1e-6, 1E6 and 1.0e6 as strings: a float needs a dot and a signed
# exponent (1.0e-6). Numbers written the way Python and every other tool write them are
# taken as numbers where the key wants one.
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp in (int, float) and isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        value = float(value)
    if origin in (types.UnionType, typing.Union):  # only `X | None`: null, or an X
        (inner,) = [t for t in typing.get_args(tp) if t is not type(None)]
        return None if value is None else _coerce(value, inner, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


RENAMED = {
    "learner.apply_locally": "replaced by learner.sync (apply_locally: true is "
                             "sync: local_replica)",
}
"""Keys of earlier versions, with what replaced them (named in the error, not accepted)."""


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    for key in unknown:
        if prefix + key in RENAMED:
            raise ConfigError(f"{prefix}{key}: {RENAMED[prefix + key]}")
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Applies ``key.sub=value`` strings (values parsed as YAML scalars) onto ``data``."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, text = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
        node[parts[-1]] = _parse_scalar(text)
    return data


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    for key, (ok, reason) in _CHECKS.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not ok(value):
            raise ConfigError(f"{key}: {value!r} {reason}")
    for name, value in dataclasses.asdict(cfg.run.nice).items():
        if not 0 <= value <= 19:
            raise ConfigError(f"run.nice.{name}: {value!r} must be in [0, 19] (nice below the "
                              f"launcher's own needs CAP_SYS_NICE: raise the others instead)")
    if cfg.replay.min_size_to_sample > cfg.replay.capacity:
        raise ConfigError(f"replay.min_size_to_sample: {cfg.replay.min_size_to_sample} exceeds "
                          f"replay.capacity ({cfg.replay.capacity})")
    if cfg.learner.batch_size > cfg.replay.capacity:
        raise ConfigError(f"learner.batch_size: {cfg.learner.batch_size} exceeds replay.capacity")
    if cfg.learner.steps_per_push > 1 and cfg.learner.sync != "local_replica":
        raise ConfigError(f"learner.steps_per_push: {cfg.learner.steps_per_push} needs "
                          f"learner.sync: local_replica (step i of a push is computed on the "
                          f"weights the steps before it make, which only a learner that "
                          f"applies its own steps has)")
    if cfg.learner.overlap_targets and cfg.algo != "dqn":
        raise ConfigError(f"learner.overlap_targets: DQN only (algo is {cfg.algo!r}; TD3's "
                          f"update runs on one thread)")
    if cfg.dqn.clipped_double and not cfg.dqn.double:
        raise ConfigError("dqn.clipped_double: needs dqn.double: true (it clips the target "
                          "net's value of the online net's chosen action)")
    return cfg


def config_from_dict(data: dict) -> ExperimentConfig:
    if not isinstance(data, dict):
        raise ConfigError("config: the top level must be a mapping")
    return validate(_build(ExperimentConfig, data))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Reads a YAML experiment file (or the defaults), applies overrides, validates."""
    data: dict = {}
    if path is not None:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    data = apply_overrides(data, list(overrides or []))
    return config_from_dict(data)


def config_to_dict(cfg: ExperimentConfig) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: ExperimentConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
