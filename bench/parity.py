"""1-bit gradients across a slow link against fp32 on a local one: the same agent, four links.

    python bench/parity.py CONFIG --seeds 3 --steps N [--rtt-ms 300] [--threshold R]
                           [--conditions fp32_0ms,onebit_300ms] [--out DIR] [--reuse]
                           [--set key=value ...]

Runs, one after another, the system of ``bench/wanrun.py`` (every service its own process,
the learner's link to the parameter server through a DelayRelay process adding
``rtt_ms / 2`` each way, or no relay at 0 ms) under four conditions that differ only in the
learner's gradient encoding and that link:

    fp32_0ms     learner.grad_encoding=fp32,   no relay
    onebit_0ms   learner.grad_encoding=onebit, no relay
    fp32_300ms   learner.grad_encoding=fp32,   --rtt-ms (300) round trip
    onebit_300ms learner.grad_encoding=onebit, --rtt-ms (300) round trip

Everything else is CONFIG's, link settings included (``learner.sync``, the push window,
``pull_lag_versions``): give it a ``*-wan.yaml``. Each run trains for ``--steps`` env steps
(``run.stop_at_target`` off) and ends with the evaluator's greedy evaluation of the final
weights. The seeds go round the conditions (seed 0 under all four, then seed 1, ...) so a
change in the machine's load falls on every condition alike.

Prints one JSON object (also ``DIR/parity.json``) with a key per condition holding
``final_return_median``, ``final_returns`` (per seed), ``late_return_median`` and per seed
(the mean of the evaluations in the last 10% of the env steps), ``steps_to_threshold`` (median env
steps to the first greedy evaluation >= the threshold; null unless at least half the seeds
got there) and per seed, ``wall_seconds`` (median) and per seed, ``gradient_bytes_per_step``
(payload the server received per optimizer step: data + scales), ``gradient_bytes_total``,
``stale_rejections``, ``updates_per_s``; and ``comparison``: each condition's median final
return over (and minus) fp32_0ms's, the share of fp32_0ms's gain over the untrained network
it kept (``*_gain_over_fp32_0ms_gain``: a ratio that also reads right for negative
returns), and fp32's gradient bytes per step over 1-bit's. ``DIR/parity.png``:
greedy return against env steps and wall time, the mean and spread over seeds per condition.
The run folders stay in ``DIR/runs/<condition>-seed<k>/``; ``--reuse`` takes the runs already
there instead of running them again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from amprl.config import load_config
from amprl.launch.plot import plot_groups

HERE = Path(__file__).resolve().parent

CONDITIONS = {
    "fp32_0ms": ("fp32", False),
    "onebit_0ms": ("onebit", False),
    "fp32_300ms": ("fp32", True),
    "onebit_300ms": ("onebit", True),
}
"""Condition -> (learner.grad_encoding, across the slow link). The keys name 300 ms, the
issue's figure; --rtt-ms sets the round trip actually used (recorded as ``rtt_ms``)."""


def median_or_none(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def steps_to_threshold(per_seed: list[int | None]) -> float | None:
    """Median steps to the threshold, a seed that never got there counting as infinitely
    many; None when fewer than half the seeds got there."""
    ranked = sorted(per_seed, key=lambda s: float("inf") if s is None else s)
    mid = ranked[(len(ranked) - 1) // 2: len(ranked) // 2 + 1]
    if any(s is None for s in mid):
        return None
    return statistics.mean(mid)


def run_one(config: str, run_dir: Path, encoding: str, rtt_ms: float, seed: int, steps: int,
            threshold: float, overrides: list[str], max_wall_s: float) -> dict:
    """One bench/wanrun.py run; its summary.json (with ``error`` set if it failed)."""
    sets = [*overrides, f"learner.grad_encoding={encoding}", f"run.seed={seed}",
            f"run.total_env_steps={steps}", "run.stop_at_target=false",
            f"run.target_return={threshold}", f"run.max_wall_seconds={max_wall_s}"]
    cmd = [sys.executable, str(HERE / "wanrun.py"), config, "--run-dir", str(run_dir),
           "--rtt-ms", str(rtt_ms), "--progress-interval", "30"]
    for s in sets:
        cmd += ["--set", s]
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "wanrun.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                            timeout=max_wall_s + 600).returncode
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {"error": f"wanrun.py exited {rc} without a summary (see {run_dir / 'wanrun.log'})"}
    if rc != 0 and not summary.get("error"):
        summary["error"] = f"wanrun.py exited {rc} (see {run_dir / 'wanrun.log'})"
    return summary


def late_return(summary: dict, last_share: float = 0.1) -> float | None:
    """Mean greedy return of a run's evaluations over the last ``last_share`` of its env
    steps: steadier than the one final evaluation where an episode can fail (HalfCheetah's
    flips)."""
    evals = summary.get("evaluations") or []
    if not evals:
        return None
    end = max(e[1] for e in evals)
    late = [e[3] for e in evals if e[1] >= (1 - last_share) * end]
    return statistics.mean(late)


def condition_figures(runs: list[dict], rtt_ms: float) -> dict:
    finals = [r.get("final_eval_return") for r in runs]
    to_threshold = [r.get("steps_to_target") for r in runs]
    walls = [r.get("wall_seconds") for r in runs]
    total_bytes = [r.get("gradient_bytes_received") for r in runs]
    per_step = [b / r["param_version"] if b is not None and r.get("param_version") else None
                for b, r in zip(total_bytes, runs)]
    untrained = [r["evaluations"][0][3] for r in runs if r.get("evaluations") and r["evaluations"][0][2] == 0]
    late = [late_return(r) for r in runs]
    return {
        "rtt_ms": rtt_ms,
        "untrained_return_median": median_or_none(untrained),
        "final_return_median": median_or_none(finals),
        "final_returns": finals,
        "late_return_median": median_or_none(late),
        "late_returns": late,
        "steps_to_threshold": steps_to_threshold(to_threshold),
        "steps_to_threshold_per_seed": to_threshold,
        "wall_seconds": median_or_none(walls),
        "wall_seconds_per_seed": walls,
        "gradient_bytes_per_step": median_or_none(per_step),
        "gradient_bytes_total": median_or_none(total_bytes),
        "gradient_bytes_total_per_seed": total_bytes,
        "optimizer_steps_per_seed": [r.get("param_version") for r in runs],
        "stale_rejections": [r.get("stale_rejections") for r in runs],
        "updates_per_s": median_or_none([r.get("updates_per_s") for r in runs]),
        "env_steps_per_seed": [r.get("env_steps") for r in runs],
        "errors": [r.get("error") for r in runs if r.get("error")],
    }


def compare(out: dict) -> dict:
    """Each condition against fp32_0ms: final return ratio and difference, and the part of
    fp32_0ms's gain over the untrained network (version 0's evaluation, median over every
    run) that the condition kept (1 = as much; the ratio means little for negative returns);
    fp32 over 1-bit gradient bytes per step."""
    base = out["fp32_0ms"]["final_return_median"]
    untrained = median_or_none([figs["untrained_return_median"] for figs in out.values()])
    ratios = {}
    if untrained is not None:
        ratios["untrained_return_median"] = round(untrained, 2)
    for name, figs in out.items():
        if name == "fp32_0ms":
            continue
        final = figs["final_return_median"]
        if base is not None and final is not None and base != 0:
            # returns can be negative (Pendulum): the ratio of two negatives reads inverted,
            # so the gap is also given in return units
            ratios[f"{name}_final_return_over_fp32_0ms"] = round(final / base, 4)
            ratios[f"{name}_final_return_minus_fp32_0ms"] = round(final - base, 2)
            if untrained is not None and base != untrained:
                ratios[f"{name}_gain_over_fp32_0ms_gain"] = round((final - untrained) / (base - untrained), 4)
        late, late_base = figs["late_return_median"], out["fp32_0ms"]["late_return_median"]
        if late is not None and late_base and untrained is not None and late_base != untrained:
            ratios[f"{name}_late_return_over_fp32_0ms"] = round(late / late_base, 4)
            ratios[f"{name}_late_gain_over_fp32_0ms_gain"] = round((late - untrained) / (late_base - untrained), 4)
    for fp32, onebit in (("fp32_0ms", "onebit_0ms"), ("fp32_300ms", "onebit_300ms"), ("fp32_0ms", "onebit_300ms")):
        if fp32 in out and onebit in out:
            f, o = out[fp32]["gradient_bytes_per_step"], out[onebit]["gradient_bytes_per_step"]
            if f and o:
                ratios[f"gradient_bytes_{fp32}_over_{onebit}"] = round(f / o, 2)
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, required=True, help="env steps per run")
    p.add_argument("--rtt-ms", type=float, default=300.0, help="round trip of the slow link")
    p.add_argument("--threshold", type=float, default=None,
                   help="greedy return for steps_to_threshold (default: the config's run.target_return)")
    p.add_argument("--conditions", default=",".join(CONDITIONS),
                   help="a comma-separated subset of " + ", ".join(CONDITIONS))
    p.add_argument("--max-wall-seconds", type=float, default=3600.0, help="per run")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/parity-<config name>")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--reuse", action="store_true",
                   help="a run whose folder already holds a summary.json is not run again (resumes an "
                        "interrupted comparison; with every run there, redoes the figures)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    threshold = cfg.run.target_return if args.threshold is None else args.threshold
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        p.error(f"unknown condition {unknown[0]!r}: one of {', '.join(CONDITIONS)}")
    out_dir = args.out or HERE / "results" / f"parity-{cfg.name}"
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    runs: dict[str, list[dict]] = {c: [] for c in conditions}
    dirs: dict[str, list[Path]] = {c: [] for c in conditions}
    t0 = time.monotonic()
    for seed in seeds:
        for cond in conditions:
            encoding, slow = CONDITIONS[cond]
            rtt = args.rtt_ms if slow else 0.0
            run_dir = out_dir / "runs" / f"{cond}-seed{seed}"
            done = run_dir / "summary.json"
            if args.reuse and done.exists():
                summary = json.loads(done.read_text())
            else:
                summary = run_one(args.config, run_dir, encoding, rtt, seed, args.steps, threshold,
                                  args.overrides, args.max_wall_seconds)
            runs[cond].append(summary)
            if (run_dir / "eval.jsonl").exists():
                dirs[cond].append(run_dir)
            print(f"[{time.monotonic() - t0:7.0f}s] {cond} seed {seed}: final {summary.get('final_eval_return')}, "
                  f"steps to {threshold:g} {summary.get('steps_to_target')}, wall {summary.get('wall_seconds')} s"
                  + (f", error {summary['error'].splitlines()[0]}" if summary.get("error") else ""),
                  file=sys.stderr, flush=True)
    result: dict = {c: condition_figures(runs[c], args.rtt_ms if CONDITIONS[c][1] else 0.0) for c in conditions}
    if "fp32_0ms" in result:
        result["comparison"] = compare({c: result[c] for c in conditions})
    result["meta"] = {
        "config": args.config, "name": cfg.name, "env_id": cfg.env.id, "algo": cfg.algo,
        "seeds": seeds, "steps": args.steps, "threshold": threshold, "rtt_ms": args.rtt_ms,
        "overrides": args.overrides, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
        "command": "python bench/parity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "parity.json").write_text(json.dumps(result, indent=2) + "\n")
    groups = {c: d for c, d in dirs.items() if d}
    if groups:
        plot_groups(groups, out_dir / "parity.png",
                    title=f"{cfg.name}: {args.steps:,} env steps, {len(seeds)} seed{'s' if len(seeds) != 1 else ''}, "
                          f"slow link {args.rtt_ms:g} ms RTT")
    print(json.dumps(result), flush=True)
    return 1 if any(result[c]["errors"] for c in conditions) else 0


if __name__ == "__main__":
    sys.exit(main())
