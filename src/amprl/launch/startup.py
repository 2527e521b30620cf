"""What ``amprl run`` checks before it starts any process, and how it reports a service
that does not come up.

``check_experiment`` builds the environment once, as every service will (the modules of
``env.import``, the id, ``env.kwargs``), and checks that the algorithm fits its action
space, so that a mistake is one line naming it (``errors.ConfigError``, exit status 2)
instead of six services failing one after another. ``wait_started`` turns a service that
exits (or never serves) at start into ``ServiceStartFailed``: the last line of its log,
which names the problem, and where the whole log is.
"""

from __future__ import annotations

import re

from amprl import algos, errors
from amprl.config import ExperimentConfig
from amprl.envs.factory import env_spec
from amprl.launch.procs import Service, wait_for_port


class ServiceStartFailed(errors.UsageError):
    """A service of ``amprl run`` exited, or did not serve, at start."""


def check_experiment(cfg: ExperimentConfig) -> None:
    """ConfigError where the services would fail to build the environment or the
    algorithm's network for it."""
    spec = env_spec(cfg.env)
    algos.check_action_space(cfg.algo, spec, cfg.env.id)


# "<date> <time> <service> ERROR <logger>: message" (amprl.common.cli's text format)
_LOG_PREFIX = re.compile(r"^\S+ \S+ \S+ (?:ERROR|CRITICAL|WARNING) \S+: ")


def problem_line(log_text: str) -> str:
    """The line of a service's log that names why it stopped: the last one that is not a
    traceback's frame or source line (an exception, or an error logged), without the
    logging prefix."""
    lines = [line for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith((" ", "\t", "Traceback ")):
            return _LOG_PREFIX.sub("", line)
    return "(its log is empty)"


def wait_started(svc: Service, timeout_s: float = 120.0) -> int:
    """``wait_for_port``, with a service that exits first or never serves reported as
    ``ServiceStartFailed`` naming the service, the problem and its log."""
    try:
        return wait_for_port(svc, timeout_s)
    except RuntimeError:  # it exited before serving
        raise ServiceStartFailed(
            f"service {svc.name} failed at start (exit code {svc.returncode}): "
            f"{problem_line(svc.log())} (log: {svc.log_path})") from None
    except TimeoutError:
        raise ServiceStartFailed(f"service {svc.name} did not start serving within "
                                 f"{timeout_s:.0f} s (log: {svc.log_path})") from None
