"""A running AMP-RL system to break, and the ledgers that say what the breaking cost.

``FaultSystem`` starts, on loopback, a redis-server (AOF on, its own folder, a fixed port),
replay, the parameter server (main and pull ports, checkpoints every 2 s), a learner, an
evaluator and a CartPole actor, each an OS process in its own process group (started and
stopped by ``amprl.launch.procs``, the supervisor ``amprl run`` uses), configured as the
chart configures pods (environment variables, fixed ports), so any of them can be
killed and started again at the same address. Beside them run two ledger keepers:

- ``ledger_insert.py``, an actor that records every chunk replay acknowledged;
- ``ledger_push.py``, a learner that records every push the server acknowledged.

The actors reach replay, and the learners the parameter server, through a ``DelayRelay``
(0 ms) each, so a link can be cut and healed (``partition``).

``check()`` compares the ledgers with what the services hold: every acknowledged chunk
stored exactly once in Redis (read directly), no push applied more often than acknowledged,
no version going back within one server life. Each fault method breaks one thing, heals it,
waits until training goes on (parameter version, env steps and ledger inserts all advance)
and returns a ``FaultResult``. The fault tests (``test_faults.py``) and ``bench/faults.py``
run the same methods.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis as redis_py

from amprl.common.redis_server import redis_server_binary
from amprl.launch.procs import Service, spawn, start_service, stop_together, wait_for_port
from amprl_testing.netsim.relay import DelayRelay
from amprl.replay.storage import ReplayStorage

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ledger_insert import tag_of  # noqa: E402  (a script beside this module)
from ledger_push import LEARNER_ID as LEDGER_LEARNER  # noqa: E402

log = logging.getLogger(__name__)

CHECKPOINT_INTERVAL_S = 2.0
RESUME_TIMEOUT_S = 60.0  # "stalled" beyond this
PARTITION_S = 10.0

CONFIG = f"""\
name: faults
algo: dqn
env:
  id: CartPole-v1
network:
  hidden_sizes: [32, 32]
dqn:
  n_step: 3
  target_update_period: 50
replay:
  capacity: 1500000  # never reached in a run of the suite: an evicted chunk is not a lost one
  min_size_to_sample: 200
  samples_per_insert: 0.0
  keepalive_s: 1
learner:
  batch_size: 32
  precision: fp32
  device: cpu
  prefetch_batches: 2
paramserver:
  checkpoint_interval_s: {CHECKPOINT_INTERVAL_S}
actor:
  envs_per_actor: 1
  chunk_transitions: 32
  weight_refresh_steps: 200
evaluator:
  interval_s: 2.0
  episodes: 1
run:
  seed: 0
  total_env_steps: 100000000
"""


@dataclass
class FaultResult:
    """What one fault cost, in the keys ``bench/faults.py`` prints."""

    recovered_s: float | None
    """From the fault's end (restart, heal) until parameter version, env steps and ledger
    inserts all advanced again; None when they did not within RESUME_TIMEOUT_S."""
    lost_acknowledged: int
    """Acknowledged ledger chunks not in Redis (beyond any the fault is allowed to lose)."""
    duplicated: int
    """Ledger chunks stored more than once."""
    applied_twice: int
    """Ledger pushes the server applied beyond those acknowledged, unknown or in flight."""
    stalled: bool
    """Training did not resume within RESUME_TIMEOUT_S."""
    versions_back: int = 0
    """Times a client saw the version go down within one server life."""
    notes: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultSystem:
    """The system under test; ``close()`` stops every process and relay it started."""

    def __init__(self, root: Path, *, durability: str = "everysec"):
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.config = root / "experiment.yaml"
        self.config.write_text(CONFIG)
        self.redis_dir = root / "redis"
        self.redis_dir.mkdir(exist_ok=True)
        self.ports = {name: free_port() for name in
                      ("redis", "replay", "paramserver", "pull", "learner", "evaluator", "actor")}
        self.durability = durability
        self.redis: Service | None = None
        self.services: dict[str, Service] = {}
        self.ledger_procs: dict[str, Service] = {}
        self.insert_ledger = root / "inserts.ledger"
        self.push_ledger = root / "pushes.ledger"
        self.excused: set[int] = set()  # chunks a fault may lose by its documented bound
        self.replay_relay = DelayRelay(("127.0.0.1", 0), ("127.0.0.1", self.ports["replay"]), 0)
        self.ps_relay = DelayRelay(("127.0.0.1", 0), ("127.0.0.1", self.ports["paramserver"]), 0)

    # -- starting and stopping ---------------------------------------------------------

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports['redis']}/0"

    def start(self) -> "FaultSystem":
        self.replay_relay.start()
        self.ps_relay.start()
        self.start_redis()
        self.start_service("replay")
        self.start_service("paramserver")
        for name in ("learner", "evaluator", "actor"):
            self.start_service(name)
        self.start_ledgers()
        self.wait_resumed(time.monotonic(), timeout_s=180)
        return self

    def start_redis(self) -> None:
        # One plain AOF file (no rewrites), so a test can cut its tail as a crash would.
        argv = [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.ports["redis"]),
                "--dir", str(self.redis_dir), "--appendonly", "yes", "--save", "",
                "--appendfsync", "everysec", "--auto-aof-rewrite-percentage", "0"]
        self.redis = spawn("redis", argv, self.logs / "redis.log")
        deadline = time.monotonic() + 30
        while True:
            try:
                redis_py.Redis.from_url(self.redis_url, socket_timeout=1).ping()
                return
            except redis_py.RedisError:
                if not self.redis.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {self.redis.log()[-2000:]}")
                time.sleep(0.05)

    def _env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AMPRL_")}
        replay = f"127.0.0.1:{self.ports['replay']}"
        env.update(AMPRL_CONFIG=str(self.config), AMPRL_HOST="127.0.0.1",
                   AMPRL_PORT=str(self.ports[name]), AMPRL_ID=name, AMPRL_DRAIN_S="1",
                   AMPRL_RUN_DIR=str(self.root / "run"), AMPRL_LIVE_WINDOW_S="5")
        if name == "replay":
            env.update(AMPRL_REDIS_URL=self.redis_url,
                       AMPRL_SET=f"replay.durability={self.durability}")
        elif name == "paramserver":
            env.update(AMPRL_PULL_PORT=str(self.ports["pull"]))
        elif name == "learner":
            env.update(AMPRL_ID="learner-0", AMPRL_REPLAY_ADDRESS=replay,
                       AMPRL_PARAMSERVER_ADDRESS=self.ps_relay.address)
        elif name == "evaluator":
            env.update(AMPRL_PARAMSERVER_ADDRESS=f"127.0.0.1:{self.ports['pull']}")
        elif name == "actor":
            env.update(AMPRL_ID="actor-0", AMPRL_REPLAY_ADDRESS=self.replay_relay.address,
                       AMPRL_PARAMSERVER_ADDRESS=f"127.0.0.1:{self.ports['pull']}")
        return env

    def start_service(self, name: str) -> Service:
        svc = start_service(name, f"amprl.{name}", [], self.logs, self._env(name))
        self.services[name] = svc
        wait_for_port(svc, timeout_s=120)
        return svc

    def start_ledgers(self) -> None:
        pull = ["--pull-from", f"127.0.0.1:{self.ports['pull']}"]
        for name, script, address, ledger, extra in (
                ("ledger-insert", "ledger_insert.py", self.replay_relay.address, self.insert_ledger, []),
                ("ledger-push", "ledger_push.py", self.ps_relay.address, self.push_ledger, pull)):
            self.ledger_procs[name] = spawn(
                name, [sys.executable, str(HERE / script), address, str(ledger), *extra],
                self.logs / f"{name}.log", {**os.environ, "PYTHONUNBUFFERED": "1"})

    def close(self) -> None:
        procs = list(self.ledger_procs.values())
        for name in ("actor", "evaluator", "learner", "paramserver", "replay"):
            if name in self.services:
                procs.append(self.services[name])
        if self.redis is not None:
            procs.append(self.redis)
        stop_together(procs, timeout_s=20)
        self.replay_relay.stop()
        self.ps_relay.stop()

    def __enter__(self) -> "FaultSystem":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- looking at it -----------------------------------------------------------------

    def replay_info(self):
        from amprl.replay.client import ReplayClient
        with ReplayClient(f"127.0.0.1:{self.ports['replay']}") as c:
            return c.info(timeout=5)

    def ps_info(self):
        from amprl.paramserver.client import ParameterClient
        with ParameterClient(f"127.0.0.1:{self.ports['pull']}", timeout_s=5) as c:
            return c.info()

    def _progress(self) -> tuple[int, int, int, int] | None:
        """(ps incarnation, version, env steps, ledger inserts acknowledged), or None while a
        service does not answer."""
        from amprl import errors
        try:
            ps, replay = self.ps_info(), self.replay_info()
        except errors.AmprlError:
            return None
        return ps.incarnation, ps.version, replay.env_steps_total, len(self.insert_acks())

    def wait_resumed(self, since: float, timeout_s: float = RESUME_TIMEOUT_S,
                     versions: int = 5, env_steps: int = 100) -> float | None:
        """Seconds from ``since`` (monotonic) until the parameter version (within one server
        life), env steps and ledger inserts have all advanced; None if not in ``timeout_s``."""
        first = None
        while time.monotonic() - since < timeout_s:
            now = self._progress()
            if now is not None:
                if first is None or now[0] != first[0]:
                    first = now  # a new server life counts from its own first version
                elif (now[1] >= first[1] + versions and now[2] >= first[2] + env_steps
                      and now[3] > first[3]):
                    return round(time.monotonic() - since, 2)
            time.sleep(0.2)
        return None

    def check_alive(self) -> None:
        for name, svc in self.services.items():
            assert svc.alive(), f"{name} exited with {svc.returncode}:\n{svc.log_tail(40)}"
        for name, proc in self.ledger_procs.items():
            assert proc.alive(), f"{name} exited with {proc.returncode}"

    # -- the ledgers ---------------------------------------------------------------------

    @staticmethod
    def _lines(path: Path) -> list[list[str]]:
        if not path.exists():
            return []
        text = path.read_text()
        lines = text.split("\n")
        return [line.split() for line in lines[:-1] if line]  # the last may be half written

    def insert_acks(self) -> dict[int, float]:
        return {int(f[1]): float(f[2]) for f in self._lines(self.insert_ledger) if f[0] == "A"}

    def insert_errors(self, since_unix: float = 0.0) -> collections.Counter:
        return collections.Counter(f[1] for f in self._lines(self.insert_ledger)
                                   if f[0] == "E" and float(f[2]) >= since_unix)

    def insert_error_messages(self, since_unix: float = 0.0) -> list[str]:
        return [" ".join(f[1:2] + f[3:]) for f in self._lines(self.insert_ledger)
                if f[0] == "E" and float(f[2]) >= since_unix]

    def stored_copies(self) -> collections.Counter:
        """Ledger chunk seq -> transitions of it in Redis (read-only, straight from Redis)."""
        client = redis_py.Redis.from_url(self.redis_url, socket_timeout=30)
        try:
            storage = ReplayStorage(client)
            c = storage.load_counters()
            if c["oldest_chunk"] > 0:
                raise AssertionError(
                    f"replay evicted chunks (oldest chunk {c['oldest_chunk']}): the ledger cannot "
                    f"tell evicted from lost; raise replay.capacity in harness.CONFIG")
            cids = list(range(c["oldest_chunk"], c["next_chunk"]))
            copies: collections.Counter = collections.Counter()
            for start in range(0, len(cids), 2000):
                for meta in storage.load_metas(cids[start:start + 2000]):
                    if meta is None:
                        continue
                    for r in meta.rewards[meta.rewards < 1.0]:  # CartPole's are >= 1
                        copies[tag_of(r)[0]] += 1
            return copies
        finally:
            client.close()

    def check(self, excuse_lost: bool = False) -> dict:
        """Compares the ledgers with the services now: {lost_acknowledged, duplicated,
        applied_twice, versions_back, lost_seqs}. With ``excuse_lost``, what is lost now is
        excused from later checks (a fault whose documented bound allows it)."""
        from ledger_insert import T
        acked_before = self.insert_acks()  # read before Redis: each of these is stored by now
        copies = self.stored_copies()
        lost = sorted(s for s in acked_before if copies.get(s, 0) == 0 and s not in self.excused)
        duplicated = sorted(s for s, n in copies.items() if n > T)
        torn = sorted(s for s, n in copies.items() if 0 < n < T and s in acked_before
                      and s not in self.excused)
        if excuse_lost:
            self.excused.update(lost)
        applied_twice, versions_back = self._check_pushes()
        return {"lost_acknowledged": len(lost), "duplicated": len(duplicated) + len(torn),
                "applied_twice": applied_twice, "versions_back": versions_back,
                "lost_seqs": lost[:20], "duplicated_seqs": (duplicated + torn)[:20],
                "acknowledged": len(acked_before)}

    def _check_pushes(self) -> tuple[int, int]:
        try:
            info = self.ps_info()  # read before the ledger: what it applied is there by now
        except Exception:  # noqa: BLE001 - a server down now has no count to compare
            info = None
        lines = self._lines(self.push_ledger)
        versions_back, seen = 0, {}
        for f in lines:
            if f[0] == "V":
                inc, version = int(f[1]), int(f[2])
                if version < seen.get(inc, 0):
                    versions_back += 1
                seen[inc] = max(seen.get(inc, 0), version)
        if info is None:
            return 0, versions_back
        inc = info.incarnation
        acked = {int(f[1]) for f in lines if f[0] == "A" and int(f[2]) == inc}
        # Pushes whose outcome the ledger has not seen (unknown fate, or in flight now),
        # counted from the last sign of an earlier server life: any of them may have landed
        # in this one.
        def life(f):
            return int(f[1]) if f[0] == "V" else int(f[2]) if f[0] == "A" else None

        start = 0
        for i, f in enumerate(lines):
            if life(f) == inc:
                break
            if life(f) is not None:
                start = i + 1
        settled = {int(f[1]) for f in lines[start:] if f[0] in ("A", "R")}
        sent = {int(f[1]) for f in lines[start:] if f[0] == "S"}
        open_ = len(sent - settled)
        applied = info.steps_applied_by_learner.get(LEDGER_LEARNER, 0)
        return max(0, applied - len(acked) - open_), versions_back

    # -- faults ----------------------------------------------------------------------------

    def _result(self, since: float, excuse_lost: bool = False, **notes) -> FaultResult:
        recovered = self.wait_resumed(since)
        checked = self.check(excuse_lost)
        notes.update(lost_seqs=checked.pop("lost_seqs"), duplicated_seqs=checked.pop("duplicated_seqs"),
                     acknowledged=checked.pop("acknowledged"))
        return FaultResult(recovered_s=recovered, stalled=recovered is None, notes=notes, **checked)

    def kill(self, name: str) -> FaultResult:
        """``kill -9`` of one service's process group, then the same service started again."""
        self.services[name].kill()
        since = time.monotonic()
        self.start_service(name)
        return self._result(since)

    def kill_paramserver(self) -> FaultResult:
        """As ``kill``; also measures how far versions went back (the checkpoint bound)."""
        before = self.ps_info()
        self.services["paramserver"].kill()
        since = time.monotonic()
        self.start_service("paramserver")
        after = self.ps_info()
        return self._result(since, versions_rolled_back=before.version - after.version,
                            incarnation_changed=after.incarnation != before.incarnation,
                            checkpoint_interval_s=CHECKPOINT_INTERVAL_S)

    def sigterm(self, name: str) -> FaultResult:
        """SIGTERM (as Kubernetes stops a pod): the service drains and exits 0, then starts
        again."""
        t0 = time.monotonic()
        code = self.services[name].stop(timeout_s=40)
        stop_s = round(time.monotonic() - t0, 2)
        since = time.monotonic()
        self.start_service(name)
        return self._result(since, exit_code=code, stop_s=stop_s)

    def restart_replay(self, durability: str) -> None:
        """Replay stopped (SIGTERM) and started again with another ``replay.durability``."""
        self.durability = durability
        self.services["replay"].signal(signal.SIGTERM)
        self.services["replay"].wait(timeout_s=40)
        self.start_service("replay")

    def kill_redis(self, cut_tail_s: float = 0.0, wipe: bool = False) -> FaultResult:
        """``kill -9`` of redis-server, started again on the same folder. ``cut_tail_s``:
        its AOF loses what was appended in the last that many seconds before the kill (a
        machine crash under appendfsync everysec); ``wipe``: it comes back empty (a
        control: persistence lost)."""
        aof = self.redis_dir / "appendonly.aof"
        if cut_tail_s:  # a crash in the middle of traffic, not in a lull after a restart
            self.wait_resumed(time.monotonic())
        # acknowledged (so appended) before the size is read: these must all survive the cut
        acked_at_cut = max(self.insert_acks(), default=0)
        size_before = aof.stat().st_size if cut_tail_s else 0
        if cut_tail_s:
            time.sleep(cut_tail_s)
        acked_at_kill = max(self.insert_acks(), default=0)
        self.redis.kill()
        notes = {}
        if cut_tail_s:
            cut = aof.stat().st_size - size_before
            with open(aof, "r+b") as f:
                f.truncate(size_before)
            notes.update(aof_bytes_cut=cut, acked_in_cut_window=acked_at_kill - acked_at_cut)
        if wipe:
            for path in self.redis_dir.iterdir():
                path.unlink()
        time.sleep(1.0)  # replay notices Redis gone (NOT_SERVING, UNAVAILABLE to callers)
        since = time.monotonic()
        self.start_redis()
        result = self._result(since, excuse_lost=bool(cut_tail_s or wipe), **notes)
        if cut_tail_s:
            # what was lost must lie in the cut window: acknowledged after the cut point
            lost = result.notes["lost_seqs"]
            result.notes["lost_only_in_cut_window"] = all(s > acked_at_cut for s in lost)
            result.notes["replay_missing_transitions"] = self.replay_info().missing_transitions
        return result

    def push_acks(self) -> int:
        return sum(1 for f in self._lines(self.push_ledger) if f[0] == "A")

    def partition(self, link: str, seconds: float = PARTITION_S, direction: str = "both") -> FaultResult:
        """The actors' link to replay (``"actor-replay"``) or the learners' link to the
        parameter server (``"learner-paramserver"``) cut for ``seconds``, then healed;
        ``direction="down"`` cuts only the replies, and at the end resets the connections,
        so the replies held are lost for good: requests arrived and were acted on, their
        acknowledgements never come, and the clients resend (what must not be stored or
        applied twice)."""
        relay = {"actor-replay": self.replay_relay, "learner-paramserver": self.ps_relay}[link]
        acks = self.push_acks if link == "learner-paramserver" else lambda: len(self.insert_acks())
        with relay.cut(direction):
            time.sleep(1.0)  # what was on its way when the link went
            before, acks_before = self._progress(), acks()
            time.sleep(seconds - 1.0)
            after, acks_after = self._progress(), acks()
            if direction == "down":  # the held replies are lost for good: clients must resend
                relay.reset_connections()
        # proof that the cut held: no acknowledgement crossed it (nor, cut both ways, any work)
        crossed = {"ledger_acks": acks_after - acks_before}
        if direction == "both":
            crossed.update({"versions": after[1] - before[1]} if link == "learner-paramserver"
                           else {"env_steps": after[2] - before[2]})
        return self._result(time.monotonic(), crossed_while_cut=crossed)

    def redis_full(self, seconds: float = 5.0) -> FaultResult:
        """Redis's maxmemory set just above what it holds for ``seconds``, then lifted:
        inserts must be refused as RESOURCE_EXHAUSTED (not retried forever as UNAVAILABLE),
        and training resume once there is room."""
        client = redis_py.Redis.from_url(self.redis_url, socket_timeout=5)
        t0 = time.time()
        try:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", used + 256 * 1024)
            time.sleep(seconds)
            client.config_set("maxmemory", 0)
        finally:
            client.close()
        since = time.monotonic()
        errors_seen = dict(self.insert_errors(t0))
        messages = [m for m in self.insert_error_messages(t0) if m.startswith("ResourceExhausted")]
        return self._result(since, insert_errors=errors_seen, message=messages[0] if messages else "")


def dump(results: dict[str, FaultResult]) -> str:
    return json.dumps({k: v.as_dict() for k, v in results.items()}, indent=1)


@contextlib.contextmanager
def fault_system(root: Path, **kwargs):
    system = FaultSystem(root, **kwargs)
    try:
        yield system.start()
    finally:
        system.close()
