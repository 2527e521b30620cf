"""What amprl run checks before it starts a process, and the one line it shows for a
service that fails at start (amprl.launch.startup)."""

from __future__ import annotations

import sys

import pytest

from amprl.config import load_config
from amprl.errors import ConfigError, UsageError
from amprl.launch.procs import spawn
from amprl.launch.startup import ServiceStartFailed, check_experiment, problem_line, wait_started


@pytest.mark.parametrize("overrides, message", [
    (["env.id=Pendulum-v1"], "algo: dqn needs a discrete action space, and env.id 'Pendulum-v1' has "
                             "continuous actions; use algo: td3"),
    (["algo=td3"], "algo: td3 needs a continuous action space"),
    (["env.kwargs.colour=red"], "env.kwargs: 'CartPole-v1' refused"),
])
def test_an_experiment_the_services_could_not_build_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_experiment(load_config(None, overrides))
    check_experiment(load_config(None, []))


def test_the_problem_line_is_the_exception_or_the_error_logged():
    traceback_log = ("2026-01-01 10:00:00,000 paramserver INFO amprl.paramserver: starting\n"
                     "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                     "    main()\n"
                     "amprl.errors.ConfigError: --init-weights w.pt: not this config's network\n\n")
    assert problem_line(traceback_log) == "amprl.errors.ConfigError: --init-weights w.pt: not this config's network"
    logged = "2026-01-01 10:00:00,000 learner ERROR amprl.learner: config error: learner.batch_size: 0 must be >= 1\n"
    assert problem_line(logged) == "config error: learner.batch_size: 0 must be >= 1"
    assert problem_line("") == "(its log is empty)"


def test_a_service_that_exits_at_start_is_one_line_naming_it(tmp_path):
    svc = spawn("learner", [sys.executable, "-c", "raise SystemExit('learner: no GPU named cuda:3')"],
                tmp_path / "learner.log", port_file=tmp_path / ".learner.port")
    with pytest.raises(ServiceStartFailed) as failed:
        wait_started(svc, timeout_s=30)
    assert isinstance(failed.value, UsageError)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("service learner failed at start (exit code 1): learner: no GPU named cuda:3")
    assert str(tmp_path / "learner.log") in message
