"""``amprl learner``: sample from replay, train, push gradients to the parameter server."""

from __future__ import annotations

import logging
import sys

import torch

from amprl.common import cli
from amprl.common.grpcutil import create_server, set_health, wait_until_serving
from amprl.envs.factory import env_spec
from amprl.learner.learner import Learner
from amprl.learner.service import register
from amprl.paramserver.client import ParameterClient
from amprl.replay import client as replay_client

log = logging.getLogger("amprl.learner")


def main(argv: list[str] | None = None) -> int:
    args = cli.base_parser("amprl learner", __doc__).parse_args(argv)
    cfg = cli.setup(args, "learner")
    if not args.replay or not args.paramserver:
        log.error("--replay and --paramserver (or AMPRL_REPLAY_ADDRESS / AMPRL_PARAMSERVER_ADDRESS) are required")
        return 2
    torch.set_num_threads(cfg.learner.torch_threads)
    spec = env_spec(cfg.env)
    for address in cli.replay_addresses(args.replay):
        wait_until_serving(address, timeout_s=120)
    wait_until_serving(args.paramserver, timeout_s=120)
    replay = replay_client.connect(args.replay)
    ps = ParameterClient(args.paramserver, client_id=f"learner:{args.id}")
    learner = Learner(cfg, spec, replay, ps, learner_id=args.id)
    learner.start()
    server, port = create_server(register(learner), host=args.host, port=args.port or cfg.learner.port)
    # readiness follows replay: NOT_SERVING while the learner cannot sample
    learner.on_replay = lambda reachable: set_health(server, serving=reachable)
    cli.write_port_file(args.port_file, port)
    log.info("learner on %s (precision %s), status port %d", learner.device, cfg.learner.precision, port)
    def cleanup() -> None:
        learner.stop()
        server.stop(2).wait()
        replay.close()
        ps.close()

    return cli.run_until_stopped(learner.run, cleanup)

if __name__ == "__main__":
    sys.exit(main())
