"""``amprl actor``: step environments, explore, stream n-step transitions to replay."""

from __future__ import annotations

import logging
import sys

import torch

from amprl.actor.actor import Actor
from amprl.actor.service import register
from amprl.actor.telemetry import telemetry
from amprl.common import cli
from amprl.common.bootstrap import ServiceProcess, wait_for_dependencies
from amprl.envs.factory import env_spec
from amprl.evaluator.client import RunEndWatch, work_until_run_ends
from amprl.paramserver.client import ParameterClient
from amprl.replay import client as replay_client

log = logging.getLogger("amprl.actor")


def main(argv: list[str] | None = None) -> int:
    proc = ServiceProcess("actor", __doc__)
    args = proc.parse(argv)
    cfg = proc.setup(require=("replay", "paramserver"))
    torch.set_num_threads(cfg.deploy.actor_torch_threads)
    actor_id = args.id
    spec = env_spec(cfg.env)
    wait_for_dependencies(replay=cli.replay_addresses(args.replay), paramserver=args.paramserver)
    replay = replay_client.connect(args.replay)
    ps = ParameterClient(args.paramserver, client_id=f"actor:{actor_id}")
    actor = Actor(cfg, spec, actor_id, replay, ps)
    actor.start()
    # the run's end, as the evaluator decides it: the actor then stops stepping and idles
    watch = RunEndWatch(args.evaluator) if args.evaluator else None
    proc.serve(register(actor, watch), port=args.port, telemetry=telemetry(actor))
    log.info("actor %s: epsilon %.4f, %d envs", actor_id, actor.epsilon, len(actor.envs))
    return proc.run_until_stopped(lambda stop: work_until_run_ends(actor.run, stop, watch, actor.stop),
                                  grace_s=1.0, on_stop=actor.stop)


if __name__ == "__main__":
    sys.exit(main())
