import pytest

from amprl.replay.actors import ActorRegistry


def test_live_counts_ids_seen_within_the_window():
    reg = ActorRegistry(live_window_s=10.0)
    reg.saw("a", now=0.0)
    reg.saw("b", now=5.0)
    reg.saw("a", now=12.0)  # a again: the newest
    assert reg.seen == 2
    assert reg.live(now=14.0) == 2
    assert reg.live(now=16.0) == 1  # b last inserted 11 s ago


def test_a_fleet_churning_through_ids_never_grows_the_record_past_its_bound():
    reg = ActorRegistry(live_window_s=60.0, max_tracked=100)
    for k in range(10_000):  # every restart a new pod name
        reg.saw(f"actor-{k}", now=float(k))
    assert reg.seen == 100
    assert reg.live(now=10_000.0) == 60  # the last 60 s of them, all still remembered


@pytest.mark.parametrize("kwargs", [dict(live_window_s=0), dict(max_tracked=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ActorRegistry(**kwargs)
