"""The chart renders with the real Helm engine for every value set, lints clean, rejects
bad values, and every object is valid Kubernetes that follows the house rules: namespaced,
labelled, restricted, with requests and limits and probes."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from chartkit import CHART, NAMESPACE, RELEASE, VALUE_SETS, helm_python, render_docs, strip_source


# The kubeVersion floor of Chart.yaml and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.28.0", "1.37.0")
WORKLOADS = ("Deployment", "StatefulSet")
# Custom resources: kubernetes-validate ships the core API's schemas only, so strict
# validation skips these kinds by name (an unknown kind otherwise fails);
# test_chart_tls.py checks the Certificates' shape against cert-manager's v1 API instead,
# test_chart_metrics.py the ServiceMonitor's against the Prometheus Operator's.
CRD_KINDS = {("cert-manager.io/v1", "Certificate"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
          "app.kubernetes.io/component", "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of")


def _by_kind_name(docs):
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _pod_specs(docs):
    for d in docs:
        if d["kind"] in WORKLOADS:
            yield d, d["spec"]["template"]["spec"]


# -- Helm: lint and schema -------------------------------------------------------------

@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_finds_no_errors_or_warnings(value_set):
    report = helm_python.lint(CHART, VALUE_SETS[value_set], namespace=NAMESPACE,
                              kube_version="v1.34.0", strict=True)
    findings = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["errors"] == [] and findings == [], report


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_schema_accepts_the_value_sets(chart, value_set):
    chart.validate_schema(VALUE_SETS[value_set])


@pytest.mark.parametrize("values, where", [
    ({"actor": {"replicas": -1}}, "/actor/replicas"),
    ({"paramserver": {"followers": {"replicas": -1}}}, "/paramserver/followers/replicas"),
    ({"paramserver": {"followers": {"replicas": 2, "resources": {"limits": None}}}},
     "/paramserver/followers/resources"),
    ({"learner": {"replicas": -3}}, "/learner/replicas"),
    ({"learner": {"gpu": -1}}, "/learner/gpu"),
    ({"learner": {"gpu": 0.5}}, "/learner/gpu"),
    ({"replay": {"shards": 0}}, "/replay/shards"),
    ({"experiment": {"learner": {"precision": "fp8"}}}, "/experiment/learner/precision"),
    ({"experiment": {"algo": "ppo"}}, "/experiment/algo"),
    ({"experiment": {"replay_buffer": {}}}, "replay_buffer"),
    ({"image": {"cpu": {"tag": "latest"}}}, "/image/cpu/tag"),
    ({"image": {"cuda": {"digest": "sha256:xyz"}}}, "/image/cuda/digest"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"paramserver": {"port": 70000}}, "/paramserver/port"),
    ({"actor": {"resources": {"limits": None}}}, "/actor/resources"),
    ({"actor": {"resources": {"requests": {"cpu": "lots", "memory": "1Gi"}}}}, "/actor/resources/requests/cpu"),
    ({"podSecurityContext": {"runAsUser": 1000}}, "/podSecurityContext/runAsUser"),
    ({"podSecurityContext": {"runAsNonRoot": False}}, "/podSecurityContext/runAsNonRoot"),
    ({"containerSecurityContext": {"allowPrivilegeEscalation": True}}, "/containerSecurityContext/allowPrivilegeEscalation"),
    ({"containerSecurityContext": {"capabilities": {"drop": ["NET_RAW"]}}}, "/containerSecurityContext/capabilities/drop"),
    ({"redis": {"appendfsync": "sometimes"}}, "/redis/appendfsync"),
    ({"redis": {"appendfsync": "no"}}, "/redis/appendfsync"),  # below any replay.durability
    ({"redis": {"keyPrefix": "amprl:*"}}, "/redis/keyPrefix"),  # would widen the ACL
    ({"redis": {"auth": {"username": "default"}}}, "/redis/auth/username"),  # the admin
    ({"redis": {"tls": {"enabled": "yes"}}}, "/redis/tls/enabled"),
    ({"actor": {"pdb": {"maxUnavailable": "half"}}}, "/actor/pdb/maxUnavailable"),
    ({"networkPolicy": {"dns": []}}, "/networkPolicy/dns"),
    ({"logLevel": "LOUD"}, "/logLevel"),
    ({"actors": {"replicas": 4}}, "actors"),
])
def test_schema_rejects_bad_values_naming_the_key(chart, values, where):
    with pytest.raises(helm_python.HelmValuesError) as info:
        chart.validate_schema(values)
    assert where in str(info.value)
    with pytest.raises(helm_python.HelmValuesError):  # an install would refuse them too
        chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


def test_render_refuses_a_release_name_that_would_break_derived_names():
    with pytest.raises(helm_python.HelmError, match="at most 36"):
        render_docs({}, name="r" * 37)


def test_render_refuses_one_port_for_push_and_pull():
    with pytest.raises(helm_python.HelmError, match="pullPort"):
        render_docs({"paramserver": {"pullPort": 50052}})


# -- Kubernetes validity -------------------------------------------------------------

@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_object_validates_strictly_against_kubernetes(rendered, value_set, version):
    docs, _ = rendered[value_set]
    errors = []
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(strip_source(doc), version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            errors.append(f"{doc['__source__']}: {doc['kind']} at {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{doc['__source__']}: unknown kind {doc['apiVersion']}/{doc['kind']}: {exc}")
    assert not errors, "\n".join(errors)


# -- house rules ---------------------------------------------------------------------

@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_object_is_namespaced_and_labelled(rendered, value_set):
    docs, _ = rendered[value_set]
    names = set()
    for doc in docs:
        meta = doc["metadata"]
        assert meta.get("namespace") == NAMESPACE, doc["__source__"]
        labels = meta.get("labels", {})
        expected = LABELS if labels.get("app.kubernetes.io/component") else (
            set(LABELS) - {"app.kubernetes.io/component"})
        assert set(expected) <= set(labels), (doc["__source__"], sorted(labels))
        assert meta["name"].startswith(f"{RELEASE}-amprl"), meta["name"]
        assert len(meta["name"]) <= 63 - len("-0"), meta["name"]
        key = (doc["kind"], meta["name"])
        assert key not in names, f"duplicate {key}"
        names.add(key)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_templates_hold_one_resource_each_named_by_kind(rendered, value_set):
    docs, _ = rendered[value_set]
    for doc in docs:
        source = doc["__source__"].removeprefix("amprl/templates/")
        stem = source.rsplit("/", 1)[-1].removesuffix(".yaml").split("-")[0]
        assert stem == doc["kind"].lower(), f"{source} holds a {doc['kind']}"
    sources = [d["__source__"] for d in docs]
    assert len(sources) == len(set(sources)), "a template renders several objects"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_pod_is_restricted_and_sized(rendered, value_set):
    docs, _ = rendered[value_set]
    for doc, pod in _pod_specs(docs):
        name = doc["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, name
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] >= 10000, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] >= 10000, name
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), (name, part)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert probe in c, (name, probe)
            image = c["image"]
            assert ":latest" not in image and (":" in image.rsplit("/", 1)[-1] or "@sha256:" in image), image
            # Writes go to volumes only: /tmp everywhere, plus each component's own.
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, name
            for path, volume in mounts.items():
                v = volumes.get(volume) or {"pvc": True}  # volumeClaimTemplates
                writable = not any(m.get("readOnly") for m in c["volumeMounts"] if m["mountPath"] == path)
                if writable:
                    assert "emptyDir" in v or "persistentVolumeClaim" in v or "pvc" in v, (name, path)


def test_names_and_shapes_the_docs_rely_on(rendered):
    objs = _by_kind_name(rendered["defaults"][0])
    actor = objs[("Deployment", f"{RELEASE}-amprl-actor")]  # kubectl scale deployment/<release>-amprl-actor
    assert actor["spec"]["replicas"] == 2
    ps = objs[("Deployment", f"{RELEASE}-amprl-paramserver")]
    assert ps["spec"]["replicas"] == 1 and ps["spec"]["strategy"]["type"] == "Recreate"
    claim = {v["name"]: v for v in ps["spec"]["template"]["spec"]["volumes"]}["run"]
    assert claim["persistentVolumeClaim"]["claimName"] == f"{RELEASE}-amprl-paramserver"
    pvc = objs[("PersistentVolumeClaim", f"{RELEASE}-amprl-paramserver")]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    env = {e["name"]: e.get("value") for e in ps["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AMPRL_RUN_DIR"] == "/var/lib/amprl"  # checkpoints: <run_dir>/checkpoints on the claim
    for kind, component in [("StatefulSet", "replay"), ("StatefulSet", "redis"),
                            ("Deployment", "learner"), ("Deployment", "evaluator"),
                            ("ConfigMap", "experiment"), ("Secret", "redis")]:
        assert (kind, f"{RELEASE}-amprl-{component}") in objs, (kind, component)
    pdbs = [k for k in objs if k[0] == "PodDisruptionBudget"]
    assert len(pdbs) >= 1


def test_scaling_values_reach_the_workloads(rendered):
    objs = _by_kind_name(rendered["actors-64"][0])
    assert objs[("Deployment", f"{RELEASE}-amprl-actor")]["spec"]["replicas"] == 64
    objs = _by_kind_name(rendered["replay-3-shards"][0])
    assert objs[("StatefulSet", f"{RELEASE}-amprl-replay")]["spec"]["replicas"] == 3
    assert objs[("StatefulSet", f"{RELEASE}-amprl-redis")]["spec"]["replicas"] == 3


def test_followers_are_rendered_only_when_asked_for_and_serve_actors_and_evaluator(rendered):
    assert not [d for d in rendered["defaults"][0] if "follower" in d["metadata"]["name"]]
    objs = _by_kind_name(rendered["paramserver-followers"][0])
    name = f"{RELEASE}-amprl-paramserver-follower"
    domain = f"{NAMESPACE}.svc.cluster.local"
    follower = objs[("Deployment", name)]
    assert follower["spec"]["replicas"] == 3 and ("Service", name) in objs
    pod = follower["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["AMPRL_FOLLOW"] == f"{RELEASE}-amprl-paramserver.{domain}:50056"  # the pull port
    assert "AMPRL_PULL_PORT" not in env  # a follower serves reads on AMPRL_PORT only
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]  # no checkpoints
    for component in ("actor", "evaluator", "learner"):
        c = objs[("Deployment", f"{RELEASE}-amprl-{component}")]["spec"]["template"]["spec"]["containers"][0]
        address = {e["name"]: e.get("value") for e in c["env"]}["AMPRL_PARAMSERVER_ADDRESS"]
        expected = (f"{RELEASE}-amprl-paramserver.{domain}:50052" if component == "learner"
                    else f"{name}.{domain}:50056")
        assert address == expected, component
    _, notes = rendered["paramserver-followers"]
    assert f"deployment/{name}" in notes and f"deployment/{name}" not in rendered["defaults"][1]


def test_follower_names_stay_valid_dns_labels_for_the_longest_release_name():
    docs, _ = render_docs({"paramserver": {"followers": {"replicas": 1}}}, name="r" * 36)
    names = [d["metadata"]["name"] for d in docs if "follower" in d["metadata"]["name"]]
    assert len(names) == 3 and all(len(n) <= 63 for n in names), names


def test_gpu_learner_asks_for_gpus_on_the_cuda_image(rendered):
    objs = _by_kind_name(rendered["gpu-learner"][0])
    pod = objs[("Deployment", f"{RELEASE}-amprl-learner")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "amprl-cuda" in c["image"]
    assert pod["nodeSelector"] == VALUE_SETS["gpu-learner"]["learner"]["nodeSelector"]
    assert pod["tolerations"] == VALUE_SETS["gpu-learner"]["learner"]["tolerations"]
    cpu = _by_kind_name(rendered["defaults"][0])[("Deployment", f"{RELEASE}-amprl-learner")]
    c = cpu["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"]["limits"] and "amprl-cpu" in c["image"]


def test_redis_is_durable_never_evicts_and_survives_aof_loading(rendered):
    objs = _by_kind_name(rendered["defaults"][0])
    conf = objs[("ConfigMap", f"{RELEASE}-amprl-redis")]["data"]["redis.conf"]
    assert re.search(r"^appendonly yes$", conf, re.M)
    assert re.search(r"^maxmemory-policy noeviction$", conf, re.M)
    sts = objs[("StatefulSet", f"{RELEASE}-amprl-redis")]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    # the users file (aclfile) is written from the Secret's passwords at start
    assert re.search(r"^aclfile /tmp/users.acl$", conf, re.M)
    assert "> /tmp/users.acl" in c["command"][-1] and "/etc/redis/auth/password" in c["command"][-1]
    assert "LOADING" in c["livenessProbe"]["exec"]["command"][-1]
    assert "LOADING" in c["startupProbe"]["exec"]["command"][-1]
    assert "LOADING" not in c["readinessProbe"]["exec"]["command"][-1]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    secret = objs[("Secret", f"{RELEASE}-amprl-redis")]
    assert len(secret["data"]["redis-password"]) >= 32
    assert len(secret["data"]["redis-admin-password"]) >= 32
    # An existing Secret is used as is, and none is created.
    pinned = _by_kind_name(rendered["pinned"][0])
    assert ("Secret", f"{RELEASE}-amprl-redis") not in pinned
    auth = {v["name"]: v for v in pinned[("StatefulSet", f"{RELEASE}-amprl-redis")]["spec"]["template"]["spec"]["volumes"]}["auth"]
    assert auth["secret"]["secretName"] == "redis-auth" and auth["secret"]["items"][0]["key"] == "pw"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_experiment_config_map_is_a_valid_amprl_config(rendered, value_set):
    config = pytest.importorskip("amprl.config")
    objs = _by_kind_name(rendered[value_set][0])
    text = objs[("ConfigMap", f"{RELEASE}-amprl-experiment")]["data"]["experiment.yaml"]
    cfg = config.config_from_dict(yaml.safe_load(text))
    assert cfg.env.id == "CartPole-v1"


def test_notes_print_the_next_commands(rendered):
    _, notes = rendered["defaults"]
    assert f"kubectl -n {NAMESPACE} scale deployment/{RELEASE}-amprl-actor --replicas=" in notes
    assert f"port-forward svc/{RELEASE}-amprl-replay 50051:50051" in notes
    assert 'G="grpcurl -plaintext"' in notes
    assert "$G localhost:50051 list" in notes
    assert "grpc.health.v1.Health/Check" in notes
    for rpc in ("ReplayService", "ParameterService", "LearnerService", "ActorService", "EvaluatorService"):
        assert f"amprl.v1.{rpc}/Info" in notes, rpc
    assert f"logs -f deployment/{RELEASE}-amprl-learner" in notes
    # With TLS: test_chart_tls.py.


_OPAQUE = re.compile(r"^(experiment|podSecurityContext|containerSecurityContext|networkPolicy\.dns"
                     r"|metrics\.scraper|metrics\.grafanaDashboard\.labels"
                     r"|([a-z]+\.)+resources|([a-z]+\.)+(nodeSelector|tolerations|affinity))\.")


def test_values_yaml_documents_every_key_starting_with_its_own_name():
    """Each key has a comment right above it that starts with its dotted path; keys inside
    Kubernetes objects (securityContext, resources, ...) and the experiment are opaque."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not m or line.lstrip().startswith("#"):
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key])
        stack.append((indent, key))
        if _OPAQUE.match(path):
            continue
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            j -= 1
        block = [ln.strip() for ln in lines[j + 1:i]]
        if not block or not block[0].startswith(f"# {path} "):
            missing.append(path)
    assert not missing, f"undocumented values: {missing}"


def test_the_charts_experiment_is_the_default_cartpole_agent_of_make_run(tmp_path):
    """One default CartPole experiment: the chart deploys the agent `make run` trains
    (configs/cartpole-dqn.yaml), apart from the settings a cluster owns."""
    import dataclasses

    from amprl.config import load_config

    deployment_only = {"run", "replay.cache_max_bytes", "actor.num_actors"}

    def flat(cfg) -> dict:
        out = {}
        for section in dataclasses.fields(cfg):
            value = getattr(cfg, section.name)
            if dataclasses.is_dataclass(value):
                out.update({f"{section.name}.{f.name}": getattr(value, f.name)
                            for f in dataclasses.fields(value)})
            else:
                out[section.name] = value
        return {k: v for k, v in out.items()
                if k not in deployment_only and k.split(".")[0] not in deployment_only}

    chart_experiment = yaml.safe_load((CHART / "values.yaml").read_text())["experiment"]
    chart_file = tmp_path / "chart-experiment.yaml"
    chart_file.write_text(yaml.safe_dump(chart_experiment))
    chart_cfg = flat(load_config(str(chart_file), []))
    make_run_cfg = flat(load_config(str(CHART.parent.parent / "configs" / "cartpole-dqn.yaml"), []))
    differ = {k: (chart_cfg[k], make_run_cfg[k]) for k in chart_cfg if chart_cfg[k] != make_run_cfg[k]}
    assert not differ, differ
