"""Pendulum-v1 TD3 through the whole system: median time- and steps-to-target over seeds.

    python bench/pendulum.py --seeds 3 [--set key=value ...] [--out bench/results/pendulum.json]

Runs `amprl run configs/pendulum-td3.yaml` once per seed, one after another, each until the
greedy eval return first reaches the target (-200, mean of 10 episodes) or the config's
wall limit. Time-to-target is measured from the moment every service was serving (the
launcher's ``time_to_target_seconds``). Records the 1-minute load average before each run,
since the machine may be shared. Prints one JSON line (and writes it to --out if given).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--config", default=str(ROOT / "configs/pendulum-td3.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args()
    overrides = ["run.stop_at_target=true", *args.overrides]
    summaries, loads = [], []
    with tempfile.TemporaryDirectory(prefix="amprl-bench-pendulum-") as tmp:
        for seed in range(args.seeds):
            run_dir = Path(tmp) / f"seed{seed}"
            cmd = [sys.executable, "-m", "amprl.cli", "run", args.config, "--run-dir", str(run_dir),
                   "--progress-interval", "5", "--set", f"run.seed={seed}"]
            for o in overrides:
                cmd += ["--set", o]
            loads.append(round(os.getloadavg()[0], 2))
            proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            summary_path = run_dir / "summary.json"
            if proc.returncode != 0 or not summary_path.exists():
                print(proc.stdout[-3000:], file=sys.stderr)
                print(json.dumps({"error": f"seed {seed} failed with exit code {proc.returncode}"}))
                return 1
            summaries.append(json.loads(summary_path.read_text()))
    ttt = [s["time_to_target_seconds"] for s in summaries]
    stt = [s["steps_to_target"] for s in summaries]

    def med(xs):
        # a seed that never reached the target counts as infinitely slow
        vals = sorted(float("inf") if x is None else x for x in xs)
        m = statistics.median(vals)
        return None if m == float("inf") else m

    result = {
        "config": Path(args.config).name,
        "overrides": overrides,
        "seeds": args.seeds,
        "target_return": summaries[0]["target_return"],
        "solved_seeds": sum(t is not None for t in ttt),
        "time_to_target_seconds": med(ttt),
        "steps_to_target": med(stt),
        "time_to_target_seconds_per_seed": ttt,
        "steps_to_target_per_seed": stt,
        "updates_per_seed": [s["updates"] for s in summaries],
        "final_eval_returns": [s["final_eval_return"] for s in summaries],
        "startup_seconds_per_seed": [s["startup_seconds"] for s in summaries],
        "load_average_1min_before_each_run": loads,
        "cpus": os.cpu_count(),
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
