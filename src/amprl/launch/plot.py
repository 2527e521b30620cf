"""``amprl plot RUN_DIR... -o curves.png``: learning curves from the run folders' eval.jsonl.

Two panels: greedy eval return against env steps, and against wall time (seconds since the
evaluator started). One run: its curve with the spread over the evaluation's episodes
(± std). Several runs (seeds of one experiment): each run thin, their mean bold, and the
spread across runs (± std) shaded, over the range every run covers (each run interpolated
onto a common grid). ``amprl run`` writes RUN_DIR/curves.png this way when it ends.

Drawn with matplotlib's Agg canvas (a file, never a window), so it works on a headless
machine and from any thread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from amprl import errors

AXES = (("env_steps", "env steps"), ("wall_seconds", "wall time (s)"))
"""(eval.jsonl key, axis label) of each panel."""

GRID_POINTS = 200
"""Points of the common grid the runs are interpolated onto for the mean and spread."""


class Curve(NamedTuple):
    """One run's evaluations, in the order they were made."""
    name: str
    env_steps: np.ndarray
    wall_seconds: np.ndarray
    mean_return: np.ndarray
    std_return: np.ndarray
    target_return: float | None


def read_curve(run_dir: Path) -> Curve:
    """The evaluations in ``run_dir/eval.jsonl``; ConfigError if there are none."""
    path = run_dir / "eval.jsonl"
    if not path.exists():
        raise errors.ConfigError(f"{path}: no evaluations (not a run folder, or its evaluator "
                                 f"never finished one)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise errors.ConfigError(f"{path}: no evaluations yet")
    target = None
    summary = run_dir / "summary.json"
    if summary.exists():
        target = json.loads(summary.read_text()).get("target_return")

    def col(key: str) -> np.ndarray:
        return np.array([float(r[key]) for r in rows])

    return Curve(run_dir.resolve().name, col("env_steps"), col("wall_seconds"),
                 col("mean_return"), col("std_return"), target)


def across_runs(xs: list[np.ndarray], ys: list[np.ndarray],
                points: int = GRID_POINTS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid, mean, std) of several runs' y(x), each interpolated linearly onto a grid over
    the range every run covers (from the latest first x to the earliest last x)."""
    lo = max(float(x[0]) for x in xs)
    hi = min(float(x[-1]) for x in xs)
    if hi < lo:
        raise ValueError(f"the runs' evaluations do not overlap (common range [{lo:g}, {hi:g}])")
    grid = np.linspace(lo, hi, points)
    # np.interp needs increasing x: env steps may repeat (two evaluations between inserts)
    stacked = np.stack([np.interp(grid, *_increasing(x, y)) for x, y in zip(xs, ys)])
    return grid, stacked.mean(axis=0), stacked.std(axis=0)


def _increasing(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x made strictly increasing (a repeated x keeps its last y)."""
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    keep = np.append(x[1:] != x[:-1], True)
    return x[keep], y[keep]


def _two_panels():
    """A figure of two panels sharing the return axis (matplotlib's Agg canvas: a file, never a window)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, 2, sharey=True)


def _save(fig, panels, curves: list[Curve], title: str, out: Path) -> Path:
    """Axes, the target line (when the runs share one), legend and title; writes ``out``."""
    targets = {c.target_return for c in curves if c.target_return is not None}
    for ax, (_, label) in zip(panels, AXES):
        if len(targets) == 1:
            ax.axhline(next(iter(targets)), color="grey", ls="--", lw=1, label="target")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    panels[0].set_ylabel("greedy eval return")
    panels[0].legend(fontsize="small", loc="best")
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def plot_runs(run_dirs: list[Path], out: Path, title: str = "") -> Path:
    """Writes the two-panel figure of ``run_dirs`` to ``out`` (PNG, or any format matplotlib
    knows by the suffix); returns ``out``."""
    curves = [read_curve(Path(d)) for d in run_dirs]
    fig, panels = _two_panels()
    many = len(curves) > 1
    for ax, (key, label) in zip(panels, AXES):
        for i, c in enumerate(curves):
            x = getattr(c, key)
            color = f"C{i % 10}"
            ax.plot(x, c.mean_return, color=color, lw=0.8 if many else 1.6, alpha=0.45 if many else 1.0,
                    marker="o" if len(x) < 3 else None, label=c.name)
            if not many:
                ax.fill_between(x, c.mean_return - c.std_return, c.mean_return + c.std_return,
                                color=color, alpha=0.2, lw=0, label="± std over episodes")
        if many:
            try:
                grid, mean, std = across_runs([getattr(c, key) for c in curves],
                                              [c.mean_return for c in curves])
            except ValueError as exc:
                ax.set_title(f"no mean: {exc}", fontsize="small")
            else:
                ax.plot(grid, mean, color="black", lw=2.0, label=f"mean of {len(curves)} runs")
                ax.fill_between(grid, mean - std, mean + std, color="black", alpha=0.15, lw=0,
                                label="± std across runs")
    return _save(fig, panels, curves, title or (curves[0].name if not many else f"{len(curves)} runs"), out)


def plot_groups(groups: dict[str, list[Path | Curve]], out: Path, title: str = "") -> Path:
    """Writes the two-panel figure of several experiments (``{label: its runs}``, each run a
    folder or a Curve already read, e.g. the seeds of each condition of
    ``bench/parity.py``) to ``out``: one color per experiment, its runs thin, their mean bold
    and the spread across its runs (± std) shaded; returns ``out``."""
    curves = {label: [r if isinstance(r, Curve) else read_curve(Path(r)) for r in runs]
              for label, runs in groups.items() if runs}
    fig, panels = _two_panels()
    for ax, (key, _) in zip(panels, AXES):
        for i, (label, runs) in enumerate(curves.items()):
            color = f"C{i % 10}"
            for c in runs:
                ax.plot(getattr(c, key), c.mean_return, color=color, lw=0.6, alpha=0.35)
            if len(runs) == 1:
                ax.plot(getattr(runs[0], key), runs[0].mean_return, color=color, lw=1.8, label=f"{label} (1 run)")
                continue
            try:
                grid, mean, std = across_runs([getattr(c, key) for c in runs], [c.mean_return for c in runs])
            except ValueError:
                continue  # the thin lines stay; no common range for a mean
            ax.plot(grid, mean, color=color, lw=2.0, label=f"{label} (mean of {len(runs)})")
            ax.fill_between(grid, mean - std, mean + std, color=color, alpha=0.15, lw=0)
    return _save(fig, panels, [c for runs in curves.values() for c in runs], title or ", ".join(curves), out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="amprl plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--output", type=Path, default=Path("curves.png"),
                   help="the figure (default curves.png; the suffix picks the format)")
    p.add_argument("--title", default="", help="figure title (default: the run's name)")
    args = p.parse_args(argv)
    try:
        plot_runs(args.run_dirs, args.output, args.title)
    except errors.AmprlError as exc:
        print(f"amprl plot: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"output": str(args.output), "runs": [str(d) for d in args.run_dirs]}))
    return 0
