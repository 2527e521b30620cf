"""1-bit gradients across a slow link against fp32 on a local one: the same agent, four links.

    python bench/parity.py CONFIG --seeds 3 --steps N [--rtt-ms 300] [--threshold R]
                           [--conditions fp32_0ms,onebit_300ms] [--out DIR] [--reuse]
                           [--first-seed K] [--combine EARLIER_PARITY_JSON ...]
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
Each condition also keeps its per-seed lists (``seeds``, ``updates_per_s_per_seed``,
``untrained_returns``, ``evaluations_per_seed``, ...), so the JSON alone redoes the figures:
``--combine`` adds an earlier parity.json's seeds to this invocation's (a comparison run in
parts, e.g. ``--first-seed 2 --seeds 1`` after seeds 0-1; ``--seeds 0`` only combines).
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

import numpy as np

from amprl.config import load_config
from amprl.launch.plot import Curve, plot_groups

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


def record(summary: dict, seed: int) -> dict:
    """What parity.json keeps of one run (a wanrun.py summary): its per-seed figures and
    evaluations ``[seconds, env steps, version, return]``."""
    evals = summary.get("evaluations") or []
    return {
        "seed": seed,
        "final": summary.get("final_eval_return"),
        "late": late_return(summary),
        "to_threshold": summary.get("steps_to_target"),
        "wall": summary.get("wall_seconds"),
        "grad_bytes": summary.get("gradient_bytes_received"),
        "optimizer_steps": summary.get("param_version"),
        "stale_rejections": summary.get("stale_rejections"),
        "updates_per_s": summary.get("updates_per_s"),
        "env_steps": summary.get("env_steps"),
        "untrained": evals[0][3] if evals and evals[0][2] == 0 else None,
        "evaluations": evals or None,
        "error": summary.get("error"),
    }


PER_SEED = {
    "seeds": "seed", "final_returns": "final", "late_returns": "late",
    "steps_to_threshold_per_seed": "to_threshold", "wall_seconds_per_seed": "wall",
    "gradient_bytes_total_per_seed": "grad_bytes", "optimizer_steps_per_seed": "optimizer_steps",
    "stale_rejections": "stale_rejections", "updates_per_s_per_seed": "updates_per_s",
    "env_steps_per_seed": "env_steps", "untrained_returns": "untrained",
    "evaluations_per_seed": "evaluations", "errors_per_seed": "error",
}
"""parity.json's per-seed lists of a condition -> the record key each lists."""


def figures(records: list[dict], rtt_ms: float) -> dict:
    """A condition's figures: the medians over its seeds and the per-seed lists."""
    records = sorted(records, key=lambda r: r["seed"])
    per_step = [r["grad_bytes"] / r["optimizer_steps"] if r["grad_bytes"] is not None and r["optimizer_steps"]
                else None for r in records]
    col = {key: [r[field] for r in records] for key, field in PER_SEED.items()}
    return {
        "rtt_ms": rtt_ms,
        "untrained_return_median": median_or_none(col["untrained_returns"]),
        "final_return_median": median_or_none(col["final_returns"]),
        "late_return_median": median_or_none(col["late_returns"]),
        "steps_to_threshold": steps_to_threshold(col["steps_to_threshold_per_seed"]),
        "wall_seconds": median_or_none(col["wall_seconds_per_seed"]),
        "gradient_bytes_per_step": median_or_none(per_step),
        "gradient_bytes_total": median_or_none(col["gradient_bytes_total_per_seed"]),
        "updates_per_s": median_or_none(col["updates_per_s_per_seed"]),
        **col,
        "errors": [e for e in col["errors_per_seed"] if e],
    }


def condition_figures(runs: list[dict], rtt_ms: float, seeds: list[int] | None = None) -> dict:
    """The figures of a condition's runs (wanrun.py summaries, one per seed)."""
    seeds = list(range(len(runs))) if seeds is None else seeds
    return figures([record(r, s) for r, s in zip(runs, seeds)], rtt_ms)


def records_of(figs: dict, file_seeds: list[int]) -> list[dict]:
    """A condition's records back from its figures in an earlier parity.json. A file written
    before the per-seed lists below were kept gives: its seeds from ``meta.seeds``,
    updates/s per seed as optimizer steps over wall seconds (wanrun.py's own updates/s
    differs from it by the few updates after the server's last version), the untrained
    network's return as the file's median for every seed, and no evaluations (no curve)."""
    n = len(figs["final_returns"])
    cols = {key: figs.get(key) for key in PER_SEED}
    if cols["seeds"] is None:
        cols["seeds"] = file_seeds
    if cols["late_returns"] is None:
        cols["late_returns"] = [None] * n
    if cols["updates_per_s_per_seed"] is None:
        cols["updates_per_s_per_seed"] = [
            round(s / w, 1) if s and w else None
            for s, w in zip(figs["optimizer_steps_per_seed"], figs["wall_seconds_per_seed"])]
    if cols["untrained_returns"] is None:
        cols["untrained_returns"] = [figs.get("untrained_return_median")] * n
    if cols["evaluations_per_seed"] is None:
        cols["evaluations_per_seed"] = [None] * n
    if cols["errors_per_seed"] is None:
        if figs.get("errors"):
            raise ValueError("it holds failed runs and does not say which seeds failed: run them again")
        cols["errors_per_seed"] = [None] * n
    if any(len(v) != n for v in cols.values()):
        raise ValueError(f"its per-seed lists are of unequal length ({n} final returns)")
    return [{field: cols[key][i] for key, field in PER_SEED.items()} for i in range(n)]


def curve(label: str, evaluations: list) -> Curve:
    e = np.array(evaluations, dtype=float)
    return Curve(label, e[:, 1], e[:, 0], e[:, 3], np.zeros(len(e)), None)


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
    p.add_argument("--combine", type=Path, action="append", default=[], metavar="PARITY_JSON",
                   help="an earlier parity.json of the same config, steps, threshold and link whose "
                        "seeds join this invocation's (repeatable; a seed may be in one place only)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    threshold = cfg.run.target_return if args.threshold is None else args.threshold
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        p.error(f"unknown condition {unknown[0]!r}: one of {', '.join(CONDITIONS)}")
    try:
        earlier, earlier_meta = combined(args.combine, cfg.name, args.steps, threshold, args.rtt_ms,
                                         args.overrides)
    except ValueError as exc:
        p.error(str(exc))
    out_dir = args.out or HERE / "results" / f"parity-{cfg.name}"
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    records: dict[str, list[dict]] = {c: list(earlier.get(c, [])) for c in CONDITIONS}
    for cond in conditions:
        clash = sorted({r["seed"] for r in records[cond]} & set(seeds))
        if clash:
            p.error(f"{cond} seed {clash[0]} is in a --combine file already: leave it out of --first-seed/--seeds")
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
            records[cond].append(record(summary, seed))
            print(f"[{time.monotonic() - t0:7.0f}s] {cond} seed {seed}: final {summary.get('final_eval_return')}, "
                  f"steps to {threshold:g} {summary.get('steps_to_target')}, wall {summary.get('wall_seconds')} s"
                  + (f", error {summary['error'].splitlines()[0]}" if summary.get("error") else ""),
                  file=sys.stderr, flush=True)
    present = [c for c in CONDITIONS if records[c]]
    result: dict = {c: figures(records[c], args.rtt_ms if CONDITIONS[c][1] else 0.0) for c in present}
    if "fp32_0ms" in result:
        result["comparison"] = compare({c: result[c] for c in present})
    all_seeds = sorted({r["seed"] for c in present for r in records[c]})
    result["meta"] = {
        "config": args.config, "name": cfg.name, "env_id": cfg.env.id, "algo": cfg.algo,
        "seeds": all_seeds, "steps": args.steps, "threshold": threshold, "rtt_ms": args.rtt_ms,
        "overrides": args.overrides, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
        "command": "python bench/parity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "combined": [{"file": str(f), **{k: m.get(k) for k in ("command", "date", "seeds")}}
                     for f, m in zip(args.combine, earlier_meta)],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "parity.json").write_text(json.dumps(result, indent=2) + "\n")
    groups = {c: [curve(f"{c} seed {r['seed']}", r["evaluations"]) for r in records[c] if r["evaluations"]]
              for c in present}
    drawn, runs = sum(map(len, groups.values())), sum(len(records[c]) for c in present)
    if drawn:
        plot_groups(groups, out_dir / "parity.png",
                    title=f"{cfg.name}: {args.steps:,} env steps, seeds {', '.join(map(str, all_seeds))}, "
                          f"slow link {args.rtt_ms:g} ms RTT"
                          + (f" (curves of {drawn} of {runs} runs)" if drawn < runs else ""))
    print(json.dumps(result), flush=True)
    return 1 if any(result[c]["errors"] for c in present) else 0


def combined(files: list[Path], name: str, steps: int, threshold: float, rtt_ms: float,
             overrides: list[str]) -> tuple[dict[str, list[dict]], list[dict]]:
    """The records of earlier parity.json files, by condition, and each file's meta;
    ValueError if a file is of another comparison or two hold the same seed of a condition."""
    out: dict[str, list[dict]] = {}
    metas = []
    for f in files:
        try:
            data = json.loads(f.read_text())
            meta = data["meta"]
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"--combine {f}: not a parity.json ({exc})") from None
        metas.append(meta)
        want = {"name": name, "steps": steps, "threshold": threshold, "rtt_ms": rtt_ms, "overrides": overrides}
        for key, value in want.items():
            if meta.get(key) != value:
                raise ValueError(f"--combine {f}: its {key} is {meta.get(key)!r}, this comparison's {value!r}")
        for cond in CONDITIONS:
            if cond not in data:
                continue
            try:
                recs = records_of(data[cond], meta["seeds"])
            except ValueError as exc:
                raise ValueError(f"--combine {f}: {cond}: {exc}") from None
            have = {r["seed"] for r in out.get(cond, [])}
            for r in recs:
                if r["seed"] in have:
                    raise ValueError(f"--combine {f}: {cond} seed {r['seed']} is in an earlier file too")
            out.setdefault(cond, []).extend(recs)
    return out, metas


if __name__ == "__main__":
    sys.exit(main())
