"""Real redis-server + real gRPC replay servers on loopback, cleaned up even on failure.

The Redis has the ACL of ``amprl.common.redis_acl`` and replay connects as its user, as
under ``amprl run`` and the chart: a command replay sends that is not in REPLAY_COMMANDS,
or a key outside ``amprl:replay:*``, fails these tests with NOPERM.
"""

from __future__ import annotations

import itertools
import secrets
from types import SimpleNamespace

import pytest

from amprl.common.grpcutil import DEFAULT_MAX_MESSAGE_BYTES
from amprl.common.redis_acl import REPLAY_USER, RedisUser
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import ExperimentConfig
from amprl.replay.client import ReplayClient
from amprl.replay.service import create_server


TEST_KEYS = "amprl:replay"
"""The replay user's key prefix here: every test table's prefix starts with it."""


@pytest.fixture
def embedded_redis(tmp_path):
    """``.user_url()``: replay's user (its commands, keys under ``amprl:replay:``);
    ``.admin_url``: the ``default`` user, every right (to inspect or break Redis)."""
    server = EmbeddedRedis(tmp_path / "redis",
                           users=[RedisUser(REPLAY_USER, secrets.token_urlsafe(16), TEST_KEYS)])
    try:
        yield server
    finally:
        server.stop()


_prefixes = itertools.count()


@pytest.fixture
def replay(embedded_redis):
    """``replay(spec, **replay_config)`` starts a replay server on 127.0.0.1 against the
    test's Redis (or ``redis_url=``) and returns (address, client, table, server, prefix); everything started
    is stopped at teardown."""
    started = []

    def start(spec, *, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, prefix=None, redis_url=None,
              **overrides):
        cfg = ExperimentConfig()
        cfg.replay.min_size_to_sample = 1
        for key, value in overrides.items():
            setattr(cfg.replay, key, value)
        prefix = prefix or f"{TEST_KEYS}:test-{next(_prefixes)}"
        rs = create_server(cfg, spec, redis_url or embedded_redis.user_url(), "127.0.0.1", 0,
                           max_message_bytes=max_message_bytes, prefix=prefix, seed=0)
        address = f"127.0.0.1:{rs.port}"
        client = ReplayClient(address)
        started.append((rs, client))
        return SimpleNamespace(address=address, client=client, table=rs.table, server=rs,
                               servicer=rs.servicer, prefix=prefix, cfg=cfg)

    try:
        yield start
    finally:
        for rs, client in started:
            client.close()
            rs.stop(0)
