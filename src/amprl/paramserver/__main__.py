"""``python -m amprl.paramserver`` / ``amprl paramserver``: serve the run's parameters.

Builds the initial model exactly as every other process does (``torch.manual_seed(run.seed)``
then ``build_model``), resumes from the newest valid checkpoint in
``paramserver.checkpoint_dir`` (default ``<run-dir>/checkpoints``), serves until SIGTERM or
SIGINT, checkpoints every ``paramserver.checkpoint_interval_s`` seconds (or every
``paramserver.checkpoint_interval_versions`` versions, whichever comes first) and once more
after the last call has finished.

Besides the base flags (``amprl.common.cli``):

  --pull-port PORT       AMPRL_PULL_PORT       also serve the read-only pull port (Pull,
                                               Watch, Info; pushes PERMISSION_DENIED)
  --pull-port-file PATH                        write the bound pull port here once serving
  --live-window-s S      AMPRL_LIVE_WINDOW_S   Info's live-client window (default 60)
  --follow ADDRESS       AMPRL_FOLLOW          run as a pull-only follower of the parameter
                                               server at ADDRESS (its pull port): no
                                               optimizer, no checkpoints, pushes
                                               PERMISSION_DENIED; serves Pull, Watch and
                                               Info on --port (``amprl.paramserver.follower``)
  --init-weights PATH    AMPRL_INIT_WEIGHTS    start from these weights (a state dict such as
                                               RUN/best/weights-v*.pt, or a checkpoint file)
                                               with a new optimizer at version 0, when the
                                               checkpoint folder holds none (amprl run
                                               --init-from)
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from amprl.common import cli
from amprl.common.bootstrap import Renewal, ServiceProcess
from amprl.config import ExperimentConfig
from amprl.errors import ConfigError
from amprl.paramserver.checkpoint import CheckpointManager, PeriodicCheckpointer, read_weights
from amprl.paramserver.follower import create_follower
from amprl.paramserver.service import build_store, create_server
from amprl.paramserver.telemetry import telemetry
from amprl.paramserver.weights import DEFAULT_LIVE_WINDOW_S

log = logging.getLogger("amprl.paramserver")


def default_model(cfg: ExperimentConfig) -> nn.Module:
    from amprl.algos import build_model
    from amprl.envs.factory import env_spec

    return build_model(cfg, env_spec(cfg.env))


def checkpoint_dir(cfg: ExperimentConfig, run_dir: str) -> Path:
    if cfg.paramserver.checkpoint_dir:
        return Path(cfg.paramserver.checkpoint_dir)
    base = Path(run_dir) if run_dir else Path(cfg.run.run_dir) / cfg.name
    return base / "checkpoints"


def init_weights(model: nn.Module, path: str) -> None:
    """Loads the weights in ``path`` into ``model``; ConfigError if they are another
    network's."""
    try:
        model.load_state_dict(read_weights(path))
    except RuntimeError as exc:  # missing, unexpected or differently shaped parameters
        problem = " ".join(str(exc).split())
        raise ConfigError(f"--init-weights {path}: not this config's network ({problem[:300]})") from exc
    log.info("initial weights from %s", path)


def main(argv: list[str] | None = None,
         model_factory: Callable[[ExperimentConfig], nn.Module] | None = None) -> int:
    """Entry point. ``model_factory`` replaces ``build_model`` (tests use tiny models)."""
    # One thread: Adam on a model this size is memory-bound, and idle OpenMP workers
    # spin-waiting cost more CPU than the step itself on a shared 2-core box.
    torch.set_num_threads(1)
    proc = ServiceProcess("paramserver", __doc__.splitlines()[0])
    parser = proc.parser
    env = os.environ.get
    parser.add_argument("--pull-port", type=int, default=int(env("AMPRL_PULL_PORT") or -1),
                        help="also serve PullParameters/WatchParameters/Info (no pushes) on "
                             "this port (0 = any free port; default: no pull port)")
    parser.add_argument("--pull-port-file", default="",
                        help="write the bound pull port to this file")
    parser.add_argument("--live-window-s", type=float,
                        default=float(env("AMPRL_LIVE_WINDOW_S") or DEFAULT_LIVE_WINDOW_S),
                        help="a client counts as live in Info if it called within this many seconds")
    parser.add_argument("--follow", default=env("AMPRL_FOLLOW", ""), metavar="ADDRESS",
                        help="serve as a pull-only follower of the parameter server at ADDRESS")
    parser.add_argument("--init-weights", default=env("AMPRL_INIT_WEIGHTS", ""), metavar="PATH",
                        help="start from these weights (state dict or checkpoint file) when "
                             "there is no checkpoint to resume")
    args = proc.parse(argv)
    if args.follow and args.pull_port >= 0:
        parser.error("--pull-port: a follower serves only reads, on --port; drop --pull-port "
                     "(or AMPRL_PULL_PORT) or --follow")
    cfg = proc.setup()
    if args.live_window_s <= 0:
        parser.error(f"--live-window-s {args.live_window_s}: must be > 0")
    torch.manual_seed(cfg.run.seed)  # identical initial weights in every process
    model = (model_factory or default_model)(cfg)
    if args.follow:
        return follow(proc, cfg, model)
    if args.init_weights:  # a checkpoint of this run, restored below, wins over them
        init_weights(model, args.init_weights)
    store = build_store(cfg, model, live_window_s=args.live_window_s)
    ckpt = None
    if cfg.paramserver.checkpoint_interval_s > 0 or cfg.paramserver.checkpoint_interval_versions > 0:
        ckpt = CheckpointManager(checkpoint_dir(cfg, args.run_dir), keep=cfg.paramserver.checkpoints_kept)
        resumed = ckpt.restore(store)
        if resumed is None:
            log.info("no checkpoint in %s: starting from version 0", ckpt.directory)
    ps = create_server(cfg, store=store, host=args.host, port=args.port or cfg.paramserver.port,
                       pull_port=args.pull_port if args.pull_port >= 0 else None)
    log.info("serving ParameterService on %s:%d (version %d, %d tensors, %d parameters)",
             args.host, ps.port, store.version, len(store.params), store.num_parameters)
    if ps.pull_server is not None:
        log.info("serving the pull-only port on %s:%d", args.host, ps.pull_port)
        cli.write_port_file(args.pull_port_file, ps.pull_port)
    periodic = (PeriodicCheckpointer(ckpt, store, cfg.paramserver.checkpoint_interval_s,
                                     cfg.paramserver.checkpoint_interval_versions).start()
                if ckpt else None)
    proc.attach(ps.server, ps.port, telemetry(ps.servicer))

    pull_stopped = []

    def on_stop() -> None:
        ps.servicer.close()  # end watch streams so the grace period is not spent on them
        if ps.pull_server is not None:
            # grpcutil.create_server attaches health_servicer to the grpc.Server
            ps.pull_server.health_servicer.enter_graceful_shutdown()  # type: ignore[attr-defined]
            pull_stopped.append(ps.pull_server.stop(5.0))
        if periodic:
            periodic.stop()

    # the primary dials no one: its servers re-read a renewed certificate in place
    proc.run_until_stopped(grace_s=5.0, drain=True, on_stop=on_stop, renewal=Renewal.RELOAD)
    for event in pull_stopped:
        event.wait()
    if ckpt:
        # After server.stop(): every accepted push is in, no new one can arrive.
        ckpt.save(store)
    c = store.counters
    accepted = c.pushes_applied + c.pushes_scaled
    log.info("stopped at version %d (pushes accepted %d, mean staleness %.2f, max %d)", store.version,
             accepted, c.staleness_sum / max(1, accepted), c.max_staleness_accepted)
    return 0


def follow(proc: ServiceProcess, cfg: ExperimentConfig, model: nn.Module) -> int:
    """Serves as a pull-only follower until SIGTERM/SIGINT; 1 when following failed for
    good (the main server's weights do not fit the model)."""
    args = proc.args
    fs = create_follower(model, args.follow, client_id=f"follower:{args.id}", host=args.host,
                         port=args.port or cfg.paramserver.port, live_window_s=args.live_window_s,
                         on_fatal=lambda exc: os.kill(os.getpid(), signal.SIGTERM))
    log.info("serving ParameterService as a pull-only follower of %s on %s:%d (%d tensors, "
             "%d parameters); NOT_SERVING until its first weights", args.follow, args.host,
             fs.port, len(fs.server.store.params), fs.server.store.num_parameters)
    proc.attach(fs.server.server, fs.port, telemetry(fs.server.servicer))

    def on_stop() -> None:
        fs.follower.stop()
        fs.server.servicer.close()  # end watch streams so the grace period is not spent on them

    proc.run_until_stopped(grace_s=5.0, drain=True, on_stop=on_stop)
    if fs.follower.error is not None:
        log.error("stopped: %s", fs.follower.error)
        return 1
    log.info("stopped at version %d (%d pulls from %s)", fs.server.store.version,
             fs.follower.pulls, args.follow)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
