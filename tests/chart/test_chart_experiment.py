"""One experiment file: `helm install rl charts/amprl --set-file experimentFile=FILE` deploys
any shipped config as is (the ConfigMap every pod reads as AMPRL_CONFIG holds the file's
text, and it loads as the services load it), and the schema Helm checks the `experiment`
mapping with is generated from the config's own declarations and covers every key."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import yaml

from chartkit import CHART, RELEASE, helm_python, render_docs

from amprl.config import ExperimentConfig, load_config
from amprl.config.loading import yaml_key

CONFIGS = sorted((CHART.parent.parent / "configs").glob("*.yaml"))
WORKERS = ("Deployment", "StatefulSet")


def set_file(path: Path) -> dict:
    """The values `--set-file experimentFile=PATH` gives, parsed by Helm's own code."""
    return helm_python.parse_set_file(f"experimentFile={path}")


def experiment_map(docs) -> str:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{RELEASE}-amprl-experiment"]
    return cm["data"]["experiment.yaml"]


def amprl_containers(docs):
    for doc in docs:
        if doc["kind"] in WORKERS and doc["metadata"]["labels"]["app.kubernetes.io/component"] != "redis":
            pod = doc["spec"]["template"]["spec"]
            yield doc, pod, pod["containers"][0]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_deploys_as_is_with_set_file(path, tmp_path):
    values = set_file(path)
    assert values == {"experimentFile": path.read_text()}
    docs, notes = render_docs(values)
    text = experiment_map(docs)
    assert text == path.read_text()  # byte for byte: comments and all
    # what each pod reads: the ConfigMap's key mounted at AMPRL_CONFIG
    mounted = tmp_path / "experiment.yaml"
    mounted.write_text(text)
    cfg = load_config(str(mounted), [])
    assert cfg == load_config(str(path), [])
    for doc, pod, c in amprl_containers(docs):
        env = {e["name"]: e.get("value") for e in c["env"]}
        mount = {m["name"]: m for m in c["volumeMounts"]}["experiment"]
        assert env["AMPRL_CONFIG"] == mount["mountPath"] == "/etc/amprl/experiment.yaml", doc["metadata"]["name"]
        assert mount["subPath"] == "experiment.yaml"
        volume = {v["name"]: v for v in pod["volumes"]}["experiment"]
        assert volume["configMap"]["name"] == f"{RELEASE}-amprl-experiment"
    # the templates that read keys read the file's
    assert notes.startswith(f'AMP-RL "{cfg.name}" is starting')
    redis = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{RELEASE}-amprl-redis"]
    if cfg.replay.durability == "always":
        assert "appendfsync always" in redis[0]["data"]["redis.conf"]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_also_passes_the_schema_as_the_experiment_mapping(chart, path):
    """The generated schema knows every key the shipped configs use (the mapping route,
    which Helm checks at install)."""
    chart.validate_schema({"experiment": yaml.safe_load(path.read_text())})


def test_a_changed_file_rolls_every_pod_and_the_file_wins_over_the_mapping():
    default, _ = render_docs({})
    pong, _ = render_docs({"experimentFile": (CHART.parent.parent / "configs" / "pong-apex.yaml").read_text(),
                           "experiment": {"name": "ignored"}})
    assert "name: pong-apex" in experiment_map(pong) and "ignored" not in experiment_map(pong)

    def checksums(docs):
        return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]["checksum/experiment"]
                for d, _, _ in amprl_containers(docs)}
    before, after = checksums(default), checksums(pong)
    assert before.keys() == after.keys() and all(before[k] != after[k] for k in before)


def test_a_file_that_is_not_yaml_fails_the_render_and_the_mapping_key_wants_a_mapping(chart):
    with pytest.raises(helm_python.HelmError, match="experimentFile is not a YAML mapping"):
        render_docs({"experimentFile": "name: [unclosed\n"})
    # `--set-file experiment=FILE` gives a string where the schema wants the mapping
    with pytest.raises(helm_python.HelmValuesError, match="experiment"):
        chart.validate_schema({"experiment": "name: x\n"})


def _declared(cls: type, prefix: str = "") -> set[str]:
    """Every key path the config's dataclasses declare ("replay.capacity", "dqn.n_step", ...)."""
    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        path = f"{prefix}{yaml_key(f.name)}"
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out |= _declared(tp, path + ".")
        else:
            out.add(path)
    return out


def _in_schema(schema: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, prop in schema["properties"].items():
        if prop.get("type") == "object" and "properties" in prop:
            out |= _in_schema(prop, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def test_the_charts_experiment_schema_covers_every_declared_key_and_no_other():
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["experiment"]
    declared = _declared(ExperimentConfig)
    assert {"dqn.n_step", "td3.policy_delay", "env.import", "deploy.nice.learner", "run.max_wall_seconds"} <= declared
    assert _in_schema(schema) == declared
    # every section refuses keys it does not declare, at every depth
    stack = [schema]
    while stack:
        node = stack.pop()
        assert node["additionalProperties"] is False
        stack += [p for p in node["properties"].values() if p.get("type") == "object" and "properties" in p]


def test_the_experiment_file_value_is_documented_and_typed(chart):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["experimentFile"] == ""
    with pytest.raises(helm_python.HelmValuesError, match="experimentFile"):
        chart.validate_schema({"experimentFile": {"name": "x"}})
