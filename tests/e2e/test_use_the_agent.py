"""End to end: what a user does with a finished CartPole run, through the real commands.

One short `amprl run` (module-scoped: every test reads the same run folder), then `amprl
enjoy` (best and final weights, a video, a window), `amprl export` in each format loaded
back where this package cannot be imported, and `amprl plot`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(amprl_run_module, tmp_path_factory):
    """A finished run: about 3,000 env steps, an evaluation a second, a final checkpoint."""
    run_dir = tmp_path_factory.mktemp("use-the-agent") / "run"
    code, out = amprl_run_module(["configs/cartpole-dqn.yaml", "--run-dir", str(run_dir),
                                  "--set", "run.total_env_steps=3000", "--set", "run.max_wall_seconds=90",
                                  "--set", "evaluator.interval_s=1", "--progress-interval", "5"],
                                 timeout_s=240)
    assert code == 0, out[-4000:]
    return run_dir


def amprl(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    """Runs `amprl ARGS` as a user would; its JSON line of output."""
    proc = subprocess.run([sys.executable, "-m", "amprl.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_mp4(path: Path) -> np.ndarray:
    reader = imageio_ffmpeg.read_frames(str(path))
    w, h = next(reader)["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader])


def test_a_run_leaves_its_learning_curves(run_dir):
    with Image.open(run_dir / "curves.png") as img:
        assert img.format == "PNG" and img.size[0] > 500


def test_enjoy_plays_the_best_and_the_final_weights(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    best = amprl("enjoy", str(run_dir), "--episodes", "3")
    final = amprl("enjoy", str(run_dir), "--episodes", "3", "--final")
    assert best["weights"] == "best" and best["param_version"] == summary["best"]["param_version"]
    assert final["weights"] == "final" and final["param_version"] == summary["param_version"]
    for played in (best, final):
        assert len(played["returns"]) == 3 and all(r >= 1 for r in played["returns"])
        assert played["mean_return"] == pytest.approx(np.mean(played["returns"]), abs=1e-3)
        assert played["std_return"] == pytest.approx(np.std(played["returns"]), abs=1e-3)


def test_enjoy_video_is_a_playable_mp4_of_the_first_episode(run_dir, tmp_path):
    pytest.importorskip("pygame", reason="CartPole draws with pygame (gymnasium[classic-control])")
    played = amprl("enjoy", str(run_dir), "--episodes", "2", "--video", str(tmp_path / "cartpole.mp4"))
    frames = read_mp4(tmp_path / "cartpole.mp4")
    # the reset's picture and one per step; CartPole pays 1 per step
    assert frames.shape == (int(played["returns"][0]) + 1, 400, 600, 3)
    assert frames.std() > 0


def test_enjoy_render_plays_in_a_window(run_dir):
    pytest.importorskip("pygame", reason="CartPole draws with pygame (gymnasium[classic-control])")
    # SDL's dummy video driver: a real pygame window, drawn nowhere (no display here)
    played = amprl("enjoy", str(run_dir), "--episodes", "1", "--render", env={"SDL_VIDEODRIVER": "dummy"})
    assert played["episodes"] == 1 and played["returns"][0] >= 1


ACT_WITHOUT_AMPRL = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path = [p for p in sys.path if not (Path(p or ".") / "amprl").is_dir()]
    sys.modules["amprl"] = None  # any import of this package fails
    import torch
    obs = [0.01, -0.02, 0.03, 0.04]  # a CartPole observation
    policy = torch.jit.load("policy.pt") if sys.argv[1] == "torchscript" else torch.export.load("policy.pt2").module()
    action = policy(torch.as_tensor(obs).unsqueeze(0))[0]
    print(json.dumps({"action": int(action), "amprl": "amprl" in sys.modules and sys.modules["amprl"] is not None}))
""")


@pytest.mark.parametrize("fmt,name", [("torchscript", "policy.pt"), ("exported_program", "policy.pt2")])
def test_an_exported_policy_acts_where_amprl_cannot_be_imported(run_dir, tmp_path, fmt, name):
    from amprl.launch.agent import build, load_best
    exported = amprl("export", str(run_dir), "-o", str(tmp_path / name), "--format", fmt)
    assert exported["format"] == fmt and exported["weights"] == "best"
    proc = subprocess.run([sys.executable, "-c", ACT_WITHOUT_AMPRL, fmt], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acted = json.loads(proc.stdout.strip().splitlines()[-1])
    best = load_best(run_dir)
    model, _ = build(best.cfg, best.tensors)  # the same weights, in this process
    greedy = int(model(torch.tensor([[0.01, -0.02, 0.03, 0.04]])).argmax(dim=1)[0])
    assert acted == {"action": greedy, "amprl": False}


def test_a_state_dict_export_loads_into_the_network_the_config_builds(run_dir, tmp_path):
    from amprl import algos
    from amprl.config import load_config
    from amprl.envs.factory import env_spec
    amprl("export", str(run_dir), "-o", str(tmp_path / "weights.pt"), "--format", "state_dict", "--final")
    cfg = load_config(run_dir / "config.yaml")
    model = algos.build_model(cfg, env_spec(cfg.env))
    model.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    assert model(torch.zeros(1, 4)).shape == (1, 2)


def test_plot_draws_one_run_and_several_overlaid(run_dir, tmp_path):
    # a second "seed": the same folder with its returns shifted, so the two curves differ
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(run_dir / "summary.json", other)
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    (other / "eval.jsonl").write_text("".join(
        json.dumps({**r, "mean_return": r["mean_return"] * 0.8}) + "\n" for r in rows))
    amprl("plot", str(run_dir), "-o", str(tmp_path / "one.png"))
    plotted = amprl("plot", str(run_dir), str(other), "-o", str(tmp_path / "two.png"))
    assert plotted["runs"] == [str(run_dir), str(other)]
    for name in ("one.png", "two.png"):
        with Image.open(tmp_path / name) as img:
            assert img.format == "PNG"
