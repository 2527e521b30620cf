"""Actor speed next to the simulator's: env steps/s of the real actor vs a bare env loop.

    python bench/actor.py [--seconds 6] [--repeats 3] [--envs cartpole,pong,halfcheetah]
                          [--set key=value ...]   (config overrides for every env measured)

For each environment, on one CPU core (this process is pinned to one core while it measures;
replay, parameter server and Redis run as their own processes, started before pinning):
  * ``raw_env_steps_per_s_<env>``: one env in a plain loop, random actions drawn ahead of
    time, the same preprocessing the actors use (Atari: the DQN preprocessing);
  * ``actor_env_steps_per_s_<env>``: the real Actor (``amprl.actor.actor``) stepping its
    vector of envs with batched inference, exploration, n-step chunking, initial priorities
    from its own network, and inserting every chunk into a live replay service (rate
    limiter off) with weights from a live parameter server;
  * ``actor_fps_ratio_<env>`` = actor / raw (medians; the raw loop is measured before
    and after the actor, so that a change in machine load shows in both);
  * ``raw_env_steps_per_s_<env>_actor_actions``: a plain loop replaying the actions the
    actor's envs received (``ActionLog``), each env from its seed: the same trajectories,
    so the simulator's own cost in the states the actor's policy visits (a
    MuJoCo step costs more in some states than in others: HalfCheetah under an untrained
    policy's actions 3-40% more than under uniform random ones, from run to run), and
    ``actor_overhead_us_per_step_<env>``: what the actor adds per env step to the
    simulator's cost of those same states (inference, exploration, n-step building,
    priorities, sending, its threads).
Prints one JSON object (and writes it to --out if given).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import redis as redis_py
import torch

from amprl.actor.actor import Actor
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import dump_config, load_config
from amprl.envs.factory import env_spec, make_env
from amprl.launch.procs import start_service, stop_services, wait_for_port
from amprl.paramserver.client import ParameterClient
from amprl.replay.client import ReplayClient

ROOT = Path(__file__).resolve().parents[1]

# env name -> (config, overrides). CartPole's step costs ~14 us, so per-step overheads are
# amortised over many envs per actor and big chunks.
CASES = {
    "cartpole": ("configs/cartpole-dqn.yaml", ["actor.envs_per_actor=64", "actor.chunk_transitions=1024",
                                               "actor.weight_refresh_steps=20000"]),
    "pong": ("configs/pong-apex.yaml", ["actor.envs_per_actor=16", "actor.chunk_transitions=256"]),
    "halfcheetah": ("configs/halfcheetah-td3.yaml", ["actor.envs_per_actor=16", "actor.chunk_transitions=512",
                                                     "td3.random_steps=0", "actor.weight_refresh_steps=5000"]),
}
COMMON = ["replay.samples_per_insert=0", "replay.capacity=2000000", "paramserver.checkpoint_interval_s=0",
          "actor.num_actors=1", "actor.epsilon_warmup_steps=0"]


def raw_env_rate(cfg, seconds: float) -> float:
    env = make_env(cfg.env, seed=0, training=True)
    env.reset(seed=0)
    space = env.action_space
    space.seed(0)
    # Python ints for discrete actions, as the actor passes them (see Actor.run)
    actions = [space.sample() for _ in range(4096)]
    if hasattr(space, "n"):
        actions = [int(a) for a in actions]
    n, t0 = 0, time.perf_counter()
    deadline = t0 + seconds
    while True:
        for a in actions[:256]:
            _, _, terminated, truncated, _ = env.step(a)
            if terminated or truncated:
                env.reset()
        n += 256
        actions = actions[256:] + actions[:256]
        if time.perf_counter() >= deadline:
            break
    rate = n / (time.perf_counter() - t0)
    env.close()
    return rate


class ActionLog(gym.Wrapper):
    """Records what one env of the actor receives: the seed of its first reset, then each
    action, and ``None`` for each later reset, for ``replayed_env_rate``."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.seed: int | None = None
        self.events: list = []

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.seed, self.events = seed, []
        else:
            self.events.append(None)
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        self.events.append(np.array(action) if isinstance(action, np.ndarray) else action)
        return self.env.step(action)


def replayed_env_rate(cfg, logs: list[ActionLog], seconds: float) -> float:
    """Env steps/s of a plain loop replaying the actor's envs' logs, each env from its seed,
    in the actor's lockstep order (every env one step, then the next step), for up to
    ``seconds``: the envs' trajectories under the actor (resets included, as in its loop)."""
    envs = []
    for log in logs:
        envs.append(make_env(cfg.env, training=True))
        envs[-1].reset(seed=log.seed)
    t0 = time.perf_counter()
    steps = replay_lockstep(envs, logs, t0 + seconds)
    rate = steps / (time.perf_counter() - t0)
    for env in envs:
        env.close()
    return rate


def replay_lockstep(envs: list[gym.Env], logs: list[ActionLog], deadline: float) -> int:
    """Steps env i through ``logs[i]``, one step of every env per round, until a log ends
    or ``deadline`` (perf_counter) passes; returns the steps taken."""
    cursors = [0] * len(logs)
    steps = 0
    while time.perf_counter() < deadline:
        for i, (env, log) in enumerate(zip(envs, logs)):
            cursors[i] = replay_step(env, log.events, cursors[i])
            if cursors[i] < 0:
                return steps
            steps += 1
    return steps


def replay_step(env: gym.Env, events: list, cursor: int) -> int:
    """Replays ``events[cursor:]`` on ``env`` up to and including one step (and the resets
    before it); returns the cursor after that step, or -1 when the log ends first."""
    for j in range(cursor, len(events)):
        if events[j] is None:
            env.reset()
        else:
            env.step(events[j])
            return j + 1
    return -1


def actor_rates(actor: Actor, seconds: float, repeats: int, logs: list[ActionLog]) -> list[float]:
    """Env steps/s of one ``actor.run`` over ``repeats`` windows of ``seconds``, after a
    warm-up (env resets, which reload Atari ROMs, and the first inserts) and ``seconds`` of
    recording the envs' actions into ``logs``; the envs are unwrapped before measuring, so
    the windows time the actor's own loop."""
    stop = threading.Event()
    thread = threading.Thread(target=actor.run, args=(stop,), name="bench-actor-run")
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while actor.stats.transitions_sent == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0 + seconds)
        # Same length, replaced in place: the loop steps the unwrapped envs from its next step.
        actor.envs[:] = [log.env for log in logs]
        time.sleep(0.5)
        rates = []
        for _ in range(repeats):
            s0, t0 = actor.stats.env_steps, time.perf_counter()
            time.sleep(seconds)
            rates.append((actor.stats.env_steps - s0) / (time.perf_counter() - t0))
        return rates
    finally:
        stop.set()
        thread.join()


def bench_env(name: str, tmp: Path, redis_url: str, seconds: float, repeats: int, core: set[int],
              extra: list[str]) -> dict:
    path, overrides = CASES[name]
    cfg = load_config(ROOT / path, overrides + COMMON + extra)
    # Throughput with the rate limiter off: up to 4 chunks in flight, so building the next
    # chunk overlaps inserting the last (a training run's bound is the config's, kept low
    # for fresh data; a single 1,024-transition chunk over a 256 bound serialises them).
    cfg.actor.max_unacked_transitions = 4 * cfg.actor.chunk_transitions
    spec = env_spec(cfg.env)
    run_dir = tmp / name
    (run_dir / "logs").mkdir(parents=True)
    dump_config(cfg, run_dir / "config.yaml")
    common = ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir), "--host", "127.0.0.1"]
    redis_py.Redis.from_url(redis_url).flushall()  # each env's table has its own layout
    services = [start_service("replay", "amprl.replay", common + ["--redis-url", redis_url], run_dir / "logs"),
                start_service("paramserver", "amprl.paramserver", common, run_dir / "logs")]
    all_cores = os.sched_getaffinity(0)
    try:
        for s in services:
            wait_for_port(s)
        replay = ReplayClient(services[0].address)
        ps = ParameterClient(services[1].address, client_id="actor:bench")
        os.sched_setaffinity(0, core)  # the actor and its threads on one core
        actor = Actor(cfg, spec, "bench-actor", replay, ps)
        logs = actor.envs[:] = [ActionLog(env) for env in actor.envs]
        actor.start()
        raw = [raw_env_rate(cfg, seconds) for _ in range(repeats)]
        ours = actor_rates(actor, seconds, repeats, logs)
        raw += [raw_env_rate(cfg, seconds) for _ in range(repeats)]  # load may have changed
        same_states = [replayed_env_rate(cfg, logs, seconds) for _ in range(repeats)]
        actor.stop()
        sent = actor.stats.transitions_sent
        info = replay.info()
        replay.close()
    finally:
        os.sched_setaffinity(0, all_cores)
        stop_services(services)
    r, a, rs = statistics.median(raw), statistics.median(ours), statistics.median(same_states)
    return {f"raw_env_steps_per_s_{name}": round(r, 1),
            f"actor_env_steps_per_s_{name}": round(a, 1),
            f"actor_fps_ratio_{name}": round(a / r, 3),
            f"raw_env_steps_per_s_{name}_actor_actions": round(rs, 1),
            f"actor_fps_ratio_{name}_actor_actions": round(a / rs, 3),
            f"actor_overhead_us_per_step_{name}": round(1e6 / a - 1e6 / rs, 2),
            f"actor_envs_per_actor_{name}": cfg.actor.envs_per_actor,
            f"actor_transitions_inserted_{name}": int(info.size) if sent == 0 else int(sent)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--envs", default="cartpole,pong,halfcheetah")
    p.add_argument("--out", default="", help="also write the JSON here")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every env measured (after the case's own)")
    args = p.parse_args()
    torch.set_num_threads(1)
    core = {min(os.sched_getaffinity(0))}
    results: dict = {"seconds_per_measurement": args.seconds, "repeats": args.repeats,
                     "core": sorted(core), "cpus": os.cpu_count(),
                     "load_average_1min_at_start": round(os.getloadavg()[0], 2), "overrides": args.overrides}
    with tempfile.TemporaryDirectory(prefix="amprl-bench-actor-") as tmp:
        tmp = Path(tmp)
        with EmbeddedRedis(tmp / "redis") as redis:
            for name in args.envs.split(","):
                results.update(bench_env(name, tmp, redis.url, args.seconds, args.repeats, core, args.overrides))
    results["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    line = json.dumps(results)
    print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
