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


def test_a_password_keeps_other_clients_out_and_stays_in_an_owner_only_file(tmp_path):
    # what `amprl run` does: its embedded Redis has a random password
    with EmbeddedRedis(tmp_path / "r", password="s3cret") as r:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=r.host, port=r.port).set("k", "v")
        assert redis.Redis(host=r.host, port=r.port, password="s3cret").set("k", "v")
        assert (r.conf_path.stat().st_mode & 0o777) == 0o600
