"""The stop rule of a run (``amprl.common.runend``): target, then step budget, then wall
time; and the summary every run leaves."""

from __future__ import annotations

import pytest

from amprl.common import runend
from amprl.config import load_config
from amprl.v1 import telemetry_pb2

T = telemetry_pb2


def run_section(**values):
    return load_config(None, [f"run.{k}={v}" for k, v in values.items()]).run


@pytest.mark.parametrize("run, env_steps, returns, wall, expected", [
    (dict(total_env_steps=1000, target_return=10, stop_at_target="true"), 10, [3.0, 10.0], 1.0,
     T.STOP_REASON_TARGET_REACHED),
    # the target counts only with stop_at_target
    (dict(total_env_steps=1000, target_return=10, stop_at_target="false"), 10, [30.0], 1.0,
     T.STOP_REASON_UNSPECIFIED),
    (dict(total_env_steps=1000), 1000, [], 1.0, T.STOP_REASON_STEP_BUDGET),
    (dict(total_env_steps=1000, max_wall_seconds=60), 999, [], 60.0, T.STOP_REASON_WALL_LIMIT),
    # 0 = no wall limit
    (dict(total_env_steps=1000, max_wall_seconds=0), 999, [], 1e9, T.STOP_REASON_UNSPECIFIED),
    # all three met: the target is named first, then the budget
    (dict(total_env_steps=10, target_return=1, stop_at_target="true", max_wall_seconds=1), 10, [2.0], 5.0,
     T.STOP_REASON_TARGET_REACHED),
    (dict(total_env_steps=10, max_wall_seconds=1), 10, [], 5.0, T.STOP_REASON_STEP_BUDGET),
], ids=["target", "target-off", "budget", "wall", "no-wall-limit", "target-first", "budget-before-wall"])
def test_the_rule_names_the_first_condition_met(run, env_steps, returns, wall, expected):
    assert runend.stop_reason(run_section(**run), env_steps=env_steps, returns=returns,
                              wall_seconds=wall) == expected


def test_an_unknown_step_count_leaves_the_budget_unjudged():
    run = run_section(total_env_steps=1, max_wall_seconds=10)
    assert runend.stop_reason(run, env_steps=None, returns=[], wall_seconds=1.0) == T.STOP_REASON_UNSPECIFIED
    assert runend.stop_reason(run, env_steps=None, returns=[], wall_seconds=10.0) == T.STOP_REASON_WALL_LIMIT


def test_the_summary_counts_time_and_steps_to_target_from_the_first_evaluation_that_reached_it(tmp_path):
    cfg = load_config(None, ["run.target_return=100"])
    evals = [T.Evaluation(param_version=v, mean_return=r, std_return=1.0, env_steps=s, wall_seconds=w)
             for v, r, s, w in [(1, 20.0, 100, 1.0), (2, 120.0, 200, 2.5), (3, 90.0, 300, 4.0)]]
    s = runend.summary(cfg, "step budget reached", evals, env_steps=350, param_version=4,
                       wall_seconds=5.0, replay_size=300, run_dir=tmp_path)
    assert s["solved"] and s["time_to_target_seconds"] == 2.5 and s["steps_to_target"] == 200
    assert s["final_eval_return"] == 90.0 and s["best_eval_return"] == 120.0 and s["evaluations"] == 3
    assert s["stop_reason"] == "step budget reached" and s["env_steps"] == 350 and s["replay_size"] == 300
    assert "best" not in s  # no best/ in the folder
    empty = runend.summary(cfg, "wall-clock limit reached", [], env_steps=0, param_version=0, wall_seconds=1)
    assert not empty["solved"] and empty["final_eval_return"] is None and empty["best_eval_return"] is None
