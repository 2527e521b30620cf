"""kill -9 the replay process mid-insert, restart it on the same Redis: every acknowledged
transition is there with its priority."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from amprl import errors
from amprl.common.channels import wait_until_serving
from amprl.common.redis_acl import REPLAY_USER, RedisUser
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import ReplayConfig
from amprl.envs.spec import EnvSpec
from amprl.replay.client import ReplayClient
from amprl.replay.storage import ReplayStorage
from amprl.replay.table import ReplayTable
from amprl_testing.replay import make_chunk, vector_spec

SPEC = EnvSpec((16, 16), np.dtype(np.uint8), 4, True, num_actions=6)
SPEC_JSON = json.dumps({"frame_shape": [16, 16], "frame_dtype": "uint8", "frame_stack": 4,
                        "discrete": True, "num_actions": 6})
CAPACITY = 200_000
T = 32


class ReplayProcess:
    def __init__(self, tmp_path, redis_url, name):
        port_file = tmp_path / f"{name}.port"
        self.log = open(tmp_path / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "amprl.replay", "--host", "127.0.0.1", "--port", "0",
             "--port-file", str(port_file), "--redis-url", redis_url, "--spec-json", SPEC_JSON,
             "--set", f"replay.capacity={CAPACITY}", "--set", "replay.min_size_to_sample=1"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert self.proc.poll() is None, (tmp_path / f"{name}.log").read_text()
            assert time.monotonic() < deadline, "replay did not write its port file"
            time.sleep(0.05)
        self.address = f"127.0.0.1:{port_file.read_text()}"
        wait_until_serving(self.address, timeout_s=30)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


def tagged(tag: int):
    """Chunk `tag`: rewards tag*T .. tag*T+T-1, priorities derived from them."""
    chunk = make_chunk(SPEC, T, seed=tag, reward_base=tag * T)
    return chunk, priority_of(chunk.rewards), T


def priority_of(rewards):
    return (1.0 + (np.asarray(rewards) % 97) / 10.0).astype(np.float32)


@pytest.mark.timeout(120)
def test_sigkill_mid_insert_loses_nothing_acknowledged(tmp_path, embedded_redis):
    first = ReplayProcess(tmp_path, embedded_redis.user_url(), "first")
    acked: list[int] = []  # chunk tags whose Insert call returned
    stop = threading.Event()
    errors_seen = []

    def stream():
        tag = 0
        with ReplayClient(first.address) as client:
            while not stop.is_set():
                tags = list(range(tag, tag + 4))
                tag += 4
                try:
                    client.insert("actor-0", (tagged(t) for t in tags), timeout=10)
                except errors.AmprlError as exc:
                    errors_seen.append(exc)
                    return
                acked.extend(tags)

    second = None
    th = threading.Thread(target=stream)
    try:
        th.start()
        deadline = time.monotonic() + 30
        while len(acked) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(acked) >= 40
        first.kill()  # the client is mid-stream
        th.join(20)
        assert not th.is_alive()
        assert errors_seen and isinstance(errors_seen[0], errors.Unavailable)

        second = ReplayProcess(tmp_path, embedded_redis.user_url(), "second")
        with ReplayClient(second.address) as client:
            info = client.info()
            assert info.size >= len(acked) * T
            assert info.inserted_total == info.size
            batch = client.sample(64, 0.4)
            assert batch.obs.shape == (64, 4, 16, 16)
            assert client.update_priorities(batch.keys, np.ones(64)).updated > 0

        # Inspect what the restarted service rebuilt, key by key, straight from Redis.
        cfg = ReplayConfig(capacity=CAPACITY, min_size_to_sample=1)
        storage = ReplayStorage.from_url(embedded_redis.user_url())
        table = ReplayTable(storage, SPEC, cfg)
        assert table.oldest_key == 0  # so a row of `stored` is its key
        stored = table.get(np.arange(table.oldest_key, table.next_key))
        storage.close()
        by_reward = dict(zip(stored["rewards"].tolist(), range(len(stored["rewards"]))))
        sampled_keys = set(batch.keys.tolist())
        for tag in acked:
            chunk, prios, _ = tagged(tag)
            rows = [by_reward.get(float(r)) for r in chunk.rewards]
            assert None not in rows, f"acknowledged chunk {tag} missing after restart"
            rows = np.array(rows)
            mask = np.array([row not in sampled_keys for row in rows])  # untouched by the update
            np.testing.assert_array_equal(stored["priorities"][rows][mask], prios[mask])
            np.testing.assert_array_equal(stored["obs"][rows], chunk.frames[chunk.obs_idx])
            np.testing.assert_array_equal(stored["next_obs"][rows], chunk.frames[chunk.next_obs_idx])
    finally:
        stop.set()
        first.kill()
        if second is not None:
            second.kill()
        th.join(10)


def start_replay_process(tmp_path, *args: str) -> subprocess.Popen:
    """``python -m amprl.replay`` with its own embedded Redis under ``tmp_path``."""
    return subprocess.Popen([sys.executable, "-m", "amprl.replay", "--host", "127.0.0.1",
                             "--port-file", str(tmp_path / "port"), "--run-dir", str(tmp_path),
                             *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def wait_for_replay_process(proc: subprocess.Popen, tmp_path) -> str:
    """The address of a replay started by ``start_replay_process``, once it serves."""
    port_file = tmp_path / "port"
    deadline = time.monotonic() + 45
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    address = f"127.0.0.1:{port_file.read_text()}"
    wait_until_serving(address)
    return address


@pytest.mark.timeout(60)
def test_entry_point_starts_embedded_redis_and_stops_on_sigterm(tmp_path):
    proc = start_replay_process(tmp_path, "--set", "replay.min_size_to_sample=1")
    pid_file = tmp_path / "redis" / "redis-server.pid"
    try:
        address = wait_for_replay_process(proc, tmp_path)
        with ReplayClient(address) as client:  # CartPole-v1 from the default config
            chunk = make_chunk(EnvSpec((4,), np.dtype(np.float32), 1, True, num_actions=2), 5)
            assert client.insert("a", [(chunk, np.ones(5, np.float32), 5)]).size == 5
        redis_pid = int(pid_file.read_text())
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(20) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(redis_pid, 0)  # the embedded redis went with it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def acl_node(data, port: int = 0, like: EmbeddedRedis | None = None, **kw) -> EmbeddedRedis:
    """A Redis with the replay ACL user (the same passwords as ``like`` on a restart)."""
    if like is not None:
        return EmbeddedRedis(data, port=port, password=like.password, users=like.users, **kw)
    return EmbeddedRedis(data, users=[RedisUser(REPLAY_USER, "replay-pw", "amprl:replay")], **kw)


@pytest.mark.parametrize("user", ["replay ACL user", "admin"])
def test_redis_back_without_its_last_writes_under_a_running_replay_is_reconciled_not_a_crash_loop(
        tmp_path, replay, user):
    # A node crash under AOF everysec: Redis comes back without its last writes while the
    # replay service keeps running. Made exact here: fsync every write (durability always),
    # remember where the AOF ended after batch A, add batch B, SIGKILL Redis, cut the AOF
    # back, restart it. As the ACL user replay cannot configure Redis: its own
    # configuration says "always", as amprl run writes it; as admin, replay sets it.
    spec = vector_spec()
    data = tmp_path / "node"
    acl = user == "replay ACL user"
    node = acl_node(data, appendfsync="always") if acl else EmbeddedRedis(data)
    url = node.user_url() if acl else node.admin_url
    restarted = None
    try:
        r = replay(spec, capacity=10_000, redis_url=url, durability="always")
        batch = lambda base, n: [(make_chunk(spec, 10, seed=base + i, reward_base=base + i),  # noqa: E731
                                  np.ones(10, np.float32), 10) for i in range(n)]
        r.client.insert("a", batch(0, 3))                       # A: 30 transitions
        aof = data / "appendonly.aof"
        kept = aof.stat().st_size
        r.client.insert("a", batch(100, 2))                     # B: 20, to be lost
        node.kill()
        with open(aof, "r+b") as f:
            f.truncate(kept)
        restarted = (acl_node(data, node.port, like=node, appendfsync="always") if acl
                     else EmbeddedRedis(data, port=node.port))
        deadline = time.monotonic() + 20
        while True:  # the service reconnects; the first calls may find Redis down
            try:
                r.client.insert("a", batch(200, 4))             # C: 40
                break
            except errors.Unavailable:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        while r.client.info().missing_transitions != 20:       # noticed within a second or so
            assert time.monotonic() < deadline, r.client.info()
            time.sleep(0.1)
        info = r.client.info()
        assert (info.size, info.missing_transitions) == (70, 20)
        # the restarted Redis came back with its own configuration (everysec without the
        # ACL): replay set its durability again
        admin = redis.Redis.from_url(node.admin_url)
        assert admin.config_get("appendfsync")["appendfsync"] == "always"
        admin.close()
        for _ in range(20):
            rewards = set(r.client.sample(32, 0.4).rewards.tolist())
            assert not rewards & {100.0, 101.0}, "a lost transition was sampled"

        # A restarted replay opens on that Redis: what is there, with what is missing counted.
        again = replay(spec, capacity=10_000, redis_url=url, prefix=r.prefix)
        info = again.client.info()
        assert (info.size, info.missing_transitions, info.inserted_total) == (70, 20, 90)
        assert again.client.sample(64, 0.4).obs.shape == (64, 4)
    finally:
        if restarted is not None:
            restarted.stop()
        node.stop()


def test_health_is_not_serving_while_redis_is_down_and_serving_once_it_is_back(tmp_path, replay):
    spec = vector_spec()
    data = tmp_path / "node"
    node = acl_node(data)
    restarted = None
    try:
        r = replay(spec, capacity=1000, redis_url=node.user_url())
        with grpc.insecure_channel(r.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status(service=""):
                return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

            def wait_for(want, what):
                deadline = time.monotonic() + 15
                while status() != want:
                    assert time.monotonic() < deadline, what
                    time.sleep(0.1)

            assert status() == health_pb2.HealthCheckResponse.SERVING
            node.kill()
            wait_for(health_pb2.HealthCheckResponse.NOT_SERVING, "NOT_SERVING with Redis down")
            # Info still answers meanwhile (an operator can see why), and liveness stays
            # SERVING: a replay without Redis is taken out of its Service, not restarted.
            assert r.client.info(timeout=2).capacity == 1000
            assert status("liveness") == health_pb2.HealthCheckResponse.SERVING
            restarted = acl_node(data, node.port, like=node)
            wait_for(health_pb2.HealthCheckResponse.SERVING, "SERVING with Redis back")
            chunk = make_chunk(spec, 5)
            assert r.client.insert("a", [(chunk, np.ones(5, np.float32), 5)]).transitions_stored == 5
    finally:
        if restarted is not None:
            restarted.stop()
        node.stop()


@pytest.mark.timeout(60)
def test_sigterm_drains_not_serving_then_stops(tmp_path):
    proc = start_replay_process(tmp_path, "--drain-s", "2")
    pid_file = tmp_path / "redis" / "redis-server.pid"
    try:
        address = wait_for_replay_process(proc, tmp_path)
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            os.kill(proc.pid, signal.SIGTERM)
            sent = time.monotonic()
            time.sleep(0.5)
            # still answering, but out of rotation
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert proc.wait(20) == 0
            assert time.monotonic() - sent >= 2.0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
