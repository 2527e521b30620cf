"""Using what a run learned: ``amprl enjoy`` plays it, ``amprl export`` writes it out.

    amprl enjoy RUN_DIR [--episodes N] [--seed S]
    amprl export RUN_DIR -o policy.pt [--format torchscript|state_dict]
    amprl export --paramserver HOST:PORT --config CONFIG -o policy.pt   (a live run's weights)

The weights come from ``RUN_DIR/best/`` (the evaluator's best-scoring version, with the
config that rebuilds its network) or, with ``--paramserver``, from a running parameter
server over gRPC (e.g. through ``kubectl port-forward``). ``torchscript`` writes a module
that maps a batch of observations to actions (DQN: the greedy action; TD3: the actor's), so
three lines act without this package::

    import torch
    policy = torch.jit.load("policy.pt")
    action = policy(torch.as_tensor(obs).unsqueeze(0))[0]

``state_dict`` writes the plain tensors (``torch.load(path, weights_only=True)``), which
``amprl.algos.build_model(config)`` loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from amprl import algos, errors
from amprl.config import ExperimentConfig, load_config
from amprl.envs.episodes import play
from amprl.envs.factory import env_spec
from amprl.envs.spec import EnvSpec


class GreedyActions(torch.nn.Module):
    """Observations [B, *obs_shape] -> actions: argmax Q (discrete) or the actor's output."""

    def __init__(self, model: torch.nn.Module, discrete: bool):
        super().__init__()
        self.model = model
        self.discrete = discrete

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.model(obs)
        return out.argmax(dim=1) if self.discrete else out


def load_best(run_dir: Path) -> tuple[ExperimentConfig, dict, dict[str, torch.Tensor]]:
    """(config, best.json record, weights) of a run's best-scoring version."""
    best = run_dir / "best" / "best.json"
    if not best.exists():
        raise errors.ConfigError(f"{best}: no best weights in this run folder (the evaluator writes "
                                 f"them at its first evaluation)")
    record = json.loads(best.read_text())
    cfg = load_config(run_dir / "best" / record["config"])
    weights = torch.load(run_dir / "best" / record["weights"], weights_only=True)
    return cfg, record, weights


def build(cfg: ExperimentConfig, weights: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, EnvSpec]:
    spec = env_spec(cfg.env)
    model = algos.build_model(cfg, spec)
    model.load_state_dict(weights)
    return model.eval(), spec


def enjoy(run_dir: Path, episodes: int, seed: int) -> dict:
    """Greedy episodes of the run's best weights; the returns' mean and spread."""
    cfg, record, weights = load_best(run_dir)
    model, spec = build(cfg, weights)
    returns = play(algos.builder(cfg.algo).make_greedy_policy(model), spec, cfg.env, episodes, seed)
    return {"run": str(run_dir), "param_version": record["param_version"], "episodes": episodes,
            "mean_return": float(np.mean(returns)), "std_return": float(np.std(returns)),
            "returns": [round(r, 3) for r in returns]}


def export(cfg: ExperimentConfig, weights: dict[str, torch.Tensor], out: Path, fmt: str) -> None:
    model, spec = build(cfg, weights)
    if fmt == "state_dict":
        torch.save({n: t.detach().float().cpu() for n, t in model.state_dict().items()}, out)
        return
    model.requires_grad_(False)  # an inference module: its actions carry no graph
    example = torch.from_numpy(np.zeros((1, *spec.obs_shape), spec.frame_dtype))
    with torch.no_grad():
        traced = torch.jit.trace(GreedyActions(model, spec.discrete), example)
    traced.save(str(out))


def _pull(address: str) -> tuple[int, dict[str, torch.Tensor]]:
    from amprl.paramserver.client import ParameterClient
    with ParameterClient(address, client_id="export") as client:
        version, weights = client.pull(have_version=0, timeout=60.0)
    assert weights is not None  # have_version 0 always brings the weights
    return version, weights


def main(argv: list[str] | None = None, command: str = "enjoy") -> int:
    p = argparse.ArgumentParser(prog=f"amprl {command}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if command == "enjoy":
        p.add_argument("run_dir", type=Path)
        p.add_argument("--episodes", type=int, default=10)
        p.add_argument("--seed", type=int, default=12345)
    else:
        p.add_argument("run_dir", type=Path, nargs="?")
        p.add_argument("-o", "--output", type=Path, required=True)
        p.add_argument("--format", choices=["torchscript", "state_dict"], default="torchscript")
        p.add_argument("--paramserver", default="", metavar="HOST:PORT",
                       help="pull the weights from a running parameter server instead")
        p.add_argument("--config", default="", help="with --paramserver: the run's experiment file")
    args = p.parse_args(argv)
    try:
        if command == "enjoy":
            print(json.dumps(enjoy(args.run_dir, args.episodes, args.seed)))
            return 0
        if args.paramserver:
            if not args.config:
                raise errors.ConfigError("--paramserver needs --config (the run's experiment file, "
                                         "to rebuild the network)")
            cfg = load_config(args.config)
            version, weights = _pull(args.paramserver)
        elif args.run_dir is not None:
            cfg, record, weights = load_best(args.run_dir)
            version = record["param_version"]
        else:
            raise errors.ConfigError("name a run folder or --paramserver HOST:PORT")
        export(cfg, weights, args.output, args.format)
        print(json.dumps({"output": str(args.output), "format": args.format, "param_version": version}))
        return 0
    except errors.AmprlError as exc:
        print(f"amprl {command}: {exc}", file=sys.stderr)
        return 2


def enjoy_main(argv: list[str] | None = None) -> int:
    return main(argv, "enjoy")


def export_main(argv: list[str] | None = None) -> int:
    return main(argv, "export")
