import numpy as np
import pytest
from scipy import stats

from amprl.replay.sumtree import SumTree


@pytest.mark.parametrize("capacity,arity", [(1, 32), (7, 2), (32, 32), (33, 32), (1000, 8), (100_000, 32)])
def test_total_and_min_track_leaf_updates(capacity, arity):
    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity, arity=arity)
    values = rng.random(capacity)
    tree.update(np.arange(capacity), values)
    assert tree.total == pytest.approx(values.sum(), rel=1e-12)
    assert tree.min == values.min()
    idx = rng.integers(0, capacity, size=min(capacity, 50))
    values[idx] = 0.0
    tree.update(idx, np.zeros(idx.size))
    assert tree.total == pytest.approx(values.sum(), rel=1e-12, abs=1e-12)
    positive = values[values > 0]
    assert tree.min == (positive.min() if positive.size else np.inf)


def test_repeated_leaf_in_one_update_keeps_the_last_value():
    tree = SumTree(10)
    tree.update(np.array([3, 3, 3]), np.array([1.0, 2.0, 5.0]))
    assert tree.get(np.array([3]))[0] == 5.0
    assert tree.total == 5.0


def test_rebuild_equals_incremental_updates():
    rng = np.random.default_rng(1)
    values = rng.random(5000)
    a, b = SumTree(5000), SumTree(5000)
    a.update(np.arange(5000), values)
    b.rebuild(values)
    assert a.total == pytest.approx(b.total, rel=1e-12)
    assert a.min == b.min
    u = rng.random(1000) * a.total
    np.testing.assert_array_equal(a.find(u), b.find(u))


def test_find_walks_prefix_sums():
    tree = SumTree(5, arity=2)
    tree.update(np.arange(5), np.array([1.0, 0.0, 2.0, 3.0, 4.0]))
    # prefix sums: [0,1) -> 0, [1,3) -> 2, [3,6) -> 3, [6,10) -> 4
    np.testing.assert_array_equal(tree.find(np.array([0.0, 0.99, 1.0, 2.9, 3.0, 5.99, 6.0, 9.99])),
                                  [0, 0, 2, 2, 3, 3, 4, 4])


def test_empty_leaves_are_never_sampled():
    tree = SumTree(1000)
    leaves = np.arange(0, 1000, 7)
    tree.update(leaves, np.full(leaves.size, 0.5))
    drawn = tree.sample(50_000, np.random.default_rng(0))
    assert np.isin(drawn, leaves).all()


def test_sampling_an_empty_tree_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        SumTree(4).sample(1, np.random.default_rng(0))


def test_bad_updates_are_rejected():
    tree = SumTree(4)
    with pytest.raises(IndexError):
        tree.update(np.array([4]), np.array([1.0]))
    with pytest.raises(ValueError):
        tree.update(np.array([0]), np.array([np.nan]))
    with pytest.raises(ValueError):
        tree.update(np.array([0]), np.array([-1.0]))


def test_sampled_frequencies_match_priorities_chi_square():
    """200k draws over 200 leaves with priorities spanning 3 orders of magnitude (alpha
    applied): the chi-square goodness-of-fit test must not reject P(i) = p_i / sum p."""
    rng = np.random.default_rng(1234)
    n_leaves, draws = 200, 200_000
    p = rng.uniform(-1.5, 1.5, n_leaves)
    weights = (10.0 ** p) ** 0.6
    tree = SumTree(n_leaves)
    tree.update(np.arange(n_leaves), weights)
    drawn = np.concatenate([tree.sample(256, rng) for _ in range(draws // 256 + 1)])[:draws]
    observed = np.bincount(drawn, minlength=n_leaves)
    expected = weights / weights.sum() * draws
    assert expected.min() > 5  # chi-square validity
    chi2, pvalue = stats.chisquare(observed, expected)
    assert pvalue > 1e-3, (chi2, pvalue)


def test_batch_update_and_sample_are_fast_enough():
    # Not a benchmark: guards against an accidental per-element Python loop.
    import time

    tree = SumTree(1_000_000)
    rng = np.random.default_rng(0)
    tree.update(np.arange(1_000_000), rng.random(1_000_000))
    start = time.perf_counter()
    for _ in range(20):
        tree.update(rng.integers(0, 1_000_000, 256), rng.random(256))
        tree.sample(256, rng)
    assert (time.perf_counter() - start) / 20 < 0.05
