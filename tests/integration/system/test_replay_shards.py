"""AMPRL_REPLAY_ADDRESS with several shards: actors insert into their own shard, the
learner samples across shards by total priority and updates priorities on the right one."""

from __future__ import annotations

import numpy as np
import pytest

from amprl import errors
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import ExperimentConfig
from amprl.replay import client as replay_client
from amprl.replay.client import SHARD_KEY_BITS, ReplayClient, ShardedReplayClient, shard_for
from amprl.replay.service import create_server
from amprl_testing.replay import make_chunk, vector_spec


@pytest.fixture
def shards(tmp_path):
    """Two replay shards (one Redis, two key prefixes) on loopback."""
    redis = EmbeddedRedis(tmp_path / "redis")
    started = []
    try:
        cfg = ExperimentConfig()
        cfg.replay.min_size_to_sample = 1
        for i in range(2):
            rs = create_server(cfg, vector_spec(), redis.url, "127.0.0.1", 0,
                               prefix=f"test:shard{i}", seed=i)
            started.append((rs, rs.table, f"127.0.0.1:{rs.port}"))
        yield [a for _, _, a in started], [t for _, t, _ in started]
    finally:
        for rs, _, _ in started:
            rs.stop(0)
        redis.stop()


def test_connect_returns_one_client_per_shard_count(shards):
    addresses, _ = shards
    assert type(replay_client.connect(addresses[0])) is ReplayClient
    sharded = replay_client.connect(" , ".join(addresses))
    assert isinstance(sharded, ShardedReplayClient) and sharded.addresses == addresses
    sharded.close()
    with pytest.raises(errors.InvalidArgument, match="AMPRL_REPLAY_ADDRESS"):
        replay_client.connect(" , ")


def test_actors_insert_into_their_own_shard_and_sampling_follows_priority(shards):
    addresses, tables = shards
    spec = vector_spec()
    ids = [f"actor-{i}" for i in range(16)]
    assert {shard_for(a, 2) for a in ids} == {0, 1}  # the fleet spreads over both
    assert [shard_for(a, 2) for a in ids] == [shard_for(a, 2) for a in ids]  # stable
    a0 = next(a for a in ids if shard_for(a, 2) == 0)
    a1 = next(a for a in ids if shard_for(a, 2) == 1)
    with replay_client.connect(",".join(addresses)) as client:
        # Shard 0's transitions have three times shard 1's priority.
        client.insert(a0, [(make_chunk(spec, 30, seed=0), np.full(30, 3.0, np.float32), 30)])
        client.insert(a1, [(make_chunk(spec, 30, seed=1), np.full(30, 1.0, np.float32), 30)])
        assert (tables[0].size, tables[1].size) == (30, 30)
        info = client.info()
        assert info.size == 60 and info.env_steps_total == 60 and info.actors_seen == 2

        totals = [t.tree.total for t in tables]  # sum of p^alpha: 30 * 3^0.6 and 30 * 1
        counts = [0, 0]
        for _ in range(400):
            batch = client.sample(4, beta=0.4)
            shard = int(batch.keys[0] >> SHARD_KEY_BITS)
            assert (batch.keys >> SHARD_KEY_BITS == shard).all()
            counts[shard] += 1
        expected = totals[0] / sum(totals)  # 0.66
        assert abs(counts[0] / sum(counts) - expected) < 0.1, (counts, expected)

        # Priorities go back to the shard each key came from.
        batch = client.sample(8, beta=0.4)
        shard = int(batch.keys[0] >> SHARD_KEY_BITS)
        local = batch.keys & ((1 << SHARD_KEY_BITS) - 1)
        reply = client.update_priorities(batch.keys, np.full(8, 0.5, np.float32))
        assert reply.updated == len(np.unique(local))
        assert tables[shard].priority_updates_total == reply.updated
        assert tables[1 - shard].priority_updates_total == 0
        with pytest.raises(errors.InvalidArgument, match="names no shard"):
            client.update_priorities(np.array([5 << SHARD_KEY_BITS]), np.ones(1, np.float32))
