import os
import signal

import pytest
import redis

from amprl.common.redis_server import EmbeddedRedis


def test_embedded_redis_persists_across_restarts(tmp_path):
    with EmbeddedRedis(tmp_path / "r") as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        client.set("k", b"v" * 100)
        client.close()
        pid = server.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with EmbeddedRedis(tmp_path / "r") as again:
        assert redis.Redis.from_url(again.url).get("k") == b"v" * 100


def test_embedded_redis_survives_its_own_sigkill_with_acknowledged_writes(tmp_path):
    server = EmbeddedRedis(tmp_path / "r")
    try:
        client = redis.Redis.from_url(server.url)
        client.set("k", "1")  # in the AOF (page cache) once acknowledged: a process crash keeps it
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait()
    finally:
        server.stop()
    with EmbeddedRedis(tmp_path / "r") as again:
        assert redis.Redis.from_url(again.url).get("k") == b"1"
