"""``python -m amprl.paramserver`` / ``amprl paramserver``: serve the run's parameters.

Builds the initial model exactly as every other process does (``torch.manual_seed(run.seed)``
then ``build_model``), resumes from the newest valid checkpoint in
``paramserver.checkpoint_dir`` (default ``<run-dir>/checkpoints``), serves until SIGTERM or
SIGINT, checkpoints every ``paramserver.checkpoint_interval_s`` seconds and once more after
the last call has finished.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from amprl.common import cli, grpcutil
from amprl.config import ExperimentConfig
from amprl.paramserver.checkpoint import CheckpointManager, PeriodicCheckpointer
from amprl.paramserver.service import build_store, create_server

log = logging.getLogger("amprl.paramserver")


def default_model(cfg: ExperimentConfig) -> nn.Module:
    from amprl.envs.factory import env_spec
    from amprl.rl.models import build_model

    return build_model(cfg, env_spec(cfg.env))


def checkpoint_dir(cfg: ExperimentConfig, run_dir: str) -> Path:
    if cfg.paramserver.checkpoint_dir:
        return Path(cfg.paramserver.checkpoint_dir)
    base = Path(run_dir) if run_dir else Path(cfg.run.run_dir) / cfg.name
    return base / "checkpoints"


def main(argv: list[str] | None = None,
         model_factory: Callable[[ExperimentConfig], nn.Module] | None = None) -> int:
    """Entry point. ``model_factory`` replaces ``build_model`` (tests use tiny models)."""
    parser = cli.base_parser("amprl paramserver", __doc__.splitlines()[0])
    args = parser.parse_args(argv)
    cfg = cli.setup(args, "paramserver")
    torch.manual_seed(cfg.run.seed)  # identical initial weights in every process
    model = (model_factory or default_model)(cfg)
    store = build_store(cfg, model)
    ckpt = None
    if cfg.paramserver.checkpoint_interval_s > 0:
        ckpt = CheckpointManager(checkpoint_dir(cfg, args.run_dir), keep=cfg.paramserver.checkpoints_kept)
        resumed = ckpt.restore(store)
        if resumed is None:
            log.info("no checkpoint in %s: starting from version 0", ckpt.directory)
    ps = create_server(cfg, store=store, host=args.host, port=args.port or cfg.paramserver.port)
    log.info("serving ParameterService on %s:%d (version %d, %d tensors, %d parameters)",
             args.host, ps.port, store.version, len(store.params), store.num_parameters)
    periodic = (PeriodicCheckpointer(ckpt, store, cfg.paramserver.checkpoint_interval_s).start()
                if ckpt else None)
    cli.write_port_file(args.port_file, ps.port)

    def on_stop() -> None:
        ps.servicer.close()  # end watch streams so the grace period is not spent on them
        if periodic:
            periodic.stop()

    grpcutil.wait_for_termination(ps.server, grace_s=5.0, on_stop=on_stop)
    if ckpt:
        # After server.stop(): every accepted push is in, no new one can arrive.
        ckpt.save(store)
    log.info("stopped at version %d", store.version)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
