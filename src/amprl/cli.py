"""The ``amprl`` command: one entry point, one subcommand per service.

  amprl run [CONFIG] [--set k=v ...]   the whole system as local processes
  amprl replay|paramserver|learner|actor|evaluator [flags]   one service (a pod's command)
  amprl enjoy RUN_DIR | export RUN_DIR -o policy.pt   use what a run learned
  amprl plot RUN_DIR... -o curves.png  eval return against env steps and wall time
  amprl certs DIR                      a development CA and one certificate per role (mTLS)
  amprl status [RUN_DIR | --replay H:P ...] [--json]   health and progress of a running system
"""

from __future__ import annotations

import importlib
import sys

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
    "certs": "amprl.common.certs:main",
    "status": "amprl.launch.status",
}
"""Subcommand -> the module whose ``main(argv)`` runs it (or ``module:function``)."""

USAGE = ("usage: amprl {" + ",".join(SERVICES) + "} [args...]   (amprl SUBCOMMAND --help for its flags)\n"
         "       amprl --version")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    module = importlib.import_module(module_name)
    return int(getattr(module, function or "main")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
