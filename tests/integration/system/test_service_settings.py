"""Settings the chart passes through the environment (amprl.common.cli)."""

from __future__ import annotations

import pytest
import redis

from amprl.common import cli
from amprl.common.redis_server import EmbeddedRedis
from amprl.errors import ConfigError


def test_the_redis_password_file_wins_and_is_url_safe(tmp_path, monkeypatch):
    secret = tmp_path / "password"
    secret.write_text("p@ss:w/rd%\n")  # a mounted Secret may end with a newline
    monkeypatch.setenv("AMPRL_REDIS_PASSWORD", "from-env")
    monkeypatch.setenv("AMPRL_REDIS_PASSWORD_FILE", str(secret))
    assert cli.redis_password() == "p@ss:w/rd%"
    url = cli.redis_connection_url("redis://redis-0.redis:6379/0")
    assert url == "redis://:p%40ss%3Aw%2Frd%25@redis-0.redis:6379/0"
    # a URL that carries its own credentials is left alone
    assert cli.redis_connection_url("redis://:x@h:1/0") == "redis://:x@h:1/0"
    monkeypatch.delenv("AMPRL_REDIS_PASSWORD_FILE")
    assert cli.redis_password() == "from-env"


def test_a_missing_password_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPRL_REDIS_PASSWORD_FILE", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="AMPRL_REDIS_PASSWORD_FILE"):
        cli.redis_connection_url("redis://h:1/0")


def test_replay_reaches_a_password_protected_redis_with_the_file(tmp_path, monkeypatch):
    secret = tmp_path / "password"
    secret.write_text("s3cret/@:\n")
    monkeypatch.setenv("AMPRL_REDIS_PASSWORD_FILE", str(secret))
    with EmbeddedRedis(tmp_path / "redis", password="s3cret/@:") as server:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        assert redis.Redis.from_url(cli.redis_connection_url(server.url)).ping()


def test_the_redis_user_and_tls_come_from_the_environment(tmp_path, monkeypatch):
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("AMPRL_REDIS_USERNAME", "amprl-replay")
    monkeypatch.setenv("AMPRL_REDIS_PASSWORD", "p@ss")
    assert cli.redis_connection_url("redis://h:1/0") == "redis://amprl-replay:p%40ss@h:1/0"
    monkeypatch.setenv("AMPRL_REDIS_TLS_CA_FILE", str(ca))
    url = cli.redis_connection_url("redis://h:1/0")
    assert url == f"rediss://amprl-replay:p%40ss@h:1/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
    kwargs = redis.connection.parse_url(url)
    assert (kwargs["connection_class"], kwargs["ssl_ca_certs"]) == (redis.SSLConnection, str(ca))
    assert (kwargs["username"], kwargs["password"]) == ("amprl-replay", "p@ss")
    monkeypatch.setenv("AMPRL_REDIS_TLS_CA_FILE", str(tmp_path / "nope.crt"))
    with pytest.raises(ConfigError, match="AMPRL_REDIS_TLS_CA_FILE"):
        cli.redis_connection_url("redis://h:1/0")


def test_replay_addresses_split_a_comma_list():
    assert cli.replay_addresses("a:1, b:2,,") == ["a:1", "b:2"]
    assert cli.replay_addresses("") == []
