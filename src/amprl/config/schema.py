"""The JSON schema of the experiment config, generated from the declarations in
``sections.py`` and the algorithms' ``config.py`` (types, choices, ranges, and each field's
docstring as its description).

The chart's ``values.schema.json`` carries it as ``properties.experiment``, so ``helm
install`` refuses a bad key or value before any pod starts, with the rules the services
apply. ``python -m amprl.config.schema charts/amprl/values.schema.json`` rewrites that
part; a test fails while the committed schema differs from what this module makes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from amprl.config.bounds import Bound
from amprl.config.loading import yaml_key
from amprl.config.sections import ExperimentConfig

_SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string"}


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of dataclass ``cls`` (its attribute docstring)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _schema(tp: Any) -> dict:
    if tp is Any:
        return {}
    bounds = [m for m in getattr(tp, "__metadata__", ()) if isinstance(m, Bound)]
    if bounds:
        tp = typing.get_args(tp)[0]
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):  # X | None
        (inner,) = [t for t in typing.get_args(tp) if t is not type(None)]
        out = _schema(inner)
        out["type"] = [out["type"], "null"]
        return out
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is list:
        (item,) = typing.get_args(tp)
        out = {"type": "array", "items": _schema(item)}
        for b in bounds:
            out["items"].update(b.schema())
            if b.min_items:
                out["minItems"] = b.min_items
        return out
    if origin is dict:  # string keys, values as declared
        return {"type": "object", "additionalProperties": _schema(typing.get_args(tp)[1])}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return section_schema(tp)
    out = {"type": _SCALARS[tp]}
    for b in bounds:
        out.update(b.schema())
    return out


def section_schema(cls: type) -> dict:
    """An object schema for dataclass ``cls``: its fields, nothing else."""
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = field_docs(cls)
    props = {}
    for f in dataclasses.fields(cls):
        prop = _schema(hints[f.name])
        if f.name in docs:
            prop["description"] = docs[f.name]
        props[yaml_key(f.name)] = prop
    out: dict = {"type": "object", "additionalProperties": False, "properties": props}
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        out["description"] = " ".join(cls.__doc__.split())
    return out


def experiment_schema() -> dict:
    """The schema of a whole experiment file (every key optional: defaults fill in)."""
    out = section_schema(ExperimentConfig)
    out["description"] = ("the experiment config, generated from src/amprl/config/sections.py "
                          "and src/amprl/algos/*/config.py (python -m amprl.config.schema)")
    return out


def write_chart_schema(path: Path) -> bool:
    """Sets ``properties.experiment`` of the chart's values schema at ``path``; True if it changed."""
    values = json.loads(path.read_text())
    new = experiment_schema()
    if values["properties"].get("experiment") == new:
        return False
    values["properties"]["experiment"] = new
    path.write_text(json.dumps(values, indent=2) + "\n")
    return True


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "charts/amprl/values.schema.json")
    print(f"{target}: {'updated' if write_chart_schema(target) else 'already current'}")
