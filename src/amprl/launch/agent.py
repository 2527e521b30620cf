"""Using what a run learned: ``amprl enjoy`` plays it, ``amprl export`` writes it out.

    amprl enjoy RUN_DIR [--episodes N] [--seed S] [--render | --video out.mp4] [--best | --final]
    amprl export RUN_DIR -o policy.pt [--format torchscript|exported_program|state_dict] [--best | --final]
    amprl export --paramserver HOST:PORT --config CONFIG -o policy.pt [--certs DIR]
                                                              (a live run's newest weights)

The weights are the run's best-scoring version (``--best``, the default: ``RUN_DIR/best/``,
kept by the evaluator with the config that rebuilds its network) or its last one
(``--final``: the newest parameter-server checkpoint in ``RUN_DIR/checkpoints/``, read with
``torch.load(weights_only=True)`` after its checksum), or with ``--paramserver`` a running
parameter server's, pulled over gRPC (e.g. through ``kubectl port-forward``; with mutual TLS
as the operator: ``--certs DIR`` for DIR/operator as ``amprl certs DIR`` makes it). A live
run's best weights come with ``amprl fetch --evaluator HOST:PORT DIR`` and then
``amprl export DIR``.

``enjoy`` prints the greedy episodes' mean and spread of return as one JSON line.
``--render`` shows each episode in a window (a display is needed); ``--video out.mp4`` writes
the first episode as an MP4 (the env's own picture, e.g. the Atari screen rather than the
stacked 84x84 observation; MuJoCo renders offscreen with ``MUJOCO_GL=egl`` or ``osmesa``).

``export`` writes a module that maps a batch of observations to actions (DQN: the greedy
action; TD3: the actor's), which acts without this package::

    import torch
    policy = torch.jit.load("policy.pt")
    action = policy(torch.as_tensor(obs).unsqueeze(0))[0]

That is ``--format torchscript`` (the default; it loads in C++ through libtorch as well).
PyTorch 2.13 deprecates making TorchScript (loading it is silent), so ``--format
exported_program -o policy.pt2`` writes its successor, a ``torch.export`` program:
``policy = torch.export.load("policy.pt2").module()``, the other two lines the same.
``--format state_dict`` writes the plain tensors (``torch.load(path, weights_only=True)``),
which ``amprl.algos.build_model(config, spec)`` loads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import gymnasium as gym
import numpy as np
import torch

from amprl import algos, errors
from amprl.config import ExperimentConfig, load_config
from amprl.envs.episodes import play
from amprl.envs.factory import env_spec, suite
from amprl.envs.spec import EnvSpec

FORMATS = ("torchscript", "exported_program", "state_dict")
"""``amprl export --format``: TorchScript, a torch.export program (.pt2), or plain tensors."""


class GreedyActions(torch.nn.Module):
    """Observations [B, *obs_shape] -> actions: argmax Q (discrete) or the actor's output."""

    def __init__(self, model: torch.nn.Module, discrete: bool):
        super().__init__()
        self.model = model
        self.discrete = discrete

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.model(obs)
        return out.argmax(dim=1) if self.discrete else out


class Weights(NamedTuple):
    """One version of a run's weights with the config that rebuilds its network."""
    cfg: ExperimentConfig
    version: int
    tensors: dict[str, torch.Tensor]
    source: str
    """"best", "final" or "paramserver"."""


def load_best(run_dir: Path) -> Weights:
    """The run's best-scoring version (``RUN_DIR/best/``, written by the evaluator)."""
    best = run_dir / "best" / "best.json"
    if not best.exists():
        raise errors.ConfigError(f"{best}: no best weights in this run folder (the evaluator writes "
                                 f"them at its first evaluation)")
    record = json.loads(best.read_text())
    cfg = load_config(run_dir / "best" / record["config"])
    tensors = torch.load(run_dir / "best" / record["weights"], weights_only=True)
    return Weights(cfg, int(record["param_version"]), tensors, "best")


def load_final(run_dir: Path) -> Weights:
    """The run's newest readable parameter-server checkpoint (the final one of a finished run)."""
    from amprl.paramserver.client import checkpointed_weights

    config = run_dir / "config.yaml"
    if not config.exists():
        raise errors.ConfigError(f"{config}: not a run folder (amprl run writes config.yaml)")
    cfg = load_config(config)
    try:
        version, tensors, skipped = checkpointed_weights(cfg, str(run_dir))
    except FileNotFoundError as exc:
        raise errors.ConfigError(f"{exc}; the parameter server writes one every "
                                 f"paramserver.checkpoint_interval_s and at shutdown") from None
    for line in skipped:
        print(f"amprl: skipped checkpoint {line}", file=sys.stderr)
    return Weights(cfg, version, tensors, "final")


def load_weights(run_dir: Path, final: bool) -> Weights:
    return load_final(run_dir) if final else load_best(run_dir)


def build(cfg: ExperimentConfig, weights: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, EnvSpec]:
    spec = env_spec(cfg.env)
    model = algos.build_model(cfg, spec)
    model.load_state_dict(weights)
    return model.eval(), spec


def check_display(cfg: ExperimentConfig, human: bool, video: Path | None) -> None:
    """Fails early, naming the fix, where a window or an offscreen picture cannot be drawn."""
    if human and video is not None:
        raise errors.ConfigError("--render and --video: choose one (an env renders either to a "
                                 "window or to frames)")
    shown = any(os.environ.get(k) for k in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER"))
    if human and sys.platform.startswith("linux") and not shown:
        raise errors.ConfigError("--render opens a window and no display is set (DISPLAY); "
                                 "--video out.mp4 records an episode instead")
    if (video is not None and suite(cfg.env.id) == "mujoco" and not os.environ.get("MUJOCO_GL")
            and not os.environ.get("DISPLAY")):
        raise errors.ConfigError("--video with MuJoCo renders offscreen: set MUJOCO_GL=egl (a GPU "
                                 "driver's EGL) or MUJOCO_GL=osmesa (software, libOSMesa)")


def enjoy(run_dir: Path, episodes: int, seed: int, *, final: bool = False, human: bool = False,
          video: Path | None = None) -> dict:
    """Greedy episodes of the run's best (or final) weights; the returns' mean and spread."""
    if episodes < 1:
        raise errors.ConfigError(f"--episodes {episodes}: must be >= 1")
    w = load_weights(run_dir, final)
    check_display(w.cfg, human, video)
    model, spec = build(w.cfg, w.tensors)
    policy = algos.builder(w.cfg.algo).make_greedy_policy(model)
    returns = play(policy, spec, w.cfg.env, episodes, seed, human=human, video=video)
    result = {"run": str(run_dir), "weights": w.source, "param_version": w.version,
              "episodes": episodes, "mean_return": float(np.mean(returns)),
              "std_return": float(np.std(returns)), "returns": [round(r, 3) for r in returns]}
    if video is not None:
        result["video"] = str(video)
    return result


def export(cfg: ExperimentConfig, weights: dict[str, torch.Tensor], out: Path, fmt: str) -> None:
    """Writes ``weights`` to ``out`` in format ``fmt`` (one of FORMATS; module docstring)."""
    if fmt not in FORMATS:
        raise errors.ConfigError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "exported_program" and out.suffix != ".pt2":
        # torch.export.load warns about, and a later release may refuse, any other name
        raise errors.ConfigError(f"-o {out}: a torch.export program is a .pt2 archive; "
                                 f"name it {out.with_suffix('.pt2').name}")
    model, spec = build(cfg, weights)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "state_dict":
        torch.save({n: t.detach().float().cpu() for n, t in model.state_dict().items()}, out)
        return
    model.requires_grad_(False)  # an inference module: its actions carry no graph
    greedy = GreedyActions(model, spec.discrete)
    # batch 2: an example batch of 1 would let torch.export specialize the batch size to 1
    example = torch.from_numpy(np.zeros((2, *spec.obs_shape), spec.frame_dtype))
    with torch.no_grad():
        if fmt == "exported_program":
            batch = torch.export.Dim("batch")
            program = torch.export.export(greedy, (example,), dynamic_shapes=({0: batch},))
            torch.export.save(program, out)
            return
        with warnings.catch_warnings():
            # asked for by name: TorchScript is what libtorch (C++) loads, deprecated or not
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=DeprecationWarning)
            torch.jit.trace(greedy, example).save(str(out))


def _pull(address: str) -> tuple[int, dict[str, torch.Tensor]]:
    from amprl.paramserver.client import ParameterClient
    with ParameterClient(address, client_id="export") as client:
        version, weights = client.pull(have_version=0, timeout=60.0)
    assert weights is not None  # have_version 0 always brings the weights
    return version, weights


def parse_args(argv: list[str] | None, command: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"amprl {command}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if command == "enjoy":
        p.add_argument("run_dir", type=Path)
        p.add_argument("--episodes", type=int, default=10, help="greedy episodes played (default 10)")
        p.add_argument("--seed", type=int, default=12345, help="seed of the first episode's env")
        p.add_argument("--render", action="store_true", help="show each episode in a window")
        p.add_argument("--video", type=Path, default=None, metavar="OUT.mp4",
                       help="write the first episode as an MP4")
    else:
        p.add_argument("run_dir", type=Path, nargs="?")
        p.add_argument("-o", "--output", type=Path, required=True)
        p.add_argument("--format", choices=FORMATS, default="torchscript")
        p.add_argument("--paramserver", default="", metavar="HOST:PORT",
                       help="pull the weights from a running parameter server instead")
        p.add_argument("--config", default="", help="with --paramserver: the run's experiment file")
        p.add_argument("--certs", type=Path, default=None, metavar="DIR",
                       help="with --paramserver: mutual TLS with DIR/operator (`amprl certs DIR`)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--best", dest="final", action="store_false", default=False,
                       help="the best-scoring version the evaluator kept (default)")
    which.add_argument("--final", dest="final", action="store_true",
                       help="the newest parameter-server checkpoint (the run's last weights)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, command: str = "enjoy") -> int:
    args = parse_args(argv, command)
    try:
        if command == "enjoy":
            print(json.dumps(enjoy(args.run_dir, args.episodes, args.seed, final=args.final,
                                   human=args.render, video=args.video)))
            return 0
        if args.paramserver:
            if not args.config:
                raise errors.ConfigError("--paramserver needs --config (the run's experiment file, "
                                         "to rebuild the network)")
            if args.certs is not None:
                from amprl.launch.status import use_certificate
                use_certificate(args.certs / "operator")
            version, tensors = _pull(args.paramserver)
            w = Weights(load_config(args.config), version, tensors, "paramserver")
        elif args.run_dir is not None:
            w = load_weights(args.run_dir, args.final)
        else:
            raise errors.ConfigError("name a run folder or --paramserver HOST:PORT")
        export(w.cfg, w.tensors, args.output, args.format)
        print(json.dumps({"output": str(args.output), "format": args.format, "weights": w.source,
                          "param_version": w.version}))
        return 0
    except (errors.AmprlError, gym.error.DependencyNotInstalled) as exc:
        # DependencyNotInstalled: a renderer the env needs (CartPole's pygame, ...)
        print(f"amprl {command}: {exc}", file=sys.stderr)
        return 2


def enjoy_main(argv: list[str] | None = None) -> int:
    return main(argv, "enjoy")


def export_main(argv: list[str] | None = None) -> int:
    return main(argv, "export")
