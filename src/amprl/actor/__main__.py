"""``amprl actor``: step environments, explore, stream n-step transitions to replay."""

from __future__ import annotations

import logging
import sys

import torch

from amprl.actor.actor import Actor
from amprl.actor.service import register
from amprl.common import cli
from amprl.common.grpcutil import create_server, wait_until_serving
from amprl.envs.factory import env_spec
from amprl.paramserver.client import ParameterClient
from amprl.replay import client as replay_client

log = logging.getLogger("amprl.actor")


def main(argv: list[str] | None = None) -> int:
    args = cli.base_parser("amprl actor", __doc__).parse_args(argv)
    cfg = cli.setup(args, "actor")
    if not args.replay or not args.paramserver:
        log.error("--replay and --paramserver (or AMPRL_REPLAY_ADDRESS / AMPRL_PARAMSERVER_ADDRESS) are required")
        return 2
    torch.set_num_threads(cfg.actor.torch_threads)
    actor_id = args.id
    spec = env_spec(cfg.env)
    for address in cli.replay_addresses(args.replay):
        wait_until_serving(address, timeout_s=120)
    wait_until_serving(args.paramserver, timeout_s=120)
    replay = replay_client.connect(args.replay)
    ps = ParameterClient(args.paramserver, client_id=f"actor:{actor_id}")
    actor = Actor(cfg, spec, actor_id, replay, ps)
    actor.start()
    server, port = create_server(register(actor), host=args.host, port=args.port)
    cli.write_port_file(args.port_file, port)
    log.info("actor %s: epsilon %.4f, %d envs", actor_id, actor.epsilon, len(actor.envs))
    def cleanup() -> None:
        actor.stop()
        server.stop(1).wait()

    return cli.run_until_stopped(actor.run, cleanup)

if __name__ == "__main__":
    sys.exit(main())
