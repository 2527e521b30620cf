"""Loading the experiment config: YAML and ``key=value`` overrides onto the dataclasses of
``sections.py``, with every value checked against its declaration.

``load_config`` rejects an unknown key or a bad value with a ConfigError naming the key,
before any process starts. Overrides use dotted keys: ``--set learner.batch_size=64``;
values are YAML scalars, and a key that wants a number also takes exponent notation as
Python writes it (``1e-6``, which YAML 1.1 itself reads as a string). NaN and infinities
are refused. A key of an earlier version gets an error saying what replaced it. A field
named after a Python keyword ends in "_" and is written without it (``env.import``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from amprl.config.bounds import Bound
from amprl.config.sections import ExperimentConfig
from amprl.errors import ConfigError

# YAML 1.1 (PyYAML) reads 1e-6, 1E6 and 1.0e6 as strings: a float needs a dot and a signed
# exponent (1.0e-6). Numbers written the way Python and every other tool write them are
# taken as numbers where the key wants one.
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")


def yaml_key(field_name: str) -> str:
    """The key of a dataclass field in the YAML file: its name, less the "_" that a name
    clashing with a Python keyword ends in (``import_`` is ``import``)."""
    return field_name[:-1] if field_name.endswith("_") else field_name


def _coerce(value: Any, tp: Any, key: str) -> Any:
    if tp is Any:  # free-form (env.kwargs' values): what the YAML says
        return value
    origin = typing.get_origin(tp)
    if tp in (int, float) and isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        value = float(value)
    if origin in (types.UnionType, typing.Union):  # only `X | None`: null, or an X
        (inner,) = [t for t in typing.get_args(tp) if t is not type(None)]
        return None if value is None else _coerce(value, inner, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{key}: keys must be strings, got {k!r}")
        return {k: _coerce(v, value_tp, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


_REMOVED = "removed (docs/experiments/2026-12-07-removed-knobs.md says what it did)"

RENAMED = {
    "learner.apply_locally": "replaced by learner.sync (apply_locally: true is "
                             "sync: local_replica)",
    "run.nice": "moved to deploy.nice (scheduling is a deployment setting)",
    "learner.torch_threads": "moved to deploy.learner_torch_threads",
    "actor.torch_threads": "moved to deploy.actor_torch_threads",
    "learner.pin_update_thread": "moved to deploy.pin_learner_update_thread",
    "paramserver.optimizer": "removed: the parameter server's optimizer is Adam, the only one it had",
    "learner.onebit_precondition": "removed: 1-bit gradients are always preconditioned by the "
                                   "learner's Adam second moment (" + _REMOVED + ")",
    "dqn.clipped_double": _REMOVED,
    "dqn.bootstrap_max": _REMOVED,
}
"""Keys of earlier versions, with what replaced them (named in the error, not accepted)."""


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {yaml_key(f.name): f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    for key in unknown:
        if prefix + key in RENAMED:
            raise ConfigError(f"{prefix}{key}: {RENAMED[prefix + key]}")
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(names))})")
    kwargs = {names[k]: _coerce(v, hints[names[k]], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Applies ``key.sub=value`` strings (values parsed as YAML scalars) onto ``data``."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, text = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
        node[parts[-1]] = _parse_scalar(text)
    return data


def _check_bounds(obj: Any, prefix: str) -> None:
    """Every ``Bound`` declared on ``obj``'s fields (and those of its sections) holds."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_bounds(value, f"{prefix}{yaml_key(f.name)}.")
            continue
        for bound in getattr(hints[f.name], "__metadata__", ()):
            if isinstance(bound, Bound) and value is not None and not bound.holds(value):
                raise ConfigError(bound.error(prefix + yaml_key(f.name), value))


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """The declared ranges, then the rules that tie keys together."""
    _check_bounds(cfg, "")
    if cfg.paramserver.lr_final == 0:
        raise ConfigError("paramserver.lr_final: 0.0 must be > 0 (or negative: no schedule)")
    if cfg.replay.min_size_to_sample > cfg.replay.capacity:
        raise ConfigError(f"replay.min_size_to_sample: {cfg.replay.min_size_to_sample} exceeds "
                          f"replay.capacity ({cfg.replay.capacity})")
    if cfg.learner.batch_size > cfg.replay.capacity:
        raise ConfigError(f"learner.batch_size: {cfg.learner.batch_size} exceeds replay.capacity")
    if cfg.learner.steps_per_push > 1 and cfg.learner.sync != "local_replica":
        raise ConfigError(f"learner.steps_per_push: {cfg.learner.steps_per_push} needs "
                          f"learner.sync: local_replica (step i of a push is computed on the "
                          f"weights the steps before it make, which only a learner that "
                          f"applies its own steps has)")
    if cfg.learner.overlap_targets and cfg.algo != "dqn":
        raise ConfigError(f"learner.overlap_targets: DQN only (algo is {cfg.algo!r}; TD3's "
                          f"update runs on one thread)")
    return cfg


def config_from_dict(data: dict) -> ExperimentConfig:
    if not isinstance(data, dict):
        raise ConfigError("config: the top level must be a mapping")
    return validate(_build(ExperimentConfig, data))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Reads a YAML experiment file (or the defaults), applies overrides, validates."""
    data: dict = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:  # missing, a folder, unreadable: the file and why
            raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: {_yaml_problem(exc)}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    data = apply_overrides(data, list(overrides or []))
    return config_from_dict(data)


PACKAGED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
"""The experiment files that ship with the package (``amprl run pong-apex``)."""


def packaged_configs() -> list[str]:
    """Names of the experiment files shipped with the package."""
    return sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.yaml"))


def resolve_config(name_or_path: str) -> Path:
    """An experiment file: ``name_or_path`` itself when it exists, else the packaged
    experiment of that name (``pong-apex`` or ``pong-apex.yaml``); ConfigError naming the
    packaged ones otherwise."""
    path = Path(name_or_path)
    if path.exists():
        return path
    packaged = PACKAGED_CONFIGS / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if path.parent == Path(".") and packaged.exists():
        return packaged
    raise ConfigError(f"{name_or_path}: no such file, and no packaged experiment of that name "
                      f"(packaged: {', '.join(packaged_configs())})")


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML parse error in one line: what is wrong and where (1-based line and column)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"YAML syntax error{where}: {problem}"


def config_to_dict(cfg: ExperimentConfig) -> dict:
    """The config as plain data (what ``dump_config`` writes and ``config_from_dict`` reads),
    keyed as in the YAML file (``yaml_key``)."""
    return _plain(cfg)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {yaml_key(f.name): _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def dump_config(cfg: ExperimentConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
