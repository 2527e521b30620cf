"""The fault suite: one running system (see harness.py: real processes, real Redis, real
gRPC on loopback), broken one way per test, in this order. Each test asserts that training
goes on by itself (parameter version, env steps and a ledger actor's inserts advance within
RESUME_TIMEOUT_S of the fault's end) and, from the ledgers, that nothing acknowledged was
lost, nothing stored or applied twice, and no version went back within one server life.
The last test is the control: Redis comes back without its data, and the ledger must catch
the loss, or the suite could not fail.
"""

from __future__ import annotations

import json

import pytest

from .harness import CHECKPOINT_INTERVAL_S, FaultResult, fault_system

pytestmark = [pytest.mark.slow, pytest.mark.faults]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with fault_system(tmp_path_factory.mktemp("faults")) as sys_:
        yield sys_


def assert_clean(result: FaultResult, system) -> None:
    text = json.dumps(result.as_dict())
    assert not result.stalled, f"training did not resume: {text}"
    assert result.lost_acknowledged == 0, text
    assert result.duplicated == 0, text
    assert result.applied_twice == 0, text
    assert result.versions_back == 0, text
    assert result.notes["acknowledged"] > 0, text  # the ledger is not empty
    system.check_alive()


@pytest.mark.parametrize("service", ["actor", "evaluator", "learner", "replay"])
def test_kill_9_and_restart_of_a_service_loses_nothing(system, service):
    assert_clean(system.kill(service), system)


def test_kill_9_of_the_parameter_server_goes_back_at_most_a_checkpoint_interval(system):
    result = system.kill_paramserver()
    assert_clean(result, system)
    # actors, learners and the evaluator adopt the new life's weights at once (incarnation),
    # and what the crash cost is bounded by the checkpoint interval
    assert result.notes["incarnation_changed"]
    # versions advance at a few hundred per second here at most: the interval bounds the loss
    assert 0 <= result.notes["versions_rolled_back"] <= 1000 * CHECKPOINT_INTERVAL_S, result.notes


@pytest.mark.parametrize("direction", ["both", "down"])
@pytest.mark.parametrize("link", ["learner-paramserver", "actor-replay"])
def test_a_10_s_partition_loses_nothing_and_applies_nothing_twice(system, link, direction):
    """Cut both ways, or only the replies ("down": requests arrive and are stored or
    applied, their acknowledgements are lost, so clients resend them)."""
    result = system.partition(link, direction=direction)
    assert_clean(result, system)
    assert not any(result.notes["crossed_while_cut"].values()), result.notes  # the cut held


@pytest.mark.parametrize("durability", ["everysec", "always"])
def test_kill_9_of_redis_loses_nothing_acknowledged(system, durability):
    if system.durability != durability:
        system.restart_replay(durability)
    assert_clean(system.kill_redis(), system)


def test_redis_losing_its_last_second_is_reconciled_and_the_loss_stays_in_that_second(system):
    """A machine crash under appendfsync everysec: Redis comes back without what it
    appended in its last second. Replay keeps serving (no crash loop), counts what is
    missing, and loses nothing acknowledged before that second (the documented bound)."""
    if system.durability != "everysec":
        system.restart_replay("everysec")
    result = system.kill_redis(cut_tail_s=1.0)
    text = json.dumps(result.as_dict())
    assert not result.stalled, text
    assert result.duplicated == 0 and result.applied_twice == 0, text
    assert result.notes["aof_bytes_cut"] > 0, text
    assert result.notes["lost_only_in_cut_window"], text
    # every chunk acknowledged within the cut window at most (the measured bound)
    assert result.lost_acknowledged <= result.notes["acked_in_cut_window"] + 1, text
    assert result.notes["replay_missing_transitions"] > 0, text
    system.check_alive()


def test_redis_at_maxmemory_refuses_inserts_as_resource_exhausted_then_resumes(system):
    result = system.redis_full()
    assert_clean(result, system)
    errors = result.notes["insert_errors"]
    assert errors.get("ResourceExhausted", 0) > 0, result.notes
    assert "Unavailable" not in errors, result.notes
    assert "maxmemory" in result.notes["message"] and "replay.capacity" in result.notes["message"]


@pytest.mark.parametrize("service", ["actor", "evaluator", "learner", "paramserver", "replay"])
def test_sigterm_drains_exits_0_and_loses_nothing(system, service):
    result = system.sigterm(service)
    assert result.notes["exit_code"] == 0, result.notes
    assert_clean(result, system)


def test_control_redis_back_without_its_data_is_caught_by_the_ledger(system):
    """Persistence lost (the AOF gone): the ledger must report acknowledged chunks lost,
    so the checks above can fail; replay still serves and training resumes."""
    result = system.kill_redis(wipe=True)
    assert result.lost_acknowledged > 0, json.dumps(result.as_dict())
    assert not result.stalled
    system.check_alive()
