import random

import pytest

from amprl.common.backoff import Backoff


def test_waits_double_up_to_the_cap_and_are_jittered_within_each_half_window():
    b = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(0))
    waits = [b.next() for _ in range(8)]
    windows = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    for w, d in zip(waits, windows):
        assert d / 2 <= w <= d
    # a fleet retrying together spreads out: 100 clients' first waits are not all equal
    firsts = {Backoff(rng=random.Random(seed)).next() for seed in range(100)}
    assert len(firsts) == 100


def test_reset_starts_from_the_shortest_window_again():
    b = Backoff(base_s=0.1, cap_s=5.0, rng=random.Random(1))
    for _ in range(10):
        b.next()
    b.reset()
    assert b.next() <= 0.1


@pytest.mark.parametrize("base, cap", [(0, 1), (-1, 1), (2, 1)])
def test_bad_settings_are_refused(base, cap):
    with pytest.raises(ValueError):
        Backoff(base_s=base, cap_s=cap)
