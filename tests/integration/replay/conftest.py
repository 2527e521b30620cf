"""Real redis-server + real gRPC replay servers on loopback, cleaned up even on failure."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from amprl.common.grpcutil import DEFAULT_MAX_MESSAGE_BYTES
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import ExperimentConfig
from amprl.replay.client import ReplayClient
from amprl.replay.service import create_server


@pytest.fixture
def embedded_redis(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis")
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
        prefix = prefix or f"test:{next(_prefixes)}"
        rs = create_server(cfg, spec, redis_url or embedded_redis.url, "127.0.0.1", 0,
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
