"""The replay service over real gRPC with its data in a real redis-server."""

import threading

import numpy as np
import pytest

from amprl import errors
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import ExperimentConfig
from amprl.errors import ConfigError
from amprl.replay.service import create_server
from amprl_testing.replay import atari_spec, make_chunk, vector_spec


def items(spec, n_chunks, t, *, base=0, prio=1.0):
    out = []
    for i in range(n_chunks):
        chunk = make_chunk(spec, t, seed=base + i, reward_base=(base + i) * 1000)
        out.append((chunk, np.full(t, prio, np.float32), t))
    return out


def test_insert_sample_update_round_trip(replay):
    spec = vector_spec()
    r = replay(spec, capacity=1000)
    sent = items(spec, 3, 20)
    resp = r.client.insert("actor-1", sent)
    assert (resp.chunks_stored, resp.transitions_stored, resp.size) == (3, 60, 60)

    batch = r.client.sample(32, beta=0.4)
    assert batch.obs.shape == (32, 4) and batch.next_obs.shape == (32, 4)
    assert batch.keys.dtype == np.int64 and batch.weights.dtype == np.float32
    for i, key in enumerate(batch.keys):
        chunk = sent[key // 20][0]
        j = key % 20
        np.testing.assert_array_equal(batch.obs[i], chunk.frames[chunk.obs_idx[j, 0]])
        np.testing.assert_array_equal(batch.next_obs[i], chunk.frames[chunk.next_obs_idx[j, 0]])
        assert batch.rewards[i] == chunk.rewards[j] and batch.actions[i] == chunk.actions[j]
    np.testing.assert_allclose(batch.probabilities, 1 / 60, rtol=1e-5)
    np.testing.assert_allclose(batch.weights, 1.0, rtol=1e-5)

    upd = r.client.update_priorities(np.array([0, 1, 2]), np.array([4.0, 4.0, 4.0]))
    assert (upd.updated, upd.evicted) == (3, 0)
    info = r.client.info()
    assert (info.size, info.capacity, info.inserted_total, info.sampled_total,
            info.priority_updates_total, info.env_steps_total, info.actors_seen) == \
        (60, 1000, 60, 32, 3, 60, 1)
    assert info.total_priority == pytest.approx(57 + 3 * 4.0 ** 0.6)
    assert info.redis_used_memory_bytes > 0
    assert r.table.get(np.array([0, 1, 2, 3]))["priorities"].tolist() == [4.0, 4.0, 4.0, 1.0]


def test_atari_frames_round_trip_exactly(replay):
    spec = atari_spec(84)
    r = replay(spec, capacity=1000)
    sent = items(spec, 2, 16)
    r.client.insert("actor-1", sent)
    raw = r.client.sample_raw(32, 0.4)
    assert len(raw.batch.lz4_frames) > 0  # frames travel compressed
    batch = r.client.sample(32, beta=1.0)
    assert batch.obs.shape == (32, 4, 84, 84) and batch.obs.dtype == np.uint8
    for i, key in enumerate(batch.keys):
        chunk = sent[key // 16][0]
        j = key % 16
        np.testing.assert_array_equal(batch.obs[i], chunk.frames[chunk.obs_idx[j]])
        np.testing.assert_array_equal(batch.next_obs[i], chunk.frames[chunk.next_obs_idx[j]])


def test_priorities_shape_sampling_and_weights(replay):
    spec = vector_spec()
    r = replay(spec, capacity=100, alpha=1.0)
    chunk = make_chunk(spec, 2)
    r.client.insert("a", [(chunk, np.array([1.0, 3.0], np.float32), 2)])
    counts = np.zeros(2)
    for _ in range(40):
        b = r.client.sample(2, beta=1.0)
        counts += np.bincount(b.keys, minlength=2)
        np.testing.assert_allclose(b.probabilities, np.where(b.keys == 0, 0.25, 0.75), rtol=1e-6)
        np.testing.assert_allclose(b.weights, np.where(b.keys == 0, 1.0, 1 / 3), rtol=1e-6)
    assert 0.6 < counts[1] / counts.sum() < 0.9


def test_eviction_and_stale_priority_updates(replay):
    spec = vector_spec()
    r = replay(spec, capacity=64)
    r.client.insert("a", items(spec, 4, 32))
    assert r.client.info().size == 64
    upd = r.client.update_priorities(np.array([0, 63, 127]), np.ones(3))
    assert (upd.updated, upd.evicted) == (1, 2)  # keys 64..127 are live


def test_restart_in_process_keeps_contents(replay):
    spec = atari_spec(16)
    r = replay(spec, capacity=500)
    r.client.insert("a", items(spec, 5, 30))
    r.client.update_priorities(np.array([3, 100]), np.array([9.0, 0.25]))
    before = r.table.get(np.arange(150))
    r.server.stop(0)
    again = replay(spec, capacity=500, prefix=r.prefix)
    after = again.table.get(np.arange(150))
    for name in ("priorities", "rewards", "obs", "next_obs", "actions"):
        np.testing.assert_array_equal(after[name], before[name])
    assert again.client.info().inserted_total == 150
    assert again.client.sample(8, 0.4).obs.shape == (8, 4, 16, 16)


def test_sample_waits_for_min_size_then_deadline(replay):
    spec = vector_spec()
    r = replay(spec, capacity=100, min_size_to_sample=50)
    r.client.insert("a", items(spec, 1, 10))
    with pytest.raises(errors.DeadlineExceeded):
        r.client.sample(4, 0.4, timeout=0.3)
    # a waiting sample is released by an insert
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("b", r.client.sample(4, 0.4, timeout=10)))
    th.start()
    r.client.insert("a", items(spec, 1, 40, base=1))
    th.join(10)
    assert len(result["b"]) == 4


def test_concurrent_inserts_and_samples(replay):
    spec = vector_spec()
    r = replay(spec, capacity=4000)
    r.client.insert("a", items(spec, 1, 64))
    failures = []

    def inserter(k):
        try:
            for i in range(10):
                r.client.insert(f"actor-{k}", items(spec, 3, 32, base=100 * k + 3 * i))
        except Exception as exc:  # noqa: BLE001
            failures.append(exc)

    def sampler():
        try:
            for _ in range(30):
                b = r.client.sample(64, 0.5)
                r.client.update_priorities(b.keys, np.abs(b.rewards) + 0.1)
        except Exception as exc:  # noqa: BLE001
            failures.append(exc)

    threads = [threading.Thread(target=inserter, args=(k,)) for k in range(3)] + \
              [threading.Thread(target=sampler) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not failures
    info = r.client.info()
    assert info.size == 64 + 3 * 10 * 3 * 32 and info.actors_seen == 4
    total = float((np.abs(r.table.get(np.arange(info.size))["priorities"]).astype(np.float64) ** 0.6).sum())
    assert info.total_priority == pytest.approx(total, rel=1e-6)


def test_a_capacity_that_cannot_fit_redis_maxmemory_is_refused_at_start(tmp_path):
    cfg = ExperimentConfig()
    cfg.replay.capacity = 1_000_000
    with EmbeddedRedis(tmp_path / "small", maxmemory="8mb") as small:
        with pytest.raises(ConfigError, match=r"replay.capacity: 1000000 .* maxmemory \(8.0 MiB\)"):
            create_server(cfg, vector_spec(), small.url, "127.0.0.1", 0)


def test_full_redis_answers_resource_exhausted_naming_capacity_and_maxmemory(tmp_path, replay):
    spec = vector_spec()
    with EmbeddedRedis(tmp_path / "small", maxmemory="2mb") as small:
        r = replay(spec, capacity=20_000, redis_url=small.url)
        stored = 0
        with pytest.raises(errors.ResourceExhausted) as full:
            for i in range(200):
                stored += r.client.insert("a", items(spec, 1, 100, base=i)).transitions_stored
        message = str(full.value)
        assert "maxmemory" in message and "replay.capacity = 20000" in message, message
        # nothing of the refused insert is stored, and the shard goes on serving
        info = r.client.info()
        assert info.size == stored > 0
        assert len(r.client.sample(16, 0.4)) == 16


def test_a_resent_call_is_stored_once_also_after_a_replay_restart(replay):
    spec = vector_spec()
    r = replay(spec, capacity=1000)
    sent = items(spec, 3, 10)
    numbering = dict(incarnation=77, first_sequence=1)
    first = r.client.insert("actor-a", sent, **numbering)
    assert (first.chunks_stored, first.chunks_duplicate, first.size) == (3, 0, 30)
    # the same call again (its reply was lost, say): acknowledged, not stored twice
    again = r.client.insert("actor-a", sent, **numbering)
    assert (again.chunks_stored, again.transitions_stored, again.chunks_duplicate) == (3, 30, 3)
    assert again.size == 30
    # a resend that overlaps: chunks 2-3 again plus a new 4th
    more = items(spec, 4, 10)[1:]
    overlap = r.client.insert("actor-a", more, incarnation=77, first_sequence=2)
    assert (overlap.chunks_duplicate, overlap.size) == (2, 40)
    # another actor, or the same actor restarted (a new incarnation), numbers its own chunks
    assert r.client.insert("actor-b", sent, **numbering).chunks_duplicate == 0
    assert r.client.insert("actor-a", sent, incarnation=78, first_sequence=1).chunks_duplicate == 0
    # unnumbered inserts are never deduplicated
    assert r.client.insert("actor-a", sent).chunks_duplicate == 0
    size = r.client.info().size
    assert size == 40 + 30 + 30 + 30

    # a restarted replay remembers what each sender stored (it is in Redis with the chunks)
    r.server.stop(0)
    back = replay(spec, capacity=1000, prefix=r.prefix)
    assert back.client.insert("actor-a", more, incarnation=78, first_sequence=2).chunks_duplicate == 2
    assert back.client.info().size == size + 10


@pytest.mark.parametrize("durability", ["always", "everysec"])
def test_replay_with_every_right_sets_redis_fsync_to_its_durability(replay, embedded_redis,
                                                                    durability):
    import redis as redis_lib
    admin = redis_lib.Redis.from_url(embedded_redis.admin_url)
    try:
        admin.config_set("appendfsync", "no")
        replay(vector_spec(), capacity=100, durability=durability,
               redis_url=embedded_redis.admin_url)
        assert admin.config_get("appendfsync")["appendfsync"] == durability
        assert admin.config_get("appendonly")["appendonly"] == "yes"
    finally:
        admin.close()
