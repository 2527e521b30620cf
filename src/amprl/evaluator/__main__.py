"""``amprl evaluator``: greedy evaluations of the newest weights every few seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from amprl.common.bootstrap import ServiceProcess, wait_for_dependencies
from amprl.envs.factory import env_spec
from amprl.evaluator.evaluator import Evaluator
from amprl.evaluator.service import register
from amprl.evaluator.telemetry import telemetry
from amprl.paramserver.client import ParameterClient


def main(argv: list[str] | None = None) -> int:
    proc = ServiceProcess("evaluator", __doc__)
    args = proc.parse(argv)
    cfg = proc.setup(require=("paramserver",))
    torch.set_num_threads(1)
    if args.run_dir:  # eval history goes here; a fresh volume may not have the folder yet
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    spec = env_spec(cfg.env)
    wait_for_dependencies(paramserver=args.paramserver)
    ps = ParameterClient(args.paramserver, client_id=f"evaluator:{args.id}")
    replay = None
    if args.replay:
        from amprl.replay import client as replay_client
        replay = replay_client.connect(args.replay)
    evaluator = Evaluator(cfg, spec, ps, replay, run_dir=args.run_dir)
    proc.serve(register(evaluator), port=args.port or cfg.evaluator.port, telemetry=telemetry(evaluator))
    evaluator.on_evaluation = lambda _evaluation: proc.record_now()  # each one in TensorBoard
    return proc.run_until_stopped(evaluator.run, grace_s=2.0)


if __name__ == "__main__":
    sys.exit(main())
