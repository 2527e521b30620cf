"""bench/curve.py's reading of a run folder: the return reported at each step mark."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_curve", ROOT / "bench" / "curve.py")
curve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(curve)


def test_each_mark_reports_the_newest_eval_at_or_before_it(tmp_path):
    evals = [{"env_steps": s, "wall_seconds": s / 100, "mean_return": r, "std_return": 1.0,
              "param_version": s // 4} for s, r in ((0, -1.0), (24_000, 10.0), (26_000, 20.0),
                                                    (50_000, 30.0), (61_000, 40.0))]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    read, summary = curve.read_run(tmp_path)
    assert read == evals and summary == {}
    assert curve.marks(read, 25_000) == {
        "eval_return_at_25k_steps": 10.0, "wall_seconds_at_25k_steps": 240.0,
        "eval_return_at_50k_steps": 30.0, "wall_seconds_at_50k_steps": 500.0}
    assert curve.marks([], 25_000) == {}
