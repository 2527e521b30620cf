"""`amprl plot`: learning curves from run folders, one run or several with mean and spread."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from amprl.cli import main as amprl
from amprl.launch.plot import across_runs, read_curve


def fake_run(folder, returns, steps_per_eval=1000, seconds_per_eval=2.0, target=None):
    folder.mkdir(parents=True)
    with (folder / "eval.jsonl").open("w") as f:
        for i, r in enumerate(returns):
            f.write(json.dumps({"param_version": 10 * i, "mean_return": r, "std_return": 1.0,
                                "episodes": 10, "env_steps": steps_per_eval * i,
                                "wall_seconds": seconds_per_eval * i, "unix_time": 0.0}) + "\n")
    if target is not None:
        (folder / "summary.json").write_text(json.dumps({"target_return": target}))
    return folder


def test_mean_and_spread_are_taken_over_the_range_every_run_covers():
    xs = [np.array([0.0, 10.0]), np.array([0.0, 5.0, 20.0])]
    ys = [np.array([0.0, 10.0]), np.array([0.0, 15.0, 30.0])]
    grid, mean, std = across_runs(xs, ys, points=3)
    np.testing.assert_allclose(grid, [0, 5, 10])
    np.testing.assert_allclose(mean, [0, (5 + 15) / 2, (10 + 20) / 2])
    np.testing.assert_allclose(std, [0, 5, 5])


def test_repeated_env_steps_keep_the_latest_evaluation():
    grid, mean, _ = across_runs([np.array([0.0, 0.0, 4.0])], [np.array([1.0, 3.0, 7.0])], points=2)
    np.testing.assert_allclose(mean, [3.0, 7.0])


def test_runs_that_do_not_overlap_have_no_mean():
    with pytest.raises(ValueError, match="do not overlap"):
        across_runs([np.array([0.0, 1.0]), np.array([2.0, 3.0])], [np.zeros(2), np.zeros(2)])


def test_one_run_and_several_runs_are_drawn(tmp_path, capsys):
    a = fake_run(tmp_path / "a", [10, 50, 200, 480], target=475)
    b = fake_run(tmp_path / "b", [12, 80, 300, 500, 500], steps_per_eval=900, target=475)
    assert amprl(["plot", str(a), "-o", str(tmp_path / "one.png")]) == 0
    assert amprl(["plot", str(a), str(b), "-o", str(tmp_path / "two.png"), "--title", "seeds"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["runs"] == [str(a), str(b)]
    for name in ("one.png", "two.png"):
        with Image.open(tmp_path / name) as img:
            assert img.format == "PNG" and img.size == (1100, 420)
    assert read_curve(a).target_return == 475


def test_a_folder_without_evaluations_is_a_clear_error(tmp_path, capsys):
    assert amprl(["plot", str(tmp_path), "-o", str(tmp_path / "c.png")]) == 2
    assert "no evaluations" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_groups_are_drawn_each_in_its_own_color(tmp_path):
    from amprl.launch.plot import plot_groups
    a = [fake_run(tmp_path / f"a{i}", [10 + i, 50, 200, 480]) for i in range(2)]
    b = [fake_run(tmp_path / "b0", [-100, -50, 0, 20], target=475)]
    out = plot_groups({"fp32_0ms": a, "onebit_300ms": b}, tmp_path / "groups.png", title="parity")
    with Image.open(out) as img:
        colors = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert (0x1F, 0x77, 0xB4) in colors and (0xFF, 0x7F, 0x0E) in colors  # matplotlib's C0 and C1
