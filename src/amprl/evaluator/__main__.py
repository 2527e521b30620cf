"""``amprl evaluator``: greedy evaluations of the newest weights every few seconds."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

import torch

from amprl.common import cli
from amprl.common.grpcutil import create_server, wait_until_serving
from amprl.envs.factory import env_spec
from amprl.evaluator.evaluator import Evaluator
from amprl.evaluator.service import register
from amprl.paramserver.client import ParameterClient

log = logging.getLogger("amprl.evaluator")


def main(argv: list[str] | None = None) -> int:
    args = cli.base_parser("amprl evaluator", __doc__).parse_args(argv)
    cfg = cli.setup(args, "evaluator")
    if not args.paramserver:
        log.error("--paramserver (or AMPRL_PARAMSERVER_ADDRESS) is required")
        return 2
    torch.set_num_threads(1)
    if args.run_dir:  # eval history goes here; a fresh volume may not have the folder yet
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    spec = env_spec(cfg.env)
    wait_until_serving(args.paramserver, timeout_s=120)
    ps = ParameterClient(args.paramserver, client_id=f"evaluator:{args.id}")
    replay = None
    if args.replay:
        from amprl.replay import client as replay_client
        replay = replay_client.connect(args.replay)
    evaluator = Evaluator(cfg, spec, ps, replay, run_dir=args.run_dir)
    server, port = create_server(register(evaluator), host=args.host, port=args.port or cfg.evaluator.port)
    cli.write_port_file(args.port_file, port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    evaluator.run(stop)
    server.stop(2).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
