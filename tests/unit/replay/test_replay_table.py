import numpy as np
import pytest

from amprl.config import ReplayConfig
from amprl.errors import FailedPrecondition, InvalidArgument, Unavailable
from amprl.replay.table import ReplayTable
from amprl_testing.replay import atari_spec, make_chunk, vector_spec
from amprl.rl.transitions import Chunk


def cfg(**kw) -> ReplayConfig:
    base = dict(capacity=100, min_size_to_sample=1, alpha=0.6)
    base.update(kw)
    return ReplayConfig(**base)


def table(storage, spec=None, seed=0, **kw) -> ReplayTable:
    return ReplayTable(storage, spec or vector_spec(), cfg(**kw), seed=seed)


def insert(t, n, *, base=0.0, prios=None, seed=0):
    chunk = make_chunk(t.spec, n, seed=seed, reward_base=base)
    p = np.ones(n, np.float32) if prios is None else np.asarray(prios, np.float32)
    return t.insert(chunk, p, n), chunk


def test_keys_are_consecutive_in_insertion_order(storage):
    t = table(storage)
    assert insert(t, 10)[0] == 0
    assert insert(t, 5)[0] == 10
    assert t.size == 15
    np.testing.assert_array_equal(t.get(np.arange(15))["rewards"],
                                  np.r_[np.arange(10), np.arange(5)].astype(np.float32))


def test_fifo_eviction_keeps_the_newest_capacity(storage):
    t = table(storage, capacity=100)
    for i in range(13):
        insert(t, 10, base=100 * i)
    assert t.size == 100 and t.oldest_key == 30 and t.next_key == 130
    np.testing.assert_array_equal(t.get(np.array([30, 129]))["rewards"], [300.0, 1209.0])
    # chunks whose transitions are all gone are deleted from storage
    assert sorted(storage.chunks) == list(range(3, 13))


def test_sample_probabilities_and_weights_follow_the_formulas(storage):
    t = table(storage, alpha=0.5)
    prios = np.array([1.0, 4.0, 9.0, 16.0], np.float32)
    insert(t, 4, prios=prios)
    r = t.sample(4, beta=0.5)
    pa = prios.astype(np.float64) ** 0.5
    expected_p = pa / pa.sum()
    np.testing.assert_allclose(r.probabilities, expected_p[r.keys], rtol=1e-6)
    # w_i = (N P(i))^-beta / max_j (N P(j))^-beta, max from the smallest priority
    w = (4 * expected_p) ** -0.5
    np.testing.assert_allclose(r.weights, (w / w.max())[r.keys], rtol=1e-6)
    assert r.weights.max() <= 1.0


def test_sample_rebuilds_stacks_from_shared_frames(storage):
    spec = atari_spec(8)
    t = table(storage, spec=spec)
    _, chunk = insert(t, 12)
    r = t.sample(12, beta=0.4)
    import lz4.block
    frames = np.stack([np.frombuffer(lz4.block.decompress(b, uncompressed_size=64), np.uint8)
                       .reshape(8, 8) for b in r.lz4_frames])
    for i, key in enumerate(r.keys):
        np.testing.assert_array_equal(frames[r.obs_idx[i]], chunk.frames[chunk.obs_idx[key]])
        np.testing.assert_array_equal(frames[r.next_obs_idx[i]], chunk.frames[chunk.next_obs_idx[key]])
    assert r.num_frames <= 12 + 3 + 3


def test_update_priorities_changes_sampling_and_skips_evicted_keys(storage):
    t = table(storage, capacity=20)
    insert(t, 20)
    updated, evicted = t.update_priorities(np.array([0, 1], np.int64), np.array([5.0, 5.0], np.float32))
    assert (updated, evicted) == (2, 0)
    assert t.get(np.array([0]))["priorities"][0] == 5.0
    insert(t, 10)  # evicts keys 0..9
    updated, evicted = t.update_priorities(np.array([1, 25], np.int64), np.array([2.0, 3.0], np.float32))
    assert (updated, evicted) == (1, 1)
    assert storage.prio[25 % 20] == 3.0


def test_update_of_a_never_issued_key_changes_nothing(storage):
    t = table(storage)
    insert(t, 10)
    before = t.tree.total
    with pytest.raises(InvalidArgument, match="key 10 was never issued"):
        t.update_priorities(np.array([3, 10], np.int64), np.array([9.0, 9.0], np.float32))
    assert t.tree.total == before and t.priority_updates_total == 0


@pytest.mark.parametrize("prios,message", [
    ([1, np.nan, 1], "NaN or infinite"), ([1, np.inf, 1], "NaN or infinite"),
    ([1, -1, 1], "<= 0"), ([1, 0, 1], "<= 0"), ([1, 1], r"expected \[3\]"),
])
def test_bad_priorities_store_nothing(storage, prios, message):
    t = table(storage)
    with pytest.raises(InvalidArgument, match=message):
        insert(t, 3, prios=prios)
    assert t.size == 0 and storage.chunks == {}


def test_a_failed_redis_write_stores_nothing_in_memory(storage):
    t = table(storage)
    insert(t, 5)
    storage.fail_writes = True
    with pytest.raises(Unavailable):
        insert(t, 5)
    assert t.size == 5 and t.next_key == 5
    storage.fail_writes = False
    assert insert(t, 5)[0] == 5


@pytest.mark.parametrize("batch", [0, -3, 101])
def test_bad_batch_sizes(storage, batch):
    t = table(storage)
    insert(t, 10)
    with pytest.raises(InvalidArgument, match="batch_size"):
        t.sample(batch, 0.4)


def test_batch_above_size_is_invalid(storage):
    t = table(storage)
    insert(t, 10)
    with pytest.raises(InvalidArgument, match="exceeds the 10 transitions stored"):
        t.sample(11, 0.4)


def test_rebuild_from_storage_restores_everything(storage):
    spec = atari_spec(8)
    t = table(storage, spec=spec, capacity=50)
    for i in range(7):
        insert(t, 10, base=10 * i, prios=np.arange(1, 11) * (i + 1), seed=i)
    t.update_priorities(np.array([45, 46], np.int64), np.array([0.5, 7.0], np.float32))
    t.sample(8, 0.4)
    keys = np.arange(t.oldest_key, t.next_key)
    before = t.get(keys)
    again = table(storage, spec=spec, capacity=50)
    assert (again.oldest_key, again.next_key, again.size) == (t.oldest_key, t.next_key, t.size)
    assert again.tree.total == pytest.approx(t.tree.total)
    assert again.inserted_total == 70 and again.priority_updates_total == 2
    after = again.get(keys)
    for name in ("priorities", "rewards", "actions", "discounts", "obs", "next_obs"):
        np.testing.assert_array_equal(after[name], before[name])
    assert insert(again, 3)[0] == 70


def test_reopening_with_another_layout_is_refused(storage):
    table(storage, capacity=100)
    with pytest.raises(FailedPrecondition, match="capacity: stored 100, now 200"):
        table(storage, capacity=200)


def test_small_cache_refetches_frames_from_storage(storage):
    spec = atari_spec(8)
    t = table(storage, spec=spec, cache_max_bytes=1)
    chunks = [insert(t, 10, base=10 * i, seed=i)[1] for i in range(5)]
    assert len(t._cached) == 1
    got = t.get(np.arange(50))
    assert storage.frame_loads > 0
    for i, chunk in enumerate(chunks):
        np.testing.assert_array_equal(got["obs"][10 * i:10 * i + 10], chunk.frames[chunk.obs_idx])
    r = t.sample(50, 0.4)
    assert len(r.lz4_frames) == r.num_frames


def test_frame_ring_evicts_early_rather_than_overwrite_live_frames(storage):
    spec = vector_spec()
    t = table(storage, spec=spec, capacity=10)  # frame ring: (2 * 1 + 4) * 10 = 60 frames
    assert t.frame_capacity == 60
    # 2 transitions over 25 frames (most unreferenced): 3 such chunks need 75 ring slots,
    # so the oldest chunk goes although only 6 of 10 transitions are stored.
    rng = np.random.default_rng(0)
    for i in range(3):
        frames = rng.standard_normal((25, 4)).astype(np.float32)
        chunk = Chunk(frames, np.array([[0], [1]], np.int32), np.array([[23], [24]], np.int32),
                      np.zeros(2, np.int64), np.array([10 * i, 10 * i + 1], np.float32),
                      np.ones(2, np.float32))
        t.insert(chunk, np.ones(2, np.float32))
    assert (t.oldest_key, t.next_key) == (2, 6)
    assert t.next_frame - t.chunks[0][3] <= t.frame_capacity
    got = t.get(np.arange(2, 6))
    np.testing.assert_array_equal(got["rewards"], [10, 11, 20, 21])
    np.testing.assert_array_equal(got["next_obs"][-2:, 0], frames[[23, 24]])


def test_insert_many_is_one_stored_chunk(storage):
    t = table(storage)
    items = [(make_chunk(t.spec, 4, seed=i, reward_base=10 * i), np.ones(4, np.float32), 4)
             for i in range(3)]
    assert t.insert_many(items).first_key == 0
    assert len(storage.chunks) == 1 and t.size == 12
    got = t.get(np.arange(12))
    for i, (chunk, _, _) in enumerate(items):
        np.testing.assert_array_equal(got["next_obs"][4 * i:4 * i + 4, 0], chunk.frames[chunk.next_obs_idx[:, 0]])
    assert t.env_steps_total == 12


def test_info_counts(storage):
    t = table(storage)
    insert(t, 10)
    t.sample(4, 0.4)
    t.update_priorities(np.array([1], np.int64), np.array([2.0], np.float32))
    i = t.info()
    assert (i["size"], i["inserted_total"], i["sampled_total"], i["priority_updates_total"]) \
        == (10, 10, 4, 1)


# -- chunks Redis lost -------------------------------------------------------------------

def _never_sampled(t, keys, draws=40):
    for _ in range(draws):
        drawn = t.sample(16, 0.4).keys
        assert not set(drawn.tolist()) & set(keys), "a missing key was sampled"


def test_a_table_opens_on_data_missing_chunks_in_the_middle_and_skips_them(storage):
    t = table(storage)
    for i in range(10):
        insert(t, 5, base=10 * i, seed=i)  # chunk i holds keys 5i .. 5i+4
    del storage.chunks[3], storage.chunks[4]  # Redis came back without them
    again = table(storage)
    assert (again.size, again.missing, again.oldest_key, again.next_key) == (40, 10, 0, 50)
    _never_sampled(again, range(15, 25))
    assert again.update_priorities(np.array([16, 30], np.int64), np.array([5.0, 5.0], np.float32)) == (1, 1)
    with pytest.raises(InvalidArgument, match="missing"):
        again.get(np.array([17]))
    np.testing.assert_array_equal(again.get(np.array([25]))["rewards"], [50.0])
    # FIFO eviction ages the hole out: 60 more keys (capacity 100) evict keys 0..9, 15 more
    # the lost 15..24 with them
    for i in range(12):
        insert(again, 5, base=100 + 10 * i, seed=20 + i)
    assert (again.size, again.missing, again.oldest_key) == (90, 10, 10)
    for i in range(3):
        insert(again, 5, base=300 + 10 * i, seed=40 + i)
    assert (again.size, again.missing, again.oldest_key) == (100, 0, 25)
    assert len(again.get(np.arange(25, 125))["rewards"]) == 100


def test_a_lost_tail_behind_counters_written_later_is_missing_not_fatal(storage):
    t = table(storage)
    for i in range(6):
        insert(t, 5, seed=i)
    t.update_priorities(np.array([1], np.int64), np.array([2.0], np.float32))  # counters again
    del storage.chunks[4], storage.chunks[5]
    again = table(storage)
    assert (again.size, again.missing, again.next_key) == (20, 10, 30)
    assert insert(again, 5)[0] == 30  # keys go on after the lost ones
    _never_sampled(again, range(20, 30))


def test_reconcile_marks_chunks_redis_lost_under_a_running_table(storage):
    t = table(storage)
    for i in range(6):
        insert(t, 5, seed=i)
    del storage.chunks[2]
    storage.layout = None  # Redis came back empty of it too
    assert t.reconcile() == 5 and t.reconcile() == 0
    assert (t.size, t.missing) == (25, 5) and storage.layout is not None
    _never_sampled(t, range(10, 15))
    insert(t, 5)
    again = table(storage)
    assert (again.size, again.missing) == (30, 5)


def test_numbered_chunks_are_stored_once_and_a_lost_one_is_taken_again(storage):
    from amprl.replay.insert import Sender
    t = table(storage)
    batch = [(make_chunk(t.spec, 5, seed=i), np.ones(5, np.float32), 5) for i in range(3)]
    assert t.insert_many(batch, Sender("a", 9, [1, 2, 3])).chunks == 3
    again = t.insert_many(batch, Sender("a", 9, [1, 2, 3]))
    assert (again.chunks, again.duplicate_chunks, again.duplicate_transitions) == (0, 3, 15)
    assert table(storage).insert_many(batch[:1], Sender("a", 9, [3])).duplicate_chunks == 1
    # Redis came back without the last write (its sender record went with it): a resend of
    # that chunk is stored again once the table has reconciled
    storage.senders["a"] = (9, 2)
    del storage.chunks[0]
    t.reconcile()
    assert t.insert_many(batch[2:], Sender("a", 9, [3])).chunks == 1
