"""A small running AMP-RL system for behaviour tests: real processes, real Redis, real gRPC.

``system`` (module scope) starts an embedded Redis, then replay, the parameter server (main
port + pull port), a learner and an evaluator as OS processes, each configured only through
the environment, as the chart configures pods (the evaluator reads replay's Info; the
learner and actors ask the evaluator whether the run goes on; ``running_system(...,
tls=ROLE_DIRS)`` gives each process its role's certificate, as each pod mounts its own). Actors are added and removed by the tests
(``system.start_actor`` / ``system.stop_actor``). Every process runs in its own process
group (``amprl.launch.procs``, the supervisor ``amprl run`` uses) and is stopped through it
at teardown, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from amprl.common.redis_acl import REPLAY_USER, RedisUser
from amprl.common.redis_server import EmbeddedRedis
from amprl.launch import procs
from amprl.launch.procs import Service, read_port, stop_together, wait_for_port

# A CartPole DQN small enough to run beside several actors on two cores. The rate
# limiter is off (samples_per_insert 0) so actors are never throttled by replay.
TINY_CONFIG = """\
name: system-test
algo: dqn
env:
  id: CartPole-v1
network:
  hidden_sizes: [32, 32]
  dueling: true
dqn:
  n_step: 3
  target_update_period: 50
replay:
  capacity: 20000
  min_size_to_sample: 200
  samples_per_insert: 0.0
learner:
  batch_size: 32
  precision: fp32
  device: cpu
  prefetch_batches: 2
paramserver:
  checkpoint_interval_s: 0
actor:
  envs_per_actor: 2
  chunk_transitions: 32
  weight_refresh_steps: 200
evaluator:
  interval_s: 1.0
  episodes: 2
run:
  seed: 0
  total_env_steps: 100000000
  target_return: 100000.0
  stop_at_target: false
"""

LIVE_WINDOW_S = 3.0


def clean_env(**amprl_vars: str) -> dict[str, str]:
    """The parent's environment without any AMPRL_* variable, plus ``amprl_vars``: a
    process sees only the settings a pod spec would give it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPRL_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(amprl_vars)
    return env


def spawn(name: str, subcommand: str, env: dict[str, str], log_dir: Path,
          args: list[str] | None = None, port_file: Path | None = None) -> Service:
    """``python -m amprl.cli SUBCOMMAND`` with exactly ``env``, under the supervisor."""
    if port_file is not None:
        args = [*(args or []), "--port-file", str(port_file)]
    return procs.spawn(name, [sys.executable, "-m", "amprl.cli", subcommand, *(args or [])],
                       log_dir / f"{name}.log", env, port_file=port_file)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


class CpuLimit:
    """Emulates per-pod CPU limits (``resources.limits.cpu``) on a small test machine.

    Each registered process may run only during its own slot of every ``period_s``
    (SIGCONT at the slot's start, SIGSTOP at its end), so four actors at a 0.25 share take
    turns on one core instead of fighting over the box's two: the fleet's throughput is
    then bounded by the pods, as on a cluster with room to spare, and scales with their
    number. The kernel's CFS quota would do the same, but cgroups are not writable here.
    """

    def __init__(self, period_s: float = 0.1):
        self.period_s = period_s
        self._slots: dict[int, tuple[float, float]] = {}  # pid -> (start, end) in [0, 1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-limit", daemon=True)
        self._thread.start()

    def add(self, pid: int, start: float, share: float) -> None:
        with self._lock:
            self._slots[pid] = (start, start + share)

    def remove(self, pid: int) -> None:
        # Under the lock: the slot thread signals only while holding it, so no SIGSTOP
        # from an iteration that still saw this pid can land after the SIGCONT below
        # (that race left a SIGTERMed actor stopped until the test SIGKILLed it).
        with self._lock:
            self._slots.pop(pid, None)
            _signal(pid, signal.SIGCONT)

    def _run(self) -> None:
        running: set[int] = set()
        while not self._stop.is_set():
            phase = (time.monotonic() % self.period_s) / self.period_s
            with self._lock:
                for pid, (start, end) in self._slots.items():
                    on = start <= phase < end or start <= phase + 1 < end
                    if on and pid not in running:
                        _signal(pid, signal.SIGCONT)
                        running.add(pid)
                    elif not on and pid in running:
                        _signal(pid, signal.SIGSTOP)
                        running.discard(pid)
                running &= set(self._slots)
            time.sleep(self.period_s / 50)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            pids, self._slots = list(self._slots), {}
            for pid in pids:
                _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class System:
    root: Path
    env: dict[str, str]
    """The addresses every actor pod gets: AMPRL_CONFIG, AMPRL_REPLAY_ADDRESS,
    AMPRL_PARAMSERVER_ADDRESS (the pull port)."""
    replay_address: str
    paramserver_address: str
    paramserver_pull_address: str
    services: dict[str, Service]
    ports: dict[str, int]
    actors: dict[str, Service] = field(default_factory=dict)
    cpu: CpuLimit | None = None
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """With TLS: each role's AMPRL_TLS_* variables (its own certificate folder)."""

    def start_actor(self, actor_id: str) -> Service:
        """An actor started as a pod would be: only environment variables, no flags (its
        status port is fixed in advance, as the chart's containerPort is)."""
        port = free_port()
        proc = spawn(actor_id, "actor", clean_env(**self.env, **self.role_env.get("actor", {}), AMPRL_ID=actor_id,
                                                   AMPRL_PORT=str(port), AMPRL_HOST="127.0.0.1"),
                     self.root / "logs")
        self.actors[actor_id] = proc
        self.ports[actor_id] = port
        return proc

    def stop_actors(self, actor_ids: list[str]) -> list[int]:
        """SIGTERM, as Kubernetes does to the pods a scale-down removes; the exit codes."""
        procs = [self.actors.pop(a) for a in actor_ids]
        if self.cpu is not None:
            for proc in procs:
                self.cpu.remove(proc.pid)
        return stop_together(procs)

    def replay_info(self):
        from amprl.replay.client import ReplayClient
        with ReplayClient(self.replay_address) as c:
            return c.info(timeout=10)

    def ps_info(self):
        from amprl.paramserver.client import ParameterClient
        with ParameterClient(self.paramserver_pull_address, timeout_s=10) as c:
            return c.info()

    def check_alive(self) -> None:
        for name, proc in self.services.items():
            assert proc.alive(), f"{name} exited with {proc.returncode}:\n{proc.log()[-3000:]}"


@contextlib.contextmanager
def running_system(root: Path, config_text: str, tls: dict[str, Path] | None = None):
    """Starts Redis, replay, the parameter server, a learner and an evaluator for the
    experiment ``config_text`` under ``root`` (with ``tls``, {role: certificate folder},
    mutual TLS with each role's own); yields the System; stops all at exit."""
    role_env = {role: {"AMPRL_TLS_CERT_DIR": str(folder), "AMPRL_TLS_SERVER_NAME": "amprl.test"}
                for role, folder in (tls or {}).items()}
    logs = root / "logs"
    logs.mkdir()
    config = root / "experiment.yaml"
    config.write_text(config_text)
    # Replay connects as its ACL user with the password in a file, as in the chart's pods.
    user = RedisUser(REPLAY_USER, "system-replay-pw")
    (root / "redis-password").write_text(user.password + "\n")
    redis = EmbeddedRedis(root / "redis", users=[user])
    services: dict[str, Service] = {}
    sys_ = None
    try:
        base = dict(AMPRL_CONFIG=str(config), AMPRL_HOST="127.0.0.1", AMPRL_LIVE_WINDOW_S=str(LIVE_WINDOW_S))
        services["replay"] = spawn("replay", "replay", clean_env(
                                       **base, **role_env.get("replay", {}), AMPRL_REDIS_URL=redis.url,
                                       AMPRL_REDIS_USERNAME=user.name,
                                       AMPRL_REDIS_PASSWORD_FILE=str(root / "redis-password")),
                                   logs, port_file=logs / "replay.port")
        services["paramserver"] = spawn(
            "paramserver", "paramserver", clean_env(**base, **role_env.get("paramserver", {}), AMPRL_PULL_PORT="0"),
            logs, ["--pull-port-file", str(logs / "ps-pull.port")], port_file=logs / "ps.port")
        ports = {"replay": wait_for_port(services["replay"], 90),
                 "paramserver": wait_for_port(services["paramserver"], 90),
                 "paramserver_pull": read_port(services["paramserver"], logs / "ps-pull.port", 90)}
        replay = f"127.0.0.1:{ports['replay']}"
        ps = f"127.0.0.1:{ports['paramserver']}"
        pull = f"127.0.0.1:{ports['paramserver_pull']}"
        # the evaluator's Service address is known before it serves, as on a cluster
        ports["evaluator"] = free_port()
        evaluator = f"127.0.0.1:{ports['evaluator']}"
        services["learner"] = spawn("learner", "learner", clean_env(
            **base, **role_env.get("learner", {}), AMPRL_REPLAY_ADDRESS=replay, AMPRL_PARAMSERVER_ADDRESS=ps,
            AMPRL_EVALUATOR_ADDRESS=evaluator, AMPRL_ID="learner-0"),
            logs, port_file=logs / "learner.port")
        services["evaluator"] = spawn("evaluator", "evaluator", clean_env(
            **base, **role_env.get("evaluator", {}), AMPRL_PARAMSERVER_ADDRESS=pull, AMPRL_REPLAY_ADDRESS=replay,
            AMPRL_ID="evaluator-0", AMPRL_PORT=str(ports["evaluator"]),
            AMPRL_RUN_DIR=str(root / "eval")), logs, port_file=logs / "evaluator.port")
        ports["learner"] = wait_for_port(services["learner"], 90)
        wait_for_port(services["evaluator"], 90)
        sys_ = System(root, dict(AMPRL_CONFIG=str(config), AMPRL_REPLAY_ADDRESS=replay,
                                 AMPRL_PARAMSERVER_ADDRESS=pull, AMPRL_EVALUATOR_ADDRESS=evaluator),
                      replay, ps, pull, services, ports, cpu=CpuLimit(), role_env=role_env)
        yield sys_
    finally:
        if sys_ is not None:
            sys_.cpu.close()
            stop_together(list(sys_.actors.values()))
        # Clients first, then the servers they talk to, each group in parallel.
        stop_together([services[n] for n in ("evaluator", "learner") if n in services])
        stop_together([services[n] for n in ("paramserver", "replay") if n in services])
        redis.stop()


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with running_system(tmp_path_factory.mktemp("system"), TINY_CONFIG) as sys_:
        yield sys_
