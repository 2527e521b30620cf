"""``amprl learner``: sample from replay, train, push gradients to the parameter server."""

from __future__ import annotations

import logging
import sys

import torch

from amprl.common import cli
from amprl.common.bootstrap import ServiceProcess, wait_for_dependencies
from amprl.envs.factory import env_spec
from amprl.evaluator.client import RunEndWatch, work_until_run_ends
from amprl.learner.learner import Learner
from amprl.learner.service import register
from amprl.learner.telemetry import telemetry
from amprl.paramserver.client import ParameterClient
from amprl.replay import client as replay_client

log = logging.getLogger("amprl.learner")


def main(argv: list[str] | None = None) -> int:
    proc = ServiceProcess("learner", __doc__)
    args = proc.parse(argv)
    cfg = proc.setup(require=("replay", "paramserver"))
    torch.set_num_threads(cfg.deploy.learner_torch_threads)
    spec = env_spec(cfg.env)
    wait_for_dependencies(replay=cli.replay_addresses(args.replay), paramserver=args.paramserver)
    replay = replay_client.connect(args.replay)
    ps = ParameterClient(args.paramserver, client_id=f"learner:{args.id}")
    learner = Learner(cfg, spec, replay, ps, learner_id=args.id)
    learner.start()
    # the run's end, as the evaluator decides it: the learner then stops updating and idles
    watch = RunEndWatch(args.evaluator) if args.evaluator else None
    proc.serve(register(learner, watch), port=args.port or cfg.learner.port, telemetry=telemetry(learner))
    # readiness follows replay: NOT_SERVING while the learner cannot sample
    learner.on_replay = proc.set_ready
    log.info("learner on %s (precision %s), status port %d", learner.device, cfg.learner.precision,
             proc.port)
    try:
        return proc.run_until_stopped(
            lambda stop: work_until_run_ends(learner.run, stop, watch, learner.stop),
            grace_s=2.0, on_stop=learner.stop)
    finally:
        replay.close()
        ps.close()


if __name__ == "__main__":
    sys.exit(main())
