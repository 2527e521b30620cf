"""``amprl run --resume RUN_DIR`` goes on with a stopped run; ``amprl run --init-from
RUN_DIR`` starts a new run from another run's weights.

Resuming restarts every service on the same run folder, and each takes up its own state
from it as after any restart:

- the parameter server, its newest checkpoint in ``RUN_DIR/checkpoints`` (weights, Adam
  state, version: the version goes on from where it stopped);
- replay, the embedded Redis restarted on ``RUN_DIR/redis``, which replays its AOF, and the
  index rebuilt from it (``amprl.replay.recovery``): the transitions, their priorities and
  the fleet's env-step count;
- the evaluator, ``eval.jsonl`` (appended to, its wall time going on) and ``best/`` (kept
  until an evaluation beats it).

What lives only in a process starts over, as after any restart of it: the learner's
update count (so the annealing of replay's β, by updates) and each actor's ε warm-up.

The run keeps its config (``RUN_DIR/config.yaml``). ``--set`` may change only the keys of
``RESUME_KEYS``: when to stop, how often to evaluate, and how the processes use the machine
(``deploy``), none of which changes what is learned; anything else is refused (start a
new run with ``--init-from`` to change it). The stop rule counts the whole run, as on a
cluster after a pod restart: the step budget its env steps, ``run.max_wall_seconds`` the
evaluator's clock (which goes on from ``eval.jsonl``), and an evaluation that reached the
target counts too; a run that stopped at a limit needs a larger one (the evaluator keeps
its verdict in ``end.json`` until the run section changes). ``summary.json`` at the end
covers the whole run: updates and wall time add up over its ``segments``, the evaluations
are those of ``eval.jsonl``.

``--init-from`` copies the source run's best weights (``best/``, else its newest
checkpoint) into ``RUN/init/`` and the new run's parameter server starts from them
(``--init-weights``), with a new optimizer, version 0 and an empty replay; the config is
the one given, whose network must match the source's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from amprl.common import runend
from amprl.config import ExperimentConfig, load_config, resolve_config
from amprl.errors import ConfigError

RESUME_KEYS = ("run.total_env_steps", "run.max_wall_seconds", "run.target_return",
               "run.stop_at_target", "evaluator.interval_s", "deploy.")
"""The ``--set`` keys a resumed run accepts (a key ending in "." stands for its section)."""


def _keys() -> str:
    return ", ".join(k + "*" if k.endswith(".") else k for k in RESUME_KEYS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", default="", metavar="RUN_DIR",
                        help="go on with a stopped run in its folder: weights, optimizer, replay, "
                             "counters and config; --set only " + _keys())
    parser.add_argument("--init-from", default="", metavar="RUN_DIR",
                        help="a new run whose weights start from RUN_DIR's best (else its newest "
                             "checkpoint): new optimizer, empty replay")


def run_config(args: argparse.Namespace, default_config: str) -> ExperimentConfig:
    """The config of this run. With ``--resume``: ``RUN_DIR/config.yaml`` with the allowed
    ``--set`` (and ``args.run_dir`` becomes RUN_DIR); else CONFIG with ``--set``."""
    if not args.resume:
        return load_config(resolve_config(args.config), args.overrides)
    run_dir = Path(args.resume)
    if args.init_from:
        raise ConfigError("--resume and --init-from: choose one (--init-from starts a new run)")
    if args.config != default_config:
        raise ConfigError(f"--resume {run_dir} runs with that run's own config "
                          f"({run_dir / 'config.yaml'}); drop {args.config}")
    if args.run_dir and Path(args.run_dir).resolve() != run_dir.resolve():
        raise ConfigError("--resume RUN_DIR is the run folder: drop --run-dir")
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {run_dir}: not a run folder (no config.yaml)")
    for item in args.overrides:
        key = item.split("=", 1)[0].strip()
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_KEYS):
            raise ConfigError(f"--set {key}: a resumed run keeps its config; it may change only "
                              f"{_keys()} (start a new run with --init-from "
                              f"{run_dir} to change the rest)")
    _check_not_running(run_dir)
    cfg = load_config(run_dir / "config.yaml", args.overrides)
    if cfg.paramserver.checkpoint_interval_s <= 0 and cfg.paramserver.checkpoint_interval_versions <= 0:
        raise ConfigError(f"--resume {run_dir}: the run kept no checkpoints "
                          f"(paramserver.checkpoint_interval_s and _versions are 0), so its "
                          f"weights are gone; start a new run")
    done = _read_json(run_dir / "summary.json").get("env_steps", 0)
    if done >= cfg.run.total_env_steps:
        raise ConfigError(f"--resume {run_dir}: the run has {done} env steps, no fewer than its budget "
                          f"(run.total_env_steps {cfg.run.total_env_steps}): raise it, e.g. "
                          f"--set run.total_env_steps={done + cfg.run.total_env_steps}")
    ended = _read_json(run_dir / "end.json")  # the evaluator's verdict (amprl.common.runend)
    if ended.get("rule") == runend.rule_of(cfg.run):
        raise ConfigError(f"--resume {run_dir}: the run ended ({ended.get('reason', '?')}) and would "
                          f"end again at once under the same run section: change "
                          f"{', '.join('run.' + k for k in runend.RULE_KEYS)}")
    args.run_dir = str(run_dir)
    return cfg


def _check_not_running(run_dir: Path) -> None:
    """ConfigError if the run's embedded Redis still runs (the run is going on, or its
    launcher was killed and left it): two servers must never share one AOF."""
    try:
        pid = int((run_dir / "redis" / "redis-server.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return
    if b"redis-server" in cmdline:
        raise ConfigError(f"--resume {run_dir}: its Redis still runs (pid {pid}); stop that run "
                          f"first")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def previous_summary(args: argparse.Namespace) -> dict | None:
    """With ``--resume``: the summary of the run so far ({} when it was killed before it
    wrote one); None for a new run."""
    return _read_json(Path(args.resume) / "summary.json") if args.resume else None


def init_weights_file(run_dir: Path) -> Path | None:
    """The weights this run's parameter server starts from (``RUN/init/``), if any."""
    files = sorted((run_dir / "init").glob("weights*")) if (run_dir / "init").is_dir() else []
    return files[0] if files else None


def paramserver_args(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The parameter server's ``--init-weights`` flag: with ``--init-from``, after copying
    the source's weights into ``RUN/init/``; a resumed run started that way keeps it (its
    own checkpoints, restored after, win)."""
    if args.init_from:
        _copy_init_weights(Path(args.init_from), run_dir / "init")
    weights = init_weights_file(run_dir)
    return ["--init-weights", str(weights)] if weights is not None else []


def _copy_init_weights(source: Path, folder: Path) -> None:
    best = _read_json(source / "best" / "best.json")
    if best:
        origin, version, kind = source / "best" / best["weights"], best["param_version"], "best"
    else:
        from amprl.paramserver.client import checkpoint_files

        files = checkpoint_files(source / "checkpoints")
        if not files:
            raise ConfigError(f"--init-from {source}: no best/ weights and no checkpoint there")
        (version, origin), kind = files[0], "checkpoint"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / ("weights.pt" if kind == "best" else "weights.amprl")
    tmp = folder / f".{target.name}.tmp"
    shutil.copyfile(origin, tmp)
    os.replace(tmp, target)
    (folder / "init.json").write_text(json.dumps(
        {"from": str(source), "weights": str(origin), "kind": kind, "param_version": version},
        indent=1) + "\n")
    print(f"amprl run: weights from {origin} ({kind}, version {version})", flush=True)


def whole_run(summary: dict, previous: dict, run_dir: Path, target_return: float) -> dict:
    """This invocation's ``summary`` extended to the whole run: ``previous`` is the summary
    of the run so far, ``eval.jsonl`` its every evaluation."""
    evals = []
    try:
        evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line]
    except OSError:
        pass
    out = dict(summary)
    out["segments"] = int(previous.get("segments", 1)) + 1
    out["updates"] = int(previous.get("updates") or 0) + int(summary["updates"])
    out["wall_seconds"] = round(float(previous.get("wall_seconds") or 0) + summary["wall_seconds"], 2)
    out["evaluations"] = len(evals)
    if not evals:
        return out
    first_hit = next((e for e in evals if e["mean_return"] >= target_return), None)
    # times of evaluations are the evaluator's clock, which goes on over the segments
    out.update(solved=first_hit is not None,
               best_eval_return=max(e["mean_return"] for e in evals),
               final_eval_return=evals[-1]["mean_return"], final_eval_std=evals[-1]["std_return"],
               steps_to_target=first_hit["env_steps"] if first_hit else None,
               time_to_target_seconds=first_hit["wall_seconds"] if first_hit else None)
    return out
