"""The ``amprl`` command: one entry point, one subcommand per service.

  amprl run [CONFIG] [--set k=v ...]   the whole system as local processes
  amprl replay|paramserver|learner|actor|evaluator [flags]   one service (a pod's command)
  amprl enjoy RUN_DIR | export RUN_DIR -o policy.pt   use what a run learned
  amprl plot RUN_DIR... -o curves.png  eval return against env steps and wall time
  amprl fetch --evaluator H:P DIR      a live run's results (history, best weights, summary)
  amprl certs DIR                      a development CA and one certificate per role (mTLS)
  amprl status [RUN_DIR | --replay H:P ...] [--json]   health and progress of a running system

A mistake of the person running it (a missing or malformed config file, a bad value, an
algorithm that does not fit the environment, a service that cannot start) is one line on
stderr naming it, and exit status 2 (``errors.UsageError``); ``--debug``, before or after
the subcommand, shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys

from amprl import errors

DEBUG_ENV = "AMPRL_DEBUG"
"""Set to 1 by ``--debug``: the launcher logs at INFO and mistakes show their traceback."""

SERVICES = {
    "run": "amprl.launch.run",
    "replay": "amprl.replay.__main__",
    "paramserver": "amprl.paramserver.__main__",
    "learner": "amprl.learner.__main__",
    "actor": "amprl.actor.__main__",
    "evaluator": "amprl.evaluator.__main__",
    "enjoy": "amprl.launch.agent:enjoy_main",
    "export": "amprl.launch.agent:export_main",
    "plot": "amprl.launch.plot:main",
    "fetch": "amprl.launch.fetch:main",
    "certs": "amprl.common.certs:main",
    "status": "amprl.launch.status",
}
"""Subcommand -> the module whose ``main(argv)`` runs it (or ``module:function``)."""

USAGE = ("usage: amprl [--debug] {" + ",".join(SERVICES) + "} [args...]   (amprl SUBCOMMAND --help for its flags)\n"
         "       amprl --version")


def debug() -> bool:
    """Whether ``--debug`` was given (to this process or the ``amprl`` that started it)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        os.environ[DEBUG_ENV] = "1"
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import version
        print(f"amprl {version('amprl')}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SERVICES:
        print(f"amprl: unknown subcommand {name!r}\n{USAGE}", file=sys.stderr)
        return 2
    module_name, _, function = SERVICES[name].partition(":")
    try:
        module = importlib.import_module(module_name)
        return int(getattr(module, function or "main")(rest) or 0)
    except errors.UsageError as exc:
        if debug():
            raise
        kind = "config error: " if isinstance(exc, errors.ConfigError) else ""
        print(f"amprl {name}: {kind}{' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
