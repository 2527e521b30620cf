"""The sections of the experiment config: one YAML file maps onto these dataclasses.

Each field declares its type, default, range (``Annotated[..., Bound(...)]``) and, in the
string below it, what it does. The loader (``loading.py``) checks values against these
declarations, and the chart's JSON schema for ``experiment`` is generated from them
(``schema.py``), so a knob is declared once. Each algorithm declares its own section
(``dqn:``, ``td3:``) beside its code, in ``amprl/algos/<name>/config.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from amprl.algos.dqn.config import DQNConfig
from amprl.algos.td3.config import TD3Config
from amprl.config.bounds import Bound

Nice = Annotated[int, Bound(ge=0, le=19, note="nice below the launcher's own needs CAP_SYS_NICE: "
                                               "raise the others instead")]


@dataclass
class EnvConfig:
    id: str = "CartPole-v1"
    """Gymnasium id: classic control ("CartPole-v1"), Atari ("ALE/Pong-v5"), MuJoCo
    ("HalfCheetah-v5"), or your own: one a module of ``import`` registers, or
    "module:EnvId" (gymnasium's notation: that module is imported first)."""
    # the YAML key is ``import`` (a Python keyword: config.loading.yaml_key)
    import_: list[str] = field(default_factory=list)
    """Modules every process imports before it looks ``id`` up, e.g. ["mypkg.envs"], whose
    import registers your environments (``gymnasium.register``). Each must be importable
    by every service: installed, or on PYTHONPATH (on Kubernetes: in the image)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment, passed to ``gymnasium.make`` in every process,
    e.g. {continuous: true} for LunarLander-v3."""
    frame_stack: Annotated[int, Bound(ge=1)] = 1
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
    hidden_sizes: Annotated[list[int], Bound(ge=1)] = field(default_factory=lambda: [128, 128])
    """Hidden layer widths of MLP trunks (vector observations)."""
    dueling: bool = True
    """DQN: separate value and advantage heads (Wang et al. 2016)."""


@dataclass
class ReplayConfig:
    capacity: Annotated[int, Bound(ge=1)] = 100_000
    """Transitions kept; beyond it the oldest are evicted (FIFO)."""
    alpha: Annotated[float, Bound(ge=0, le=1)] = 0.6
    """Priority exponent: P(i) = p_i^alpha / sum_j p_j^alpha (Schaul et al. 2016)."""
    priority_epsilon: Annotated[float, Bound(gt=0)] = 1e-6
    """Added to |TD error|: p_i = |delta_i| + epsilon, so no transition becomes unsampleable."""
    max_priority: Annotated[float, Bound(gt=0)] = 1.0e6
    """Largest priority replay accepts, from actors' inserts and learners' updates
    (|delta| + epsilon); a larger one is refused with INVALID_ARGUMENT, because one huge
    priority would make nearly every draw sample its transition."""
    max_abs_reward: Annotated[float, Bound(gt=0)] = 1.0e6
    """Largest |reward| (an n-step return) a transition may carry; larger ones are refused
    with INVALID_ARGUMENT (finite but absurd rewards would swamp the learner's targets)."""
    beta_start: Annotated[float, Bound(ge=0, le=1)] = 0.4
    """Importance-sampling exponent at the start of training."""
    beta_end: Annotated[float, Bound(ge=0, le=1)] = 1.0
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
    min_size_to_sample: Annotated[int, Bound(ge=1)] = 1000
    """Sampling waits until the table holds this many transitions."""
    samples_per_insert: Annotated[float, Bound(ge=0)] = 0.0
    """Target sampled / inserted ratio (Reverb-style rate limiter); 0 disables it."""
    samples_per_insert_error_buffer: float = 0.0
    """Allowed deviation from the ratio, in samples; 0 = max(1, min_size * ratio)."""
    redis_url: str = ""
    """External Redis ("redis://user:password@host:6379/0", rediss:// for TLS); empty = the
    launcher's embedded one."""
    cache_max_bytes: Annotated[int, Bound(ge=0)] = 2 * 1024**3
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
    cost of an fsync per insert. Redis's ``appendfsync`` matches it: ``amprl run`` and the
    chart write it into Redis's own configuration (replay's ACL user may not send CONFIG);
    replay connected with every right sets it itself."""
    max_insert_streams: Annotated[int, Bound(ge=1)] = 1024
    """Insert streams one replay shard serves at once (one per actor sending, each a few
    KiB of memory and no thread); a stream beyond it is refused with RESOURCE_EXHAUSTED and
    its actor backs off and retries. Raise it, or add shards, for a larger fleet."""
    max_pending_insert_bytes: Annotated[int, Bound(ge=1)] = 256 * 1024**2
    """Frame bytes of received chunks not yet stored (groups waiting on the rate limiter)
    one shard holds at most; beyond it streams read no further chunk until stored ones make
    room, and HTTP/2 flow control holds their actors back. Bounds what a fleet waiting on
    the limiter costs in memory, whatever its size."""
    insert_idle_timeout_s: Annotated[float, Bound(gt=0)] = 30.0
    """An Insert stream that sends no chunk for this long is ended with DEADLINE_EXCEEDED
    (what it sent before is stored), so a stuck client cannot hold a stream slot."""
    keepalive_s: Annotated[float, Bound(ge=1, note="the server refuses pings from its peers more often than every 10 s, "
                                                 "and its own should not be much more frequent")] = 20.0
    """Replay pings every connection this often and closes one whose peer does not answer
    within half of it, ending the calls of an actor that died without closing them."""


@dataclass
class LearnerConfig:
    batch_size: Annotated[int, Bound(ge=1)] = 128
    """Transitions per update."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype of the forward pass; fp16 adds a GradScaler (init 65536, x2 every 2000)."""
    device: str = "auto"
    """"auto" = CUDA when present, else CPU; or an explicit torch device string."""
    grad_clip_norm: Annotated[float, Bound(gt=0)] = 10.0
    """Global L2 gradient-norm clip; the pre-clip norm is recorded."""
    prefetch_batches: Annotated[int, Bound(ge=1)] = 4
    """Sampled batches kept ready in the background."""
    max_pushes_in_flight: Annotated[int, Bound(ge=0, le=256, note="0 = auto")] = 2
    """Push window: gradient pushes awaiting the parameter server's reply at once. 0 = auto,
    max(1, paramserver.max_staleness // 2): a push in flight costs up to ~2 versions of
    staleness (its own trip plus the pull that follows), so this is the widest window the
    staleness rule accepts; see ``amprl.learner.learner``."""
    max_batches_per_push: Annotated[int, Bound(ge=1)] = 1
    """While the push window is full, the gradients of up to this many batches are averaged
    into the next push instead of waiting for a free slot (1 = wait). Hides round trips:
    at 300 ms RTT the learner keeps training at its own rate and each push (one optimizer
    step on the server) carries a larger effective batch."""
    push_timeout_s: Annotated[float, Bound(gt=0)] = 10.0
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
    pull_lag_versions: Annotated[int, Bound(ge=1, note="the synchronous mode is learner.sync: synchronous")] = 1
    """``overlapped``: pull new weights once the server is this many versions ahead of the
    learner's replica (1 = after every push; larger values trade staleness for fewer weight
    transfers). ``local_replica``: re-base onto the server's weights every this many pushes.
    Not used by ``synchronous``."""
    sample_batches_per_call: Annotated[int, Bound(ge=1)] = 1
    """Batches drawn per Sample RPC (split on the learner; amortises the call's cost)."""
    priority_flush_s: Annotated[float, Bound(ge=0, le=5, note="seconds")] = 0.02
    """New priorities are sent to replay at most this often, all batches' since the last
    send in one UpdatePriorities call (amortises the call's cost; 0 = send as they come)."""
    grad_encoding: Literal["fp32", "bf16", "fp16", "onebit"] = "fp32"
    """Encoding of pushed gradients."""
    onebit_block_size: Annotated[int, Bound(ge=1)] = 2048
    """Elements per scale block of the 1-bit encoding."""
    onebit_min_elements: int = 64
    """Tensors smaller than this (biases) are sent dense (fp32), where 1 bit saves ~nothing."""
    steps_per_push: Annotated[int, Bound(ge=1, le=64)] = 1
    """With ``sync: local_replica``: consecutive optimizer steps sent in one PushGradients call
    (``more_steps``), each still its own Adam step and version on the server, applied in
    order. Shares the call's fixed cost (gRPC and request handling on both sides) among
    the steps; the server's weights trail the learner's replica by up to this many - 1
    steps (actors and the evaluator see them that much later). Steps not yet sent go out when the prefetch queue runs dry or the learner
    stops. 1 = a call per step."""
    overlap_targets: bool = False
    """DQN: compute the bootstrap targets (the target and online nets over s') on a second
    thread while the update thread runs the online net over s, then join them for the loss.
    Uses a second core where the update is large next to a thread hand-off (the Nature CNN
    on CPU); for small MLPs the hand-off costs more than it saves, so off by default
    (measured in docs/experiments/2026-12-06-docstring-timings.md)."""
    port: int = 0
    """Status (Info) port; 0 = any."""


@dataclass
class ParamServerConfig:
    lr: Annotated[float, Bound(gt=0)] = 1e-3
    """Adam learning rate."""
    adam_eps: float = 1e-8
    """Adam epsilon (Ape-X uses 1.5e-4 with a smaller lr on Atari)."""
    lr_final: float = -1.0
    """With ``lr_decay_versions`` > 0: the lr falls linearly from ``lr`` to this over the first
    ``lr_decay_versions`` parameter versions, then stays (SB3's linear schedule, by optimizer
    steps). Negative = no schedule (constant ``lr``)."""
    lr_decay_versions: Annotated[int, Bound(ge=0, note="0 = constant lr")] = 0
    """Versions (optimizer steps) over which the lr decays to ``lr_final``; 0 = constant lr."""
    max_staleness: Annotated[int, Bound(ge=0)] = 16
    """Gradients older than this many versions are rejected with FAILED_PRECONDITION."""
    staleness_scaling: bool = False
    """Scale an accepted stale gradient by 1 / (1 + staleness)."""
    max_push_norm: Annotated[float, Bound(gt=0)] = 1.0e6
    """Largest global L2 gradient norm of one optimizer step, from the first push on; a
    push with a step above it is refused with INVALID_ARGUMENT and changes nothing. Far
    above any real step: a learner clips to ``learner.grad_clip_norm``, and a 1-bit step's
    norm is about sqrt(parameters) (~1.3e3 for the Nature CNN). Rule and reasons:
    ``amprl.paramserver.admission.PushNormBound``."""
    max_push_norm_ratio: Annotated[float, Bound(gt=1)] = 100.0
    """Once ``push_norm_window`` steps are accepted, a step is also refused above this
    many times the median norm of the last ``push_norm_window`` accepted steps (never below
    ``push_norm_floor``). Real gradient norms drift 10x over a run: leave it generous."""
    push_norm_window: Annotated[int, Bound(ge=1)] = 100
    """Accepted steps whose median norm sets the relative bound (it follows a trend within
    half of this many steps); until that many are accepted only ``max_push_norm`` applies."""
    push_norm_floor: Annotated[float, Bound(ge=0)] = 10.0
    """The relative bound never falls below this, so a step this small is never refused
    by ratio (a sparse reward's first gradient can be 1000x the near-zero median before
    it). The default is ``learner.grad_clip_norm``'s: set it to yours."""
    checkpoint_interval_s: float = 30.0
    """Seconds between checkpoints (also one at shutdown); 0 disables them. A server killed
    without warning loses at most this much training (or ``checkpoint_interval_versions``
    steps, whichever comes first)."""
    checkpoint_interval_versions: Annotated[int, Bound(ge=0, note="0 = by seconds only")] = 0
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
    num_actors: Annotated[int, Bound(ge=0)] = 2
    """Actor processes `amprl run` starts."""
    envs_per_actor: Annotated[int, Bound(ge=1)] = 4
    """Environments each actor steps as one batch."""
    epsilon_base: Annotated[float, Bound(ge=0, le=1)] = 0.4
    """Ape-X: eps_i = epsilon_base ** (1 + epsilon_alpha * u_i), u_i from a hash of the actor id."""
    epsilon_alpha: float = 7.0
    """Ape-X exponent range (Horgan et al. 2018: 0.4 and 7). u comes from "<actor id>/<env index>"."""
    epsilon_warmup_steps: Annotated[int, Bound(ge=0)] = 0
    """Each actor's ε starts at 1 and falls linearly to its Ape-X value over this many of its env steps."""
    chunk_transitions: Annotated[int, Bound(ge=1)] = 64
    """Transitions per chunk sent to replay."""
    max_unacked_transitions: Annotated[int, Bound(ge=1)] = 512
    """Transitions built but not yet acknowledged by replay (queued for the sender or in an
    Insert call) at most; beyond it the env loop waits. This is how replay's rate limiter
    holds actors back, and it bounds the policy lag of the data: what replay receives is at
    most this many of the actor's env steps old. A deep pipeline here (3,000 transitions
    per actor) kept CartPole DQN from settling: the learner trained on data from a policy
    ~20 s older than its own."""
    weight_refresh_steps: Annotated[int, Bound(ge=1)] = 400
    """Env steps between weight pulls."""
    weight_refresh_s: Annotated[float, Bound(gt=0)] = 10.0
    """Seconds between weight pulls at most, however few steps were taken: an actor that
    replay's rate limiter holds back steps slowly, and would otherwise act on weights that
    grow ever more updates old (and drop out of the parameter server's live actors)."""


@dataclass
class EvaluatorConfig:
    interval_s: Annotated[float, Bound(gt=0)] = 5.0
    """Seconds between evaluations (each starts when new weights exist)."""
    episodes: Annotated[int, Bound(ge=1)] = 10
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
    millisecond of lost updates (measured in docs/experiments/2026-12-tuning-diary.md, "Who
    gets the core first"). Lower than 0 needs CAP_SYS_NICE, so the others are raised
    instead. Ignored on Kubernetes, where each pod's CPU requests and limits rank them."""

    learner: Nice = 0
    replay: Nice = 19
    paramserver: Nice = 19
    redis: Nice = 19
    """The embedded Redis only (``replay.redis_url`` unset)."""
    actor: Nice = 19
    evaluator: Nice = 19

    def of(self, service: str) -> int:
        """The value for a service by its process name ("replay", "actor-3", ...)."""
        return getattr(self, service.split("-")[0])


@dataclass
class RunConfig:
    seed: int = 0
    """Run seed; every actor and env derives its seed from it and the actor id."""
    total_env_steps: Annotated[int, Bound(ge=1)] = 100_000
    """Step budget of the whole actor fleet."""
    target_return: float = 475.0
    """Eval mean return that counts as solved."""
    stop_at_target: bool = True
    """Stop the run when the eval return first reaches target_return."""
    max_wall_seconds: float = 0.0
    """Stop after this many seconds; 0 = no limit."""
    run_dir: str = "runs"
    """Parent folder of the run folders."""


@dataclass
class DeployConfig:
    """How the processes of a run use the machine they run on: scheduling, not the
    experiment. The same experiment gives the same results with any of these; they only
    change how fast it gets there on a given host."""

    nice: NiceConfig = field(default_factory=NiceConfig)
    """CPU priority of each local process (NiceConfig)."""
    learner_torch_threads: Annotated[int, Bound(ge=1)] = 1
    """torch.set_num_threads for the learner process."""
    actor_torch_threads: Annotated[int, Bound(ge=1)] = 1
    """torch threads per actor process."""
    pin_learner_update_thread: bool = False
    """Gives the learner's update thread a CPU of its own: the thread that runs the updates
    is pinned to the lowest-numbered CPU the process may use (``os.sched_getaffinity``; in
    a Kubernetes pod with dedicated cores, the first of its cpuset) and every other thread
    of the learner process (prefetch, priorities, pushes, gRPC; re-checked every 0.5 s for
    new ones) to the others. For a learner with at least 2 dedicated cores, or on a host
    where ``taskset`` keeps the other processes off that CPU: on a shared pair of cores the
    update thread otherwise waits, runnable, for a core that a service process or a helper
    thread took (docs/experiments/2026-12-tuning-diary.md). Needs 2 or more allowed CPUs."""


class AlgoConfig(Protocol):
    """What every algorithm's section has: the actors compute n-step returns with it
    (``ExperimentConfig.n_step``, ``.gamma``)."""

    gamma: float
    n_step: int


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    """Name of the experiment (used in the run folder name)."""
    # the names of amprl.algos.ALGOS, each with a section of that name below
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
    deploy: DeployConfig = field(default_factory=DeployConfig)

    @property
    def algo_config(self) -> AlgoConfig:
        """The section of ``algo``: each algorithm's section is named after it
        (``amprl.algos.ALGOS``) and has the ``gamma`` and ``n_step`` the actors use."""
        return getattr(self, self.algo)

    @property
    def n_step(self) -> int:
        return self.algo_config.n_step

    @property
    def gamma(self) -> float:
        return self.algo_config.gamma
