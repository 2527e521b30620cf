"""bench/cartpole.py's sweep figures: finals at the target, seeds never solved, late evaluations."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_cartpole", ROOT / "bench" / "cartpole.py")
cartpole = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cartpole)


def summary(final, ttt, q, steps=50_000):
    return {"final_eval_return": final, "time_to_target_seconds": ttt, "target_return": 475.0,
            "env_steps": steps, "learner_q_mean": q}


def evals(*pairs):
    return [{"env_steps": s, "mean_return": r} for s, r in pairs]


def test_sweep_figures_count_finals_unsolved_seeds_and_late_evaluations():
    summaries = [summary(500.0, 12.0, 140.0),   # solved and stayed solved
                 summary(312.1, 9.0, 142.9),    # solved, then slid: late evals under 475
                 summary(380.0, None, 93.2),    # never solved
                 summary(475.0, 20.0, 150.0)]   # exactly at the target counts
    histories = [evals((10_000, 200.0), (24_999, 480.0), (25_000, 500.0), (50_000, 500.0)),
                 evals((20_000, 486.0), (30_000, 255.0), (40_000, 480.0), (50_000, 312.1)),
                 evals((30_000, 300.0), (50_000, 380.0)),
                 []]
    assert cartpole.sweep_figures(summaries, histories) == {
        "finals_at_target": 2, "never_solved": 1, "median_time_to_target_solved_seconds": 12.0,
        "late_evals_below_target": 4, "late_evals": 7,   # 0 of 2, 2 of 3, 2 of 2, none
        "learner_q_mean_per_seed": [140.0, 142.9, 93.2, 150.0]}


def test_no_seed_solved_has_no_median():
    assert cartpole.sweep_figures([summary(100.0, None, 50.0)], [[]])["median_time_to_target_solved_seconds"] is None
