"""bench/parity.py's figures: medians over seeds, steps to the threshold, the comparison."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
spec = importlib.util.spec_from_file_location("bench_parity", ROOT / "bench" / "parity.py")
parity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parity)


def run(final, to_threshold, wall=100.0, grad_bytes=1_000_000, version=500, rejections=0, ups=5.0,
        untrained=-1200.0):
    return {"evaluations": [[0.0, 0, 0, untrained], [2.0, 1000, 400, final]], "final_eval_return": final, "steps_to_target": to_threshold, "wall_seconds": wall,
            "gradient_bytes_received": grad_bytes, "param_version": version,
            "stale_rejections": rejections, "updates_per_s": ups, "env_steps": 20_000, "error": None}


def test_steps_to_threshold_counts_a_seed_that_never_got_there_as_infinitely_many():
    assert parity.steps_to_threshold([4000, None, 6000]) == 6000
    assert parity.steps_to_threshold([4000, None, None]) is None
    assert parity.steps_to_threshold([4000, 5000, None, 9000]) == 7000  # mean of the middle two
    assert parity.steps_to_threshold([4000, 5000, None, None]) is None


def test_condition_figures_are_medians_over_seeds_and_bytes_per_optimizer_step():
    figs = parity.condition_figures([run(-150.0, 5000, grad_bytes=2_000_000, version=1000),
                                     run(-170.0, None, wall=120.0, grad_bytes=3_000_000, version=1000),
                                     run(-160.0, 7000, wall=110.0, grad_bytes=1_000_000, version=1000)], 300.0)
    assert figs["final_return_median"] == -160.0 and figs["final_returns"] == [-150.0, -170.0, -160.0]
    assert figs["steps_to_threshold"] == 7000 and figs["wall_seconds"] == 110.0
    assert figs["gradient_bytes_per_step"] == 2000.0 and figs["gradient_bytes_total"] == 2_000_000
    assert figs["rtt_ms"] == 300.0 and figs["errors"] == []


def test_the_comparison_is_against_fp32_on_the_local_link():
    out = {"fp32_0ms": parity.condition_figures([run(-200.0, 1, grad_bytes=30_000)], 0.0),
           "onebit_0ms": parity.condition_figures([run(-190.0, 1, grad_bytes=1_000)], 0.0),
           "fp32_300ms": parity.condition_figures([run(-210.0, 1, grad_bytes=31_000)], 300.0),
           "onebit_300ms": parity.condition_figures([run(-220.0, 1, grad_bytes=1_000)], 300.0)}
    c = parity.compare(out)
    assert c["onebit_300ms_final_return_over_fp32_0ms"] == pytest.approx(1.1)
    assert c["onebit_300ms_final_return_minus_fp32_0ms"] == -20.0
    # the untrained network scores -1200: 1-bit at 300 ms kept 980 of fp32's 1000 of gain
    assert c["onebit_300ms_gain_over_fp32_0ms_gain"] == 0.98 and c["untrained_return_median"] == -1200.0
    assert c["gradient_bytes_fp32_0ms_over_onebit_0ms"] == 30.0
    assert c["gradient_bytes_fp32_300ms_over_onebit_300ms"] == 31.0


def test_two_conditions_compare_too():
    out = {"fp32_0ms": parity.condition_figures([run(4000.0, 50_000, grad_bytes=31_000)], 0.0),
           "onebit_300ms": parity.condition_figures([run(3900.0, 60_000, grad_bytes=1_000)], 300.0)}
    c = parity.compare(out)
    assert c["onebit_300ms_final_return_over_fp32_0ms"] == 0.975
    assert c["gradient_bytes_fp32_0ms_over_onebit_300ms"] == 31.0


def test_an_unknown_condition_is_refused(capsys):
    with pytest.raises(SystemExit):
        parity.main([str(ROOT / "configs/pendulum-td3.yaml"), "--steps", "10", "--conditions", "fp16_0ms"])
    assert "unknown condition 'fp16_0ms'" in capsys.readouterr().err


def test_the_late_return_is_the_mean_over_the_last_tenth_of_the_steps():
    summary = {"evaluations": [[0.0, 0, 0, -1.0], [5.0, 80_000, 9, 100.0], [6.0, 91_000, 10, 3000.0],
                               [7.0, 100_000, 11, 4000.0]]}
    assert parity.late_return(summary) == 3500.0 and parity.late_return({"evaluations": []}) is None


def earlier_file(tmp_path, name="a.json", **meta):
    """A parity.json as the first version of bench/parity.py wrote it: per-seed lists of the
    figures only (no seeds, updates/s, untrained returns or evaluations per seed)."""
    figs = {"rtt_ms": 0.0, "untrained_return_median": -1.0, "final_return_median": 3800.0,
            "final_returns": [3000.0, 4600.0], "late_return_median": 3800.0, "late_returns": [3400.0, 4200.0],
            "steps_to_threshold": 68000, "steps_to_threshold_per_seed": [66000, 70000],
            "wall_seconds": 800.0, "wall_seconds_per_seed": [900.0, 700.0],
            "gradient_bytes_per_step": 700.0, "gradient_bytes_total": 70_000.0,
            "gradient_bytes_total_per_seed": [63_000, 77_000], "optimizer_steps_per_seed": [90, 110],
            "stale_rejections": [0, 0], "updates_per_s": 0.1, "env_steps_per_seed": [1000, 1000], "errors": []}
    m = {"name": "pendulum-td3-wan", "seeds": [0, 1], "steps": 1000, "threshold": 3000.0, "rtt_ms": 300.0,
         "overrides": [], "command": "python bench/parity.py ...", "date": "2026-12-07"}
    m.update(meta)
    path = tmp_path / name
    path.write_text(json.dumps({"fp32_0ms": figs, "meta": m}))
    return path


def test_an_earlier_files_seeds_join_and_the_medians_are_taken_again(tmp_path):
    old, metas = parity.combined([earlier_file(tmp_path)], "pendulum-td3-wan", 1000, 3000.0, 300.0, [])
    assert metas[0]["seeds"] == [0, 1]
    recs = old["fp32_0ms"]
    assert [r["seed"] for r in recs] == [0, 1] and [r["final"] for r in recs] == [3000.0, 4600.0]
    assert [r["updates_per_s"] for r in recs] == [0.1, 0.2]  # optimizer steps over wall seconds
    assert [r["untrained"] for r in recs] == [-1.0, -1.0] and recs[0]["evaluations"] is None
    new = parity.record(run(3500.0, 60_000, grad_bytes=7_000, version=10), seed=2)
    figs = parity.figures(recs + [new], 0.0)
    assert figs["seeds"] == [0, 1, 2] and figs["final_return_median"] == 3500.0
    assert figs["gradient_bytes_per_step"] == 700.0 and figs["steps_to_threshold"] == 66000
    # what figures() writes comes back as the same records
    again = parity.figures(parity.records_of(figs, [9, 9, 9]), 0.0)
    assert again == figs


def test_a_file_of_another_comparison_or_a_seed_twice_is_refused(tmp_path):
    with pytest.raises(ValueError, match="its steps is 1000, this comparison's 2000"):
        parity.combined([earlier_file(tmp_path)], "pendulum-td3-wan", 2000, 3000.0, 300.0, [])
    with pytest.raises(ValueError, match="fp32_0ms seed 1 is in an earlier file too"):
        parity.combined([earlier_file(tmp_path), earlier_file(tmp_path, "b.json", seeds=[1, 2])],
                        "pendulum-td3-wan", 1000, 3000.0, 300.0, [])


def test_combining_alone_redoes_the_figures_and_draws_the_curves_it_has(tmp_path, capsys):
    first = earlier_file(tmp_path)
    data = json.loads(first.read_text())
    data["onebit_300ms"] = parity.figures(
        [parity.record(run(3900.0, 50_000, grad_bytes=100, version=10), seed=0)], 300.0)
    first.write_text(json.dumps(data))
    out = tmp_path / "out"
    rc = parity.main([str(ROOT / "configs/pendulum-td3-wan.yaml"), "--steps", "1000", "--threshold", "3000",
                      "--seeds", "0", "--combine", str(first), "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "parity.json").read_text())
    assert result["fp32_0ms"]["final_returns"] == [3000.0, 4600.0]
    assert result["onebit_300ms"]["evaluations_per_seed"][0][-1] == [2.0, 1000, 400, 3900.0]
    assert result["comparison"]["gradient_bytes_fp32_0ms_over_onebit_300ms"] == 70.0
    assert result["meta"]["seeds"] == [0, 1] and result["meta"]["combined"][0]["file"] == str(first)
    assert (out / "parity.png").stat().st_size > 0  # the one run with evaluations
    with pytest.raises(SystemExit):
        parity.main([str(ROOT / "configs/pendulum-td3-wan.yaml"), "--steps", "1000", "--threshold", "3000",
                     "--seeds", "1", "--combine", str(first), "--out", str(out), "--conditions", "fp32_0ms"])
    assert "fp32_0ms seed 0 is in a --combine file already" in capsys.readouterr().err
