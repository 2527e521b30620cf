"""The algorithm registry: every name ``algo`` accepts has an entry, a config section of
that name and a builder with every part; loading a config needs no torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest

from amprl import algos
from amprl.config import ExperimentConfig, load_config


def test_algo_accepts_exactly_the_registry_names():
    hints = typing.get_type_hints(ExperimentConfig)
    assert set(typing.get_args(hints["algo"])) == set(algos.ALGOS)


@pytest.mark.parametrize("name", sorted(algos.ALGOS))
def test_each_algorithm_has_a_section_named_after_it(name):
    fields = {f.name: f for f in dataclasses.fields(ExperimentConfig)}
    assert typing.get_type_hints(ExperimentConfig)[name] is algos.ALGOS[name].config
    cfg = load_config(overrides=[f"algo={name}"])
    assert cfg.algo_config is getattr(cfg, name)
    assert (cfg.n_step, cfg.gamma) == (getattr(cfg, name).n_step, getattr(cfg, name).gamma)
    assert fields[name].default_factory is algos.ALGOS[name].config


@pytest.mark.parametrize("name", sorted(algos.ALGOS))
def test_each_builder_gives_every_part(name):
    builder = algos.builder(name)
    for part in ("build_model", "make_learner", "make_behaviour", "make_greedy_policy"):
        assert callable(getattr(builder, part)), f"{name}: no {part}"


def test_an_unknown_algorithm_is_named_in_the_error():
    with pytest.raises(ValueError, match="'ppo'"):
        algos.builder("ppo")


def test_loading_a_config_imports_no_torch():
    code = ("import sys; from amprl.config import load_config; load_config(overrides=['algo=td3']);"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"
