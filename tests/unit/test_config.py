"""The experiment config: numbers as people write them, and the errors that name the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from amprl.config import config_to_dict, load_config
from amprl.config.schema import experiment_schema
from amprl.errors import ConfigError


@pytest.mark.parametrize("text, expected", [
    ("1e-6", 1e-6), ("1E-6", 1e-6), ("2.5e-4", 2.5e-4), ("1.0e-6", 1e-6), (".5e-3", 5e-4),
    ("0.00023", 2.3e-4), ("3", 3.0),
])
def test_float_overrides_take_exponent_notation(text, expected):
    # PyYAML reads 1e-6 (no dot, or an unsigned exponent) as a string.
    cfg = load_config(None, [f"paramserver.adam_eps={text}"])
    assert cfg.paramserver.adam_eps == pytest.approx(expected)
    assert isinstance(cfg.paramserver.adam_eps, float)


def test_exponent_notation_in_a_yaml_file_and_for_integers_and_optional_numbers(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("paramserver:\n  lr: 3e-4\n  lr_final: 1E-5\nrun:\n  total_env_steps: 1e6\n")
    cfg = load_config(path, ["replay.max_priority=2e2"])
    assert cfg.paramserver.lr == pytest.approx(3e-4)
    assert cfg.paramserver.lr_final == pytest.approx(1e-5)
    assert cfg.run.total_env_steps == 1_000_000 and isinstance(cfg.run.total_env_steps, int)
    assert cfg.replay.max_priority == pytest.approx(200.0)


@pytest.mark.parametrize("override, message", [
    ("paramserver.adam_eps=tiny", "paramserver.adam_eps: expected a number, got 'tiny'"),
    ("paramserver.lr=1e-6x", "paramserver.lr: expected a number"),
    ("paramserver.lr=.inf", "paramserver.lr: expected a finite number"),
    ("paramserver.lr=.nan", "paramserver.lr: expected a finite number"),
    ("paramserver.lr=1e400", "paramserver.lr: expected a finite number"),
    ("run.total_env_steps=1e-3", "run.total_env_steps: expected an integer, got 0.001"),
    ("learner.batch_size=true", "learner.batch_size: expected an integer"),
    ("learner.precision=fp8", "learner.precision: 'fp8' is not one of"),
    ("learner.batch_sise=64", "unknown key learner.batch_sise"),
    ("paramserver.lr=-1e-3", "paramserver.lr: -0.001 must be > 0"),
    ("env.id", "override 'env.id': expected key=value"),
    ("deploy.nice.replay=-5", "deploy.nice.replay: -5 must be in [0, 19]"),
    ("deploy.nice.actor=20", "deploy.nice.actor: 20 must be in [0, 19]"),
    ("deploy.nice.actors=5", "unknown key deploy.nice.actors"),
    ("replay.capacity=0", "replay.capacity: 0 must be >= 1"),
    ("td3.tau=0", "td3.tau: 0.0 must be in (0, 1]"),
    ("td3.hidden_sizes=[]", "td3.hidden_sizes: [] must be a list of at least 1 item(s), each >= 1"),
    ("network.hidden_sizes=[64, 0]", "network.hidden_sizes: [64, 0] must be a list of each >= 1"),
    ("paramserver.lr_final=0", "paramserver.lr_final: 0.0 must be > 0 (or negative: no schedule)"),
    ("run.nice.actor=3", "run.nice: moved to deploy.nice"),
    ("learner.torch_threads=2", "learner.torch_threads: moved to deploy.learner_torch_threads"),
    ("dqn.bootstrap_max=200", "dqn.bootstrap_max: removed (docs/experiments/2026-12-07-removed-knobs.md"),
])
def test_bad_values_are_errors_that_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_a_string_key_keeps_numeric_looking_text():
    # Only keys that want a number read "1e5" as one.
    assert load_config(None, ["name=1e5"]).name == "1e5"


ROOT = Path(__file__).resolve().parents[2]
# How the learner talks to the parameter server: the only keys where the slow-link config
# may differ from the default experiment (besides its name).
_LINK_KEYS = {"learner.grad_encoding", "learner.max_pushes_in_flight", "learner.max_batches_per_push",
              "learner.push_timeout_s", "learner.pull_lag_versions", "learner.steps_per_push",
              "paramserver.max_staleness"}


def _flat(cfg) -> dict:
    return {f"{section}.{key}": value for section, fields in config_to_dict(cfg).items()
            if isinstance(fields, dict) for key, value in fields.items()}


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert load_config(path).name == path.stem


@pytest.mark.parametrize("wan", sorted(p.name for p in (ROOT / "configs").glob("*-wan.yaml")))
def test_each_slow_link_config_trains_its_base_configs_agent(wan):
    default = _flat(load_config(ROOT / "configs" / wan.replace("-wan", "")))
    flat = _flat(load_config(ROOT / "configs" / wan))
    differ = {k for k in default if default[k] != flat[k]}
    assert differ <= _LINK_KEYS | {"learner.sync"}, f"agent settings that drifted apart: {sorted(differ - _LINK_KEYS)}"
    assert flat["learner.grad_encoding"] == "onebit" and flat["learner.sync"] == "local_replica"


def test_deploy_nice_defaults_put_the_learner_first_and_name_services_by_process():
    nice = load_config(None, ["deploy.nice.actor=7"]).deploy.nice
    assert nice.learner == 0 and nice.replay == nice.paramserver == nice.redis == nice.evaluator == 19
    assert nice.of("actor-3") == 7 and nice.of("replay") == 19 and nice.of("learner") == 0


def test_the_charts_experiment_schema_is_generated_from_the_config_declarations():
    """charts/amprl/values.schema.json's ``experiment`` is what amprl.config.schema makes
    (regenerate: python -m amprl.config.schema charts/amprl/values.schema.json)."""
    committed = json.loads((ROOT / "charts/amprl/values.schema.json").read_text())
    assert committed["properties"]["experiment"] == experiment_schema()


def test_the_schema_states_the_declared_ranges_choices_and_meanings():
    schema = experiment_schema()["properties"]
    capacity = schema["replay"]["properties"]["capacity"]
    assert capacity["type"] == "integer" and capacity["minimum"] == 1
    assert capacity["description"].startswith("Transitions kept")
    assert schema["td3"]["properties"]["tau"]["exclusiveMinimum"] == 0
    assert schema["learner"]["properties"]["sync"]["enum"] == ["overlapped", "synchronous", "local_replica"]
    assert schema["network"]["properties"]["hidden_sizes"]["items"] == {"type": "integer", "minimum": 1}
    assert schema["deploy"]["properties"]["nice"]["properties"]["actor"]["maximum"] == 19
    assert schema["replay"]["additionalProperties"] is False


def test_env_import_and_kwargs_are_read_and_written_under_their_yaml_keys(tmp_path):
    """``import`` is a Python keyword: the field is ``import_``, the key ``import``."""
    path = tmp_path / "exp.yaml"
    path.write_text("env:\n  id: Signal-v0\n  import: [mypkg.envs]\n  kwargs: {length: 10, mode: hard}\n")
    cfg = load_config(path, ["env.kwargs.speed=1.5"])
    assert cfg.env.import_ == ["mypkg.envs"]
    assert cfg.env.kwargs == {"length": 10, "mode": "hard", "speed": 1.5}
    written = config_to_dict(cfg)["env"]
    assert written["import"] == ["mypkg.envs"] and "import_" not in written
    dumped = tmp_path / "dumped.yaml"
    from amprl.config import dump_config
    dump_config(cfg, dumped)
    assert load_config(dumped) == cfg
    env = experiment_schema()["properties"]["env"]["properties"]
    assert env["import"]["items"] == {"type": "string"} and env["kwargs"]["type"] == "object"


@pytest.mark.parametrize("override, message", [
    ("env.import=mypkg", "env.import: expected a list, got 'mypkg'"),
    ("env.import_=[mypkg]", "unknown key env.import_"),
    ("env.kwargs=3", "env.kwargs: expected a mapping, got 3"),
])
def test_env_import_and_kwargs_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


@pytest.mark.parametrize("text, message", [
    ("run:\n  total_env_steps: [1\n", "YAML syntax error at line 3, column 1"),
    ("run:\n\tseed: 1\n", "YAML syntax error at line 2, column 1"),
])
def test_a_yaml_syntax_error_is_a_config_error_with_its_place(tmp_path, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(tmp_path / "bad.yaml")


def test_a_missing_config_file_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="config file .*nope.yaml: No such file"):
        load_config(tmp_path / "nope.yaml")
