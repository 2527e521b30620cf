"""A replay that holds inserts back (its rate limiter) stops the actor's env loop within
``actor.max_unacked_transitions``: data never queues up behind the limiter and goes stale."""

from __future__ import annotations

import threading
import time
import types

import pytest

from amprl import errors
from amprl.actor.actor import Actor
from amprl.common.supervise import ThreadDied
from amprl.config import load_config
from amprl.envs.factory import env_spec
from amprl_testing.replay import make_chunk


class NoWeightsServer:
    """A parameter server that never has weights: the actor acts with its seeded init."""

    def info(self, timeout=None):
        return types.SimpleNamespace(version=0)

    def pull_versioned(self, have_version=0, have_incarnation=0, *, encoding="fp32", timeout=None):
        raise errors.Unavailable("no parameter server in this test")


class HeldReplay:
    """Acknowledges an Insert only while ``open`` is set, like a rate-limited replay."""

    def __init__(self):
        self.open = threading.Event()
        self.acknowledged = 0

    def insert(self, actor_id, items, timeout=None, cancel=None, **numbering):
        if not self.open.wait(timeout=timeout):
            raise errors.DeadlineExceeded("rate-limited")
        n = sum(len(chunk.actions) for chunk, _, _ in items)
        self.acknowledged += n
        return types.SimpleNamespace(transitions_stored=n)


def _wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_held_replay_stops_the_env_loop_within_the_unacked_bound_and_releasing_it_resumes():
    cfg = load_config(overrides=["algo=dqn", "env.id=CartPole-v1", "actor.envs_per_actor=2",
                                 "actor.chunk_transitions=16", "actor.max_unacked_transitions=64",
                                 "dqn.n_step=1"])
    replay = HeldReplay()
    actor = Actor(cfg, env_spec(cfg.env), "actor-bp", replay=replay,
                  paramserver=NoWeightsServer())
    actor.start()
    stop = threading.Event()
    loop = threading.Thread(target=actor.run, args=(stop,), daemon=True)
    loop.start()
    try:
        # held: the loop stalls once 64 transitions (4 chunks) await acknowledgement
        assert _wait_until(lambda: actor._unacked >= 64)
        time.sleep(0.5)
        held_steps = actor.stats.env_steps
        time.sleep(0.5)
        assert actor.stats.env_steps == held_steps
        # a chunk's worth of steps (plus the scoring step) may be built beyond the bound
        assert held_steps <= 64 + 16 + 2 * 2
        assert actor._unacked == 64 and replay.acknowledged == 0
        replay.open.set()
        assert _wait_until(lambda: actor.stats.env_steps > held_steps + 500)
        assert replay.acknowledged > 500
    finally:
        stop.set()
        loop.join(timeout=10)
        actor.stop()
    assert not loop.is_alive()


class RefusingReplay:
    """Refuses the first ``refusals`` inserts with the given error, then stores; records
    when each try came and what it carried."""

    def __init__(self, error: type[errors.AmprlError], refusals: int):
        self.error, self.refusals = error, refusals
        self.tries: list[tuple[float, tuple]] = []
        self.stored: list = []

    def insert(self, actor_id, items, timeout=None, cancel=None, **numbering):
        items = list(items)
        self.numbering = numbering
        self.tries.append((time.monotonic(), tuple(id(chunk) for chunk, _, _ in items)))
        if len(self.tries) <= self.refusals:
            raise self.error("refused in this test")
        self.stored.extend(items)
        return types.SimpleNamespace(transitions_stored=sum(len(c.actions) for c, _, _ in items))


def test_a_refused_insert_is_resent_whole_after_growing_jittered_pauses():
    cfg = load_config(overrides=["algo=dqn", "env.id=CartPole-v1"])
    for error in (errors.ResourceExhausted, errors.Unavailable, errors.DeadlineExceeded):
        replay = RefusingReplay(error, refusals=3)
        actor = Actor(cfg, env_spec(cfg.env), "actor-retry", replay=replay,
                      paramserver=NoWeightsServer())
        items = [(make_chunk(actor.spec, 4, seed=i), None, 4, 1 + i) for i in range(2)]
        actor._insert(items)
        assert len(replay.tries) == 4 and replay.stored == [item[:3] for item in items], error
        assert replay.numbering == {"incarnation": actor.incarnation_id, "first_sequence": 1}
        assert len({carried for _, carried in replay.tries}) == 1  # the same items each time
        pauses = [b[0] - a[0] for a, b in zip(replay.tries, replay.tries[1:])]
        # first window 0.1 s (pause 0.05-0.1), then 0.2, 0.4: never at once, and growing
        assert pauses[0] >= 0.05 and pauses[2] >= 0.2, pauses
        assert actor.stats.insert_retries == 3 and actor.stats.insert_errors == 0
        assert actor.stats.transitions_sent == 8


class BuggyReplay:
    def insert(self, actor_id, items, timeout=None, cancel=None, **numbering):
        raise AttributeError("a bug in the sender's path")


def test_a_sender_that_died_ends_the_env_loop_with_the_cause_instead_of_hanging():
    cfg = load_config(overrides=["algo=dqn", "env.id=CartPole-v1", "actor.envs_per_actor=2",
                                 "actor.chunk_transitions=16", "actor.max_unacked_transitions=32"])
    actor = Actor(cfg, env_spec(cfg.env), "actor-bug", replay=BuggyReplay(),
                  paramserver=NoWeightsServer())
    actor.start()
    try:
        with pytest.raises(ThreadDied, match="send thread died: AttributeError"):
            actor.run(threading.Event(), max_steps=100_000)
    finally:
        actor.stop()
