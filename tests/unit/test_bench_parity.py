"""bench/parity.py's figures: medians over seeds, steps to the threshold, the comparison."""

import importlib.util
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
