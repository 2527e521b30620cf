"""`amprl enjoy` and `amprl export`: the best (or final) weights of a run folder played
greedily and written out, as TorchScript or a torch.export program that acts without this
package, or as a plain state dict; and the same weights pulled from a live parameter server."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from amprl import algos
from amprl.cli import main as amprl
from amprl.config import load_config
from amprl.core import Pulled
from amprl.envs.factory import env_spec
from amprl.evaluator import evaluator as evaluator_mod
from amprl.evaluator.evaluator import Evaluator
from amprl.config import dump_config
from amprl.launch.agent import enjoy
from amprl.paramserver.checkpoint import CheckpointManager
from amprl.paramserver.store import ParameterStore

LOAD = {"torchscript": lambda path: torch.jit.load(str(path)),
        "exported_program": lambda path: torch.export.load(str(path)).module()}
"""The documented first line of each format's snippet."""


class OnePS:
    def __init__(self, weights):
        self.weights = weights

    def pull_versioned(self, have_version=0, have_incarnation=0, *, encoding="fp32", timeout=None):
        if have_version:
            return Pulled(have_version, 1, None)
        return Pulled(7, 1, {k: v.clone() for k, v in self.weights.items()})


def run_folder(tmp_path, monkeypatch, overrides):
    """A run folder whose best/ holds version 7 of a fresh network, as the evaluator writes it."""
    cfg = load_config(None, overrides)
    spec = env_spec(cfg.env)
    torch.manual_seed(3)
    weights = {n: p.detach().clone() for n, p in algos.build_model(cfg, spec).named_parameters()}
    ev = Evaluator(cfg, spec, OnePS(weights), replay=None, run_dir=str(tmp_path))
    with monkeypatch.context() as m:
        m.setattr(evaluator_mod, "run_episodes", lambda *a, **k: [1.0, 2.0])
        ev.evaluate_once()
    return cfg, spec, weights


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated")  # torch's, when loading
@pytest.mark.parametrize("fmt,name", [("torchscript", "policy.pt"), ("exported_program", "policy.pt2")])
@pytest.mark.parametrize("overrides", [["network.hidden_sizes=[16]"],
                                       ["env.id=Pendulum-v1", "algo=td3", "td3.hidden_sizes=[16]"]],
                         ids=["dqn", "td3"])
def test_a_module_export_acts_like_the_greedy_policy_on_any_batch_size(tmp_path, monkeypatch,
                                                                       overrides, fmt, name, capsys):
    cfg, spec, weights = run_folder(tmp_path, monkeypatch, overrides)
    out = tmp_path / name
    assert amprl(["export", str(tmp_path), "-o", str(out), "--format", fmt]) == 0
    assert json.loads(capsys.readouterr().out)["param_version"] == 7
    policy = LOAD[fmt](out)
    model = algos.build_model(cfg, spec)
    model.load_state_dict(weights)
    greedy = algos.builder(cfg.algo).make_greedy_policy(model)
    obs = np.random.default_rng(0).standard_normal((5, *spec.obs_shape)).astype(np.float32)
    actions = policy(torch.as_tensor(obs)).numpy()
    np.testing.assert_allclose(actions, np.asarray(greedy(obs)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(policy(torch.as_tensor(obs[:1])).numpy(), actions[:1], rtol=1e-5, atol=1e-6)


def test_making_torchscript_shows_no_deprecation_warning(tmp_path, monkeypatch, recwarn):
    run_folder(tmp_path, monkeypatch, ["network.hidden_sizes=[16]"])
    assert amprl(["export", str(tmp_path), "-o", str(tmp_path / "policy.pt")]) == 0
    assert not [w for w in recwarn if "torch.jit" in str(w.message)]


def test_an_exported_program_must_be_named_pt2(tmp_path, monkeypatch, capsys):
    run_folder(tmp_path, monkeypatch, ["network.hidden_sizes=[16]"])
    assert amprl(["export", str(tmp_path), "-o", str(tmp_path / "p.pt"), "--format", "exported_program"]) == 2
    assert "name it p.pt2" in capsys.readouterr().err


def test_state_dict_export_loads_into_the_network_the_config_builds(tmp_path, monkeypatch):
    cfg, spec, weights = run_folder(tmp_path, monkeypatch, ["network.hidden_sizes=[16]"])
    out = tmp_path / "policy.pt"
    assert amprl(["export", str(tmp_path), "-o", str(out), "--format", "state_dict"]) == 0
    model = algos.build_model(cfg, spec)
    model.load_state_dict(torch.load(out, weights_only=True))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[name])


def test_enjoy_plays_the_best_weights_greedily(tmp_path, monkeypatch):
    run_folder(tmp_path, monkeypatch, ["network.hidden_sizes=[16]"])
    result = enjoy(tmp_path, episodes=3, seed=1)
    assert result["param_version"] == 7 and result["episodes"] == 3 and len(result["returns"]) == 3
    assert result["mean_return"] == pytest.approx(np.mean(result["returns"]), abs=1e-3)
    assert all(r >= 1 for r in result["returns"])  # CartPole pays 1 per step


def final_checkpoints(tmp_path, cfg, spec):
    """Two checkpoints in the run folder (versions 1 and 2); returns the newest weights."""
    store = ParameterStore.from_model(algos.build_model(cfg, spec), lr=1e-2)
    manager = CheckpointManager(tmp_path / "checkpoints")
    dump_config(cfg, tmp_path / "config.yaml")
    for v in range(2):
        store.apply(v, {n: torch.ones(s) for n, s in store.shapes.items()})
        manager.save(store)
    return {n: t.clone() for n, t in store.snapshot()[1].items()}


def test_final_plays_and_exports_the_newest_checkpoint(tmp_path, monkeypatch, capsys):
    cfg, spec, _ = run_folder(tmp_path, monkeypatch, ["network.hidden_sizes=[16]"])
    final = final_checkpoints(tmp_path, cfg, spec)
    result = enjoy(tmp_path, episodes=2, seed=1, final=True)
    assert result["weights"] == "final" and result["param_version"] == 2
    out = tmp_path / "final.pt"
    assert amprl(["export", str(tmp_path), "--final", "-o", str(out), "--format", "state_dict"]) == 0
    assert json.loads(capsys.readouterr().out) == {"output": str(out), "format": "state_dict",
                                                    "weights": "final", "param_version": 2}
    state = torch.load(out, weights_only=True)
    assert all(torch.equal(state[n], final[n].float()) for n in final)


def test_final_skips_a_corrupted_newest_checkpoint(tmp_path, monkeypatch, capsys):
    cfg, spec, _ = run_folder(tmp_path, monkeypatch, ["network.hidden_sizes=[16]"])
    final_checkpoints(tmp_path, cfg, spec)
    newest = CheckpointManager(tmp_path / "checkpoints").files()[0][1]
    newest.write_bytes(newest.read_bytes()[:-10])  # a torn write
    assert enjoy(tmp_path, episodes=1, seed=1, final=True)["param_version"] == 1
    assert "checksum mismatch" in capsys.readouterr().err


def test_final_without_checkpoints_is_a_clear_error(tmp_path, monkeypatch, capsys):
    cfg, _, _ = run_folder(tmp_path, monkeypatch, ["network.hidden_sizes=[16]"])
    dump_config(cfg, tmp_path / "config.yaml")
    assert amprl(["enjoy", str(tmp_path), "--final"]) == 2
    assert "no readable checkpoint" in capsys.readouterr().err


def test_render_without_a_display_is_a_clear_error(tmp_path, monkeypatch, capsys):
    run_folder(tmp_path, monkeypatch, ["network.hidden_sizes=[16]"])
    for var in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER"):
        monkeypatch.delenv(var, raising=False)
    assert amprl(["enjoy", str(tmp_path), "--render"]) == 2
    assert "no display" in capsys.readouterr().err
    assert amprl(["enjoy", str(tmp_path), "--render", "--video", str(tmp_path / "v.mp4")]) == 2
    assert "choose one" in capsys.readouterr().err


def test_render_builds_human_envs_one_episode_at_a_time(tmp_path, monkeypatch):
    from amprl.envs import episodes
    run_folder(tmp_path, monkeypatch, ["network.hidden_sizes=[16]"])
    monkeypatch.setenv("DISPLAY", ":99")
    made, real = [], episodes.make_env

    def make_env(cfg, seed=None, *, training=True, render_mode=None):
        made.append(render_mode)
        return real(cfg, seed, training=training)  # no window here: the wiring is under test

    monkeypatch.setattr(episodes, "make_env", make_env)
    assert len(enjoy(tmp_path, episodes=2, seed=1, human=True)["returns"]) == 2
    assert made == ["human", "human"]


def test_a_folder_without_best_weights_is_a_clear_error(tmp_path, capsys):
    assert amprl(["enjoy", str(tmp_path)]) == 2
    assert "no best weights" in capsys.readouterr().err
    assert amprl(["export", "-o", str(tmp_path / "p.pt")]) == 2
    assert "run folder or --paramserver" in capsys.readouterr().err


def test_export_pulls_a_live_parameter_servers_weights(tmp_path, capsys):
    from amprl.paramserver.service import create_server
    cfg = load_config(None, ["network.hidden_sizes=[16]"])
    spec = env_spec(cfg.env)
    model = algos.build_model(cfg, spec)
    server = create_server(cfg, model, host="127.0.0.1", port=0)
    try:
        config = tmp_path / "exp.yaml"
        config.write_text("network:\n  hidden_sizes: [16]\n")
        out = tmp_path / "live.pt"
        assert amprl(["export", "--paramserver", f"127.0.0.1:{server.port}", "--config", str(config),
                      "-o", str(out), "--format", "state_dict"]) == 0
        assert json.loads(capsys.readouterr().out)["param_version"] == 0
        state = torch.load(out, weights_only=True)
        for name, p in model.named_parameters():
            assert torch.equal(state[name], p.detach())
    finally:
        server.stop(0)
