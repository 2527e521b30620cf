"""The replay ACL user on a real redis-server: everything but replay's commands on its own
keys is refused, and replay works end to end with nothing more."""

from __future__ import annotations

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from amprl.common.redis_acl import REPLAY_COMMANDS, REPLAY_USER, RedisUser
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import ExperimentConfig
from amprl.errors import ConfigError
from amprl.replay.service import create_server
from amprl.replay.storage import ReplayStorage
from amprl_testing.replay import make_chunk, vector_spec

PREFIX = "amprl:replay:acl"


@pytest.fixture
def node(tmp_path):
    """A Redis whose replay user may touch only ``amprl:replay:acl:*``, as under amprl run."""
    server = EmbeddedRedis(tmp_path / "redis", users=[RedisUser(REPLAY_USER, "pw:/@", PREFIX)])
    admin = redis.Redis.from_url(server.admin_url)
    admin.set("other:secret", "not replay's")
    admin.set(f"{PREFIX}-sibling:k", "a prefix that only starts the same")
    try:
        yield server, admin
    finally:
        admin.close()
        server.stop()


@pytest.mark.parametrize("command", [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "requirepass"), ("CONFIG", "SET", "appendonly", "no"),
    ("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"), ("ACL", "LIST"), ("KEYS", "*"),
    ("SCAN", "0"), ("MODULE", "LIST"), ("CLIENT", "KILL", "TYPE", "normal"), ("MONITOR",),
    ("SCRIPT", "FLUSH"), ("EVAL", "return 1", "0"), ("BGREWRITEAOF",), ("SAVE",),
    ("SELECT", "1"), ("PUBLISH", "amprl:replay:acl:c", "x"), ("MIGRATE", "h", "1", "k", "0", "1"),
])
def test_the_replay_user_is_refused_every_other_command(node, command):
    server, _ = node
    client = redis.Redis.from_url(server.user_url())
    # Redis 7 refuses DEBUG to everyone before the ACL is asked (enable-debug-command no)
    refusal = redis.exceptions.ResponseError if command[0] == "DEBUG" else redis.exceptions.NoPermissionError
    with pytest.raises(refusal, match="no permissions|DEBUG command not allowed"):
        client.execute_command(*command)
    client.close()


def test_the_replay_user_is_refused_keys_outside_its_prefix_also_inside_its_script(node):
    server, admin = node
    client = redis.Redis.from_url(server.user_url())
    for call in (lambda: client.get("other:secret"), lambda: client.set("other:secret", "x"),
                 lambda: client.delete("other:secret"), lambda: client.hgetall("other:h"),
                 lambda: client.get(f"{PREFIX}-sibling:k"), lambda: client.get(PREFIX)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    # a script it may run is held to the same keys
    setrange = client.register_script("return redis.call('SETRANGE', KEYS[1], 0, 'x')")
    with pytest.raises(redis.exceptions.NoPermissionError):
        setrange(keys=["other:secret"])
    assert setrange(keys=[f"{PREFIX}:k"]) == 1
    flush = client.register_script("return redis.call('FLUSHALL')")
    with pytest.raises(redis.exceptions.ResponseError, match="(?i)can't run this command|no permissions"):
        flush(keys=[f"{PREFIX}:k"])
    assert admin.get("other:secret") == b"not replay's"
    client.close()


def test_no_one_gets_in_without_a_password_and_the_admin_has_every_right(node):
    server, admin = node
    once = Retry(NoBackoff(), 0)  # an authentication error is not worth retrying here
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=server.host, port=server.port, protocol=2, retry=once).set("k", "v")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=server.host, port=server.port, username=REPLAY_USER, password="wrong",
                    retry=once).ping()
    assert admin.config_get("appendonly") == {"appendonly": "yes"}
    # the configuration Redis read holds hashes, never a password
    text = server.conf_path.read_text()
    assert "pw:/@" not in text and server.password not in text


def test_replay_works_end_to_end_as_its_user_and_sends_only_its_commands(node):
    server, admin = node
    admin.config_resetstat()
    cfg = ExperimentConfig()
    cfg.replay.capacity, cfg.replay.min_size_to_sample = 1000, 1
    spec = vector_spec()
    for attempt in range(2):  # the second replay rebuilds its index from Redis
        rs = create_server(cfg, spec, server.user_url(), "127.0.0.1", 0, prefix=f"{PREFIX}:t",
                           seed=0)
        try:
            from amprl.replay.client import ReplayClient
            with ReplayClient(f"127.0.0.1:{rs.port}") as client:
                if attempt == 0:
                    chunks = [(make_chunk(spec, 20, seed=i), np.ones(20, np.float32), 20)
                              for i in range(5)]
                    assert client.insert("actor-0", chunks, incarnation=1,
                                         first_sequence=1).size == 100
                batch = client.sample(32, 0.4)
                updated = client.update_priorities(batch.keys, np.full(32, 2.0)).updated
                assert updated == len(set(batch.keys.tolist()))
                info = client.info()
                assert info.size == 100 and info.redis_used_memory_bytes > 0
        finally:
            rs.stop(0)
    # everything replay sent is on the list (Redis 6.2 counts subcommands under their
    # command), and nothing was refused
    stats = {name.removeprefix("cmdstat_").split("|")[0]: v
             for name, v in admin.info("commandstats").items()}
    assert stats.pop("config")["calls"] == 1  # the admin's RESETSTAT; replay sent none
    assert stats.pop("info")["calls"] >= 1  # replay's, and the admin's INFO above
    allowed = {c.split("|")[0] for c in REPLAY_COMMANDS} | {"auth", "hello"}
    assert set(stats) <= allowed, stats
    assert {"multi", "exec", "evalsha", "hset", "setrange", "hget", "hgetall"} <= set(stats)
    assert admin.acl_log() == []


def test_replay_as_its_user_leaves_fsync_to_redis_and_refuses_to_start_without_the_aof(node):
    server, admin = node
    cfg = ExperimentConfig()
    cfg.replay.durability = "always"
    admin.config_set("appendfsync", "everysec")
    rs = create_server(cfg, vector_spec(), server.user_url(), "127.0.0.1", 0, prefix=f"{PREFIX}:d")
    rs.stop(0)
    assert admin.config_get("appendfsync") == {"appendfsync": "everysec"}  # not its to set
    admin.config_set("appendonly", "no")
    with pytest.raises(ConfigError, match="appendonly yes.*its AOF is off"):
        create_server(cfg, vector_spec(), server.user_url(), "127.0.0.1", 0, prefix=f"{PREFIX}:d")


def test_the_embedded_redis_writes_the_fsync_policy_it_is_given(tmp_path):
    with EmbeddedRedis(tmp_path / "r", users=[RedisUser(REPLAY_USER, "pw")],
                       appendfsync="always") as server:
        admin = redis.Redis.from_url(server.admin_url)
        assert admin.config_get("appendfsync") == {"appendfsync": "always"}
        admin.close()


def test_every_storage_call_passes_the_acl(node):
    """Each ReplayStorage method once as the replay user, the rare ones included
    (forgetting a sender, deleting evicted chunks)."""
    server, admin = node
    storage = ReplayStorage.from_url(server.user_url(), f"{PREFIX}:s")
    try:
        storage.ensure_durability("everysec")
        storage.write_layout({"v": 1})
        assert storage.load_layout() == {"v": 1}
        for cid in range(3):
            storage.write_chunk(b"meta", cid, b"frames", [(cid, np.ones(2, np.float32))],
                                {"next_chunk": cid + 1}, delete_chunks=[cid - 1] if cid else [],
                                senders={f"actor-{cid}": f"1:{cid}"},
                                forget_senders=[f"actor-{cid - 1}"] if cid else [])
        storage.write_priorities(np.array([0, 3]), np.array([5.0, 6.0], np.float32), {"x": 1})
        assert storage.load_senders() == {"actor-2": (1, 2)}
        assert storage.chunks_exist([0, 1, 2]) == [False, False, True]
        assert storage._hget_many([2], "frames") == [b"frames"]
        assert storage.load_counters()["next_chunk"] == 3
        assert storage.load_priorities(4).tolist() == [5.0, 1.0, 1.0, 6.0]
        assert storage.server_id() and storage.used_memory() > 0 and storage.max_memory() == 0
        assert storage.redis.ping()  # the health check of an idle connection
    finally:
        storage.close()
    assert admin.acl_log() == []
