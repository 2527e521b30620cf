"""CartPole through the whole system: median time- and steps-to-target over seeds.

    python bench/cartpole.py --seeds 3 [--first-seed 0] [--grad-encoding onebit] [--rtt-ms 300]
                             [--set key=value ...] [--keep-runs DIR]

Runs `amprl run configs/cartpole-dqn.yaml` once per seed, one after another, each for the
config's whole step budget (run.stop_at_target=false) so the final evaluation shows whether
the policy stays solved. Prints one JSON line. The run folders go to a temporary folder
removed at the end, or with ``--keep-runs DIR`` to DIR/seed<N> (to look at a seed that ended
low afterwards, e.g. ``python bench/qvalues.py DIR/seed0``).

Besides the medians, the line holds what a sweep over many seeds compares (e.g. ``--first-seed
36 --seeds 70 --set dqn.tau=0.02``, bench/results/cartpole-gamma-sweep.json):
``finals_at_target`` (seeds whose final evaluation reached the target), ``never_solved``,
``late_evals_below_target`` (evaluations in the second half of the run under the
target, and how many there were: a policy that solves and then slides shows here) and each
seed's ``learner_q_mean_per_seed`` (the learner's mean Q(s, a) at the end; with rewards of at
most r_max it cannot honestly exceed r_max / (1 - gamma)).

``--rtt-ms R`` runs each seed with ``bench/wanrun.py`` instead: the same services, but the
learner reaches the parameter server through a DelayRelay adding R/2 ms each way (actors
and the evaluator dial the server directly). For a slow link use the tuned experiment:
``--config configs/cartpole-dqn-wan.yaml --rtt-ms 300``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from curve import read_run  # noqa: E402  (bench/curve.py: a run folder's evaluations and summary)


def sweep_figures(summaries: list[dict], evals: list[list[dict]]) -> dict:
    """Whether the seeds stay solved: finals at the target, seeds never solved, evaluations in
    the second half of each seed's run under the target, the learner's final mean Q."""
    late = [[e for e in ev if e["env_steps"] >= s["env_steps"] / 2] for s, ev in zip(summaries, evals)]
    solved = [s["time_to_target_seconds"] for s in summaries if s["time_to_target_seconds"] is not None]
    return {
        "finals_at_target": sum(s["final_eval_return"] is not None and s["final_eval_return"] >= s["target_return"]
                                for s in summaries),
        "never_solved": sum(s["time_to_target_seconds"] is None for s in summaries),
        # the sweeps' median: over the seeds that solved (the headline median needs them all)
        "median_time_to_target_solved_seconds": statistics.median(solved) if solved else None,
        "late_evals_below_target": sum(e["mean_return"] < s["target_return"]
                                       for s, lt in zip(summaries, late) for e in lt),
        "late_evals": sum(len(lt) for lt in late),
        "learner_q_mean_per_seed": [s.get("learner_q_mean") for s in summaries],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds FIRST .. FIRST+SEEDS-1")
    p.add_argument("--config", default=str(ROOT / "configs/cartpole-dqn.yaml"))
    p.add_argument("--grad-encoding", default="", choices=["", "fp32", "bf16", "fp16", "onebit"])
    p.add_argument("--rtt-ms", type=float, default=None,
                   help="round trip between learner and parameter server (via bench/wanrun.py)")
    p.add_argument("--stop-at-target", action="store_true", help="stop each run at the target (faster, no final-eval check)")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--keep-runs", default="", metavar="DIR", help="keep each seed's run folder as DIR/seed<N>")
    args = p.parse_args()
    overrides = list(args.overrides)
    overrides.append(f"run.stop_at_target={'true' if args.stop_at_target else 'false'}")
    if args.grad_encoding:
        overrides.append(f"learner.grad_encoding={args.grad_encoding}")
    summaries, evals = [], []
    with tempfile.TemporaryDirectory(prefix="amprl-bench-cartpole-") as tmp:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            run_dir = Path(args.keep_runs or tmp) / f"seed{seed}"
            cmd = [sys.executable, "-m", "amprl.cli", "run", args.config, "--run-dir", str(run_dir),
                   "--progress-interval", "5", "--set", f"run.seed={seed}"]
            if args.rtt_ms is not None:
                cmd = [sys.executable, str(ROOT / "bench/wanrun.py"), args.config, "--run-dir", str(run_dir),
                       "--rtt-ms", str(args.rtt_ms), "--progress-interval", "5", "--set", f"run.seed={seed}"]
            for o in overrides:
                cmd += ["--set", o]
            proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            summary_path = run_dir / "summary.json"
            if proc.returncode != 0 or not summary_path.exists():
                print(proc.stdout[-3000:], file=sys.stderr)
                print(json.dumps({"error": f"seed {seed} failed with exit code {proc.returncode}"}))
                return 1
            run_evals, summary = read_run(run_dir)
            summaries.append(summary)
            evals.append(run_evals)
    ttt = [s["time_to_target_seconds"] for s in summaries]
    stt = [s["steps_to_target"] for s in summaries]
    figures = sweep_figures(summaries, evals)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if len(xs) == len(summaries) else None

    print(json.dumps({
        "config": Path(args.config).name,
        "overrides": overrides,
        "rtt_ms": args.rtt_ms,
        "seeds": args.seeds,
        "first_seed": args.first_seed,
        "solved_seeds": len(summaries) - figures["never_solved"],
        "time_to_target_seconds": med(ttt),
        "steps_to_target": med(stt),
        "time_to_target_seconds_per_seed": ttt,
        "steps_to_target_per_seed": stt,
        "final_eval_returns": [s["final_eval_return"] for s in summaries],
        "env_steps_per_seed": [s["env_steps"] for s in summaries],
        "updates_per_seed": [s["updates"] for s in summaries],
        "wall_seconds_per_seed": [s["wall_seconds"] for s in summaries],
        "startup_seconds_per_seed": [s["startup_seconds"] for s in summaries],
        **figures,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
