"""How ``amprl_testing.podspec`` turns the rendered pod specs into podman containers, checked
without podman (``make pod-check`` runs them: tests/podman)."""

from __future__ import annotations

import base64
import copy
import random
import re

import pytest

from amprl_testing.podspec import NotTranslatable, Objects, expand, plan_pod, plan_pods
from chartkit import RELEASE, VALUE_SETS, render_docs

# The value sets whose Secrets are all in the render (TLS Secrets come from outside the
# chart, a GPU from a device plugin).
TRANSLATABLE = ("defaults", "replay-3-shards", "paramserver-followers")


def plans_of(rendered, value_set: str):
    return plan_pods(Objects(rendered[value_set][0]), rng=random.Random(0))


def by_workload(plans, component: str):
    return [p for p in plans if p.workload == f"{RELEASE}-amprl-{component}"]


def test_expansion_is_kubernetes_own_shell_substitutions_and_unknown_names_pass_through():
    env = {"A": "1", "B": "x$(A)"}
    assert expand("$(A)-$(B)", env) == "1-x$(A)"  # one pass: no recursion
    assert expand("$(MISSING) $$(A) $$ $x $", env) == "$(MISSING) $(A) $ $x $"
    assert expand('printf "$(cat "$1")" $(sha /etc/p)', env) == 'printf "$(cat "$1")" $(sha /etc/p)'
    assert expand("$(A", env) == "$(A"


@pytest.mark.parametrize("value_set", TRANSLATABLE)
def test_every_workload_replica_becomes_one_pod_named_as_its_controller_would(rendered, value_set):
    objects = Objects(rendered[value_set][0])
    plans = plans_of(rendered, value_set)
    for w in objects.of_kind("Deployment", "StatefulSet"):
        name, mine = w["metadata"]["name"], [p for p in plans if p.workload == w["metadata"]["name"]]
        assert len(mine) == w["spec"]["replicas"], name
        for i, p in enumerate(mine):
            if w["kind"] == "StatefulSet":
                assert p.name == p.hostname == f"{name}-{i}" and p.labels["apps.kubernetes.io/pod-index"] == str(i)
                assert p.subdomain == w["spec"]["serviceName"]
            else:
                assert re.fullmatch(rf"{name}-[b-z2-9]{{1,10}}-[b-z2-9]{{5}}", p.name), p.name
                assert p.labels["pod-template-hash"] in p.name
            if "AMPRL_ID" in p.env:  # fieldRef metadata.name
                assert p.env["AMPRL_ID"] == p.name
    assert len({p.name for p in plans}) == len(plans)


@pytest.mark.parametrize("value_set", TRANSLATABLE)
def test_every_address_a_pod_dials_is_a_name_some_pod_answers_on_that_port(rendered, value_set):
    """Under podman a Service name resolves to the pods it selects: every host:port in an
    AMPRL_*ADDRESS or AMPRL_REDIS_URL (after $(VAR) expansion) must lead to one."""
    plans = plans_of(rendered, value_set)
    answering = {(name, int(port["containerPort"])) for p in plans for name in p.dns_names for port in p.ports}
    dialed = 0
    for p in plans:
        for key, value in p.env.items():
            if not (key.endswith("_ADDRESS") or key == "AMPRL_REDIS_URL"):
                continue
            for address in re.findall(r"([a-z0-9.-]+\.svc\.cluster\.local):(\d+)", value):
                assert (address[0], int(address[1])) in answering, (p.name, key, value)
                dialed += 1
    assert dialed >= 6


def test_replay_gets_its_shard_index_and_redis_address_from_its_pod_index(rendered):
    plans = plans_of(rendered, "replay-3-shards")
    for i, p in enumerate(by_workload(plans, "replay")):
        assert p.env["AMPRL_SHARD_INDEX"] == str(i)
        assert p.env["AMPRL_REDIS_URL"] == (f"redis://{RELEASE}-amprl-redis-{i}.{RELEASE}-amprl-redis"
                                            ".rl.svc.cluster.local:6379/0")
        assert f"{RELEASE}-amprl-redis-{i}.{RELEASE}-amprl-redis.rl.svc.cluster.local" in \
            by_workload(plans, "redis")[i].dns_names


def test_the_security_context_becomes_podman_sandbox_flags(rendered):
    actor = by_workload(plans_of(rendered, "defaults"), "actor")[0]
    args = actor.podman_args(container_name="c", network="n", image=actor.image,
                             volume_paths={name: f"/host/{name}" for name in actor.volumes})
    flags = list(zip(args, args[1:]))
    for pair in [("--user", "10001:10001"), ("--group-add", "10001"), ("--cap-drop", "ALL"),
                 ("--security-opt", "no-new-privileges"), ("--stop-timeout", "15"), ("--cpus", "1"),
                 ("--memory", str(2**30)), ("--pull", "never"), ("--hostname", actor.name),
                 ("--network-alias", f"{RELEASE}-amprl-actor.rl.svc.cluster.local"),
                 ("--dns-search", "rl.svc.cluster.local"), ("--env", f"AMPRL_ID={actor.name}")]:
        assert pair in flags, pair
    assert "--read-only" in args and "--read-only-tmpfs=false" in args
    # the image's ENTRYPOINT (amprl) stays: the chart gives args only
    assert "--entrypoint" not in args and args[-2:] == [actor.image, "actor"]
    assert ("--mount", "type=bind,source=/host/experiment/experiment.yaml,"
            "destination=/etc/amprl/experiment.yaml,ro=true") in flags


def test_a_command_replaces_the_entrypoint_and_drops_the_images_cmd(rendered):
    redis = by_workload(plans_of(rendered, "defaults"), "redis")[0]
    args = redis.podman_args(container_name="c", network="n", image="stand-in",
                             volume_paths={name: f"/host/{name}" for name in redis.volumes})
    entry = args[args.index("--entrypoint") + 1]
    assert entry.startswith('["sh", "-c", "set -eu') and args[-1] == "stand-in"


def test_secrets_and_config_maps_become_files_with_their_rendered_modes(rendered):
    docs = rendered["defaults"][0]
    plans = plans_of(rendered, "defaults")
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{RELEASE}-amprl-redis")
    replay = by_workload(plans, "replay")[0]
    data, mode = replay.volumes["redis-auth"].files["password"]
    assert data == base64.b64decode(secret["data"]["redis-password"]) and mode == 0o440
    redis = by_workload(plans, "redis")[0]
    assert set(redis.volumes["config"].files) == {"redis.conf", "replay-user.acl"}
    assert redis.volumes["config"].files["redis.conf"][1] == 0o644
    assert redis.volumes["data"].claim == f"data-{redis.name}"  # volumeClaimTemplates
    ps = by_workload(plans, "paramserver")[0]
    assert ps.volumes["run"].claim == f"{RELEASE}-amprl-paramserver"
    assert ps.volumes["tmp"].kind == "empty_dir" and not ps.volumes["tmp"].tmpfs


def test_probes_keep_their_rendered_actions_and_timings(rendered):
    plans = plans_of(rendered, "defaults")
    replay = by_workload(plans, "replay")[0]
    assert replay.probes["startup"].action == "grpc" and replay.probes["startup"].spec == {
        "port": 50051, "service": "liveness"}
    assert replay.probes["readiness"].period_s == 5 and replay.probes["readiness"].failure_threshold == 2
    redis = by_workload(plans, "redis")[0]
    assert redis.probes["liveness"].action == "exec" and redis.probes["liveness"].spec["command"][:2] == ["sh", "-c"]


def _workload(docs, component):
    return next(d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                and d["metadata"]["name"] == f"{RELEASE}-amprl-{component}")


@pytest.mark.parametrize("change, named", [
    (lambda w: w["spec"]["template"]["spec"].update(hostNetwork=True), "hostNetwork"),
    (lambda w: w["spec"]["template"]["spec"]["containers"][0].update(lifecycle={"preStop": {}}), "lifecycle"),
    (lambda w: w["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(
        procMount="Unmasked"), "procMount"),
    (lambda w: w["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}), "status.podIP"),
    (lambda w: w["spec"]["template"]["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
     "hostPath"),
    (lambda w: w["spec"]["template"]["spec"]["containers"].append({"name": "sidecar"}), "2 containers"),
])
def test_what_the_mapping_does_not_emulate_is_refused_by_name(rendered, change, named):
    docs = copy.deepcopy(rendered["defaults"][0])
    actor = _workload(docs, "actor")
    change(actor)
    with pytest.raises(NotTranslatable, match=re.escape(named)):
        plan_pod(Objects(docs), actor)


def test_a_service_whose_port_differs_from_its_target_is_refused():
    docs, _ = render_docs(VALUE_SETS["defaults"])
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == f"{RELEASE}-amprl-actor")
    svc["spec"]["ports"][0]["port"] = 80
    with pytest.raises(NotTranslatable, match="only port == targetPort"):
        plan_pod(Objects(docs), _workload(docs, "actor"))
