"""A learning curve: greedy eval return vs env steps and wall time, as JSON + PNG.

    python bench/curve.py configs/halfcheetah-td3.yaml --steps 100000 --out bench/results/halfcheetah-curve
    python bench/curve.py --from-run runs/halfcheetah-td3 --out bench/results/halfcheetah-curve

The first form runs ``amprl run CONFIG`` (``run.total_env_steps`` = --steps, optional
``--wall`` seconds and ``--set`` overrides) into a run folder and reads its ``eval.jsonl``;
the second reads the ``eval.jsonl`` and ``summary.json`` of a run that already finished.
Writes ``OUT.json`` (every evaluation, the run's summary, and ``eval_return_at_<k>k_steps``:
the newest evaluation made at or before each multiple of --mark-every env steps) and
``OUT.png`` (return vs env steps and vs wall time; needs matplotlib: ``pip install
matplotlib``). Prints the JSON without the points as one line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_run(run_dir: Path) -> tuple[list[dict], dict]:
    """A run folder's evaluations (none if it has no ``eval.jsonl``) and its summary ({} if none)."""
    eval_path = run_dir / "eval.jsonl"
    evals = ([json.loads(line) for line in eval_path.read_text().splitlines() if line.strip()]
             if eval_path.exists() else [])
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return evals, summary


def marks(evals: list[dict], every: int) -> dict[str, float]:
    """The newest eval return measured at or before each multiple of ``every`` env steps."""
    out: dict[str, float] = {}
    if not evals or every <= 0:
        return out
    top = max(e["env_steps"] for e in evals)
    for k in range(every, top + 1, every):
        before = [e for e in evals if e["env_steps"] <= k]
        if before:
            out[f"eval_return_at_{k // 1000}k_steps"] = round(before[-1]["mean_return"], 1)
            out[f"wall_seconds_at_{k // 1000}k_steps"] = round(before[-1]["wall_seconds"], 1)
    return out


def plot(evals: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["env_steps"] for e in evals]
    wall = [e["wall_seconds"] / 60 for e in evals]
    mean = [e["mean_return"] for e in evals]
    std = [e["std_return"] for e in evals]
    lo = [m - s for m, s in zip(mean, std)]
    hi = [m + s for m, s in zip(mean, std)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, x, label in ((axes[0], steps, "env steps"), (axes[1], wall, "wall time (min)")):
        ax.plot(x, mean, marker=".", lw=1.2)
        ax.fill_between(x, lo, hi, alpha=0.2)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy eval return (mean ± std)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="config to run (omit with --from-run)")
    p.add_argument("--from-run", default="", help="read this finished run folder instead of running")
    p.add_argument("--command", default="", help="with --from-run: the command that made the run (recorded)")
    p.add_argument("--steps", type=int, default=100_000, help="run.total_env_steps")
    p.add_argument("--wall", type=float, default=0.0, help="run.max_wall_seconds (0 = none)")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--mark-every", type=int, default=25_000, help="report the return at each multiple")
    p.add_argument("--out", required=True, help="path without extension: OUT.json and OUT.png")
    args = p.parse_args()
    load_before = round(os.getloadavg()[0], 2)
    if args.from_run:
        run_dir = Path(args.from_run)
        command = args.command or None
        evals, summary = read_run(run_dir)
    else:
        if not args.config:
            p.error("give a CONFIG to run, or --from-run RUN_DIR")
        tmp = tempfile.mkdtemp(prefix="amprl-bench-curve-")
        run_dir = Path(tmp) / "run"
        overrides = [f"run.total_env_steps={args.steps}", f"run.max_wall_seconds={args.wall}",
                     "run.stop_at_target=false", *args.overrides]
        cmd = [sys.executable, "-m", "amprl.cli", "run", args.config, "--run-dir", str(run_dir),
               "--progress-interval", "30"]
        for o in overrides:
            cmd += ["--set", o]
        command = " ".join(cmd[1:])
        proc = subprocess.run(cmd, cwd=ROOT)
        if proc.returncode != 0 or not (run_dir / "eval.jsonl").exists():
            print(json.dumps({"error": f"amprl run failed with exit code {proc.returncode}", "run_dir": str(run_dir)}))
            return 1
        evals, summary = read_run(run_dir)
    if not evals:
        print(json.dumps({"error": f"no evaluations in {run_dir / 'eval.jsonl'}"}))
        return 1
    name = summary.get("name") or run_dir.name
    result = {
        "run": name,
        "env_id": summary.get("env_id"),
        "command": command,
        "final_eval_return": round(evals[-1]["mean_return"], 1),
        "best_eval_return": round(max(e["mean_return"] for e in evals), 1),
        "env_steps": summary.get("env_steps", evals[-1]["env_steps"]),
        "updates": summary.get("updates"),
        "wall_seconds": summary.get("wall_seconds", evals[-1]["wall_seconds"]),
        **marks(evals, args.mark_every),
        "cpus": os.cpu_count(),
        "load_average_1min_at_report": load_before,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**result, "summary": summary, "evaluations": evals}, indent=1) + "\n")
    plot(evals, f"{name} ({result['env_id']}): greedy eval return", out.with_suffix(".png"))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
