"""The rendered objects connect: every client's configured address leads to a Service
port of the right component, the server listens there, and the NetworkPolicies admit
exactly the data flows of ARCHITECTURE.md (and DNS), nothing else."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from chartkit import NAMESPACE, VALUE_SETS, followers, render_docs
from k8s_model import Cluster, Pod, env_of, split_address

DOMAIN = "cluster.local"
COMPONENT = "app.kubernetes.io/component"

# (client component, env var, server component, the server's container port name)
# The run's end: the evaluator reads replay's env-step count and decides; actors and
# learners poll it, and the done Job waits on it.
RUN_END_ADDRESSES = [
    ("actor", "AMPRL_EVALUATOR_ADDRESS", "evaluator", "grpc"),
    ("learner", "AMPRL_EVALUATOR_ADDRESS", "evaluator", "grpc"),
    ("evaluator", "AMPRL_REPLAY_ADDRESS", "replay", "grpc"),
    ("done", "AMPRL_EVALUATOR_ADDRESS", "evaluator", "grpc"),
]
CLIENT_ADDRESSES = [
    ("actor", "AMPRL_REPLAY_ADDRESS", "replay", "grpc"),
    ("actor", "AMPRL_PARAMSERVER_ADDRESS", "paramserver", "grpc-pull"),
    ("learner", "AMPRL_REPLAY_ADDRESS", "replay", "grpc"),
    ("learner", "AMPRL_PARAMSERVER_ADDRESS", "paramserver", "grpc"),
    ("evaluator", "AMPRL_PARAMSERVER_ADDRESS", "paramserver", "grpc-pull"),
    ("replay", "AMPRL_REDIS_URL", "redis", "redis"),
    *RUN_END_ADDRESSES,
]
# With pull-only followers, actors and the evaluator pull from them, and they follow the
# parameter server's pull port.
CLIENT_ADDRESSES_WITH_FOLLOWERS = [
    ("actor", "AMPRL_REPLAY_ADDRESS", "replay", "grpc"),
    ("actor", "AMPRL_PARAMSERVER_ADDRESS", "paramserver-follower", "grpc"),
    ("learner", "AMPRL_REPLAY_ADDRESS", "replay", "grpc"),
    ("learner", "AMPRL_PARAMSERVER_ADDRESS", "paramserver", "grpc"),
    ("evaluator", "AMPRL_PARAMSERVER_ADDRESS", "paramserver-follower", "grpc"),
    ("paramserver-follower", "AMPRL_FOLLOW", "paramserver", "grpc-pull"),
    ("replay", "AMPRL_REDIS_URL", "redis", "redis"),
    *RUN_END_ADDRESSES,
]


def client_addresses(value_set: str) -> list[tuple[str, str, str, str]]:
    return CLIENT_ADDRESSES_WITH_FOLLOWERS if followers(VALUE_SETS[value_set]) else CLIENT_ADDRESSES


def data_flows(value_set: str) -> set[tuple[str, str, str]]:
    """Every flow the system needs: (source, destination, destination container port
    name); exactly the client addresses, so nothing else is admitted."""
    return {(client, server, port) for client, _, server, port in client_addresses(value_set)}


# Who may ask DNS: every client and server except Redis, which dials nothing.
DNS_CLIENTS = {"actor", "learner", "evaluator", "replay", "paramserver", "paramserver-follower", "done"}

KUBE_DNS = Pod("coredns-0", "kube-system", {"k8s-app": "kube-dns"},
               (("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")))
INTRUDER = Pod("intruder", NAMESPACE, {"app": "intruder"}, (("http", 8080, "TCP"),))
OUTSIDER = Pod("outsider", "elsewhere", {"app.kubernetes.io/component": "learner"},
               (("http", 8080, "TCP"),))


def _component(pod: Pod) -> str:
    return pod.labels.get(COMPONENT, pod.name)


def _cluster(docs) -> Cluster:
    cluster = Cluster.from_manifests(docs)
    cluster.add_pod(KUBE_DNS)
    cluster.add_pod(INTRUDER)
    cluster.add_pod(OUTSIDER)
    return cluster


def _addresses(var: str, value: str) -> list[tuple[str, int]]:
    if var == "AMPRL_REDIS_URL":
        parts = urlsplit(value)
        assert parts.scheme == "redis" and not parts.password, (
            f"{value!r}: expected redis://host:port/db with the password kept out of the URL")
        return [(parts.hostname, parts.port)]
    return [split_address(a) for a in value.split(",")]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_each_client_address_resolves_to_a_service_port_of_the_right_component(rendered, value_set):
    docs, _ = rendered[value_set]
    cluster = _cluster(docs)
    shards = VALUE_SETS[value_set].get("replay", {}).get("shards", 1)
    checked = 0
    wanted = client_addresses(value_set)
    for client, var, server, port_name in wanted:
        clients = [p for p in cluster.pods if _component(p) == client and p.namespace == NAMESPACE]
        assert clients, f"no {client} pods rendered"
        for pod in clients:
            value = env_of(pod).get(var)
            assert value, f"{pod.name}: {var} is not set"
            addresses = _addresses(var, value)
            if var == "AMPRL_REPLAY_ADDRESS":
                assert len(addresses) == shards, f"{pod.name}: {var}={value!r} lists {len(addresses)} of {shards} shards"
            for index, (host, port) in enumerate(addresses):
                targets = cluster.resolve(host, port, DOMAIN)
                assert targets, f"{pod.name}: {var} -> {host}:{port} names no pod port"
                for target, target_port in targets:
                    assert _component(target) == server, (
                        f"{pod.name}: {var} -> {host}:{port} reaches {target.name}, not a {server}")
                    assert target.port_number(port_name) == target_port, (
                        f"{pod.name}: {var} -> {host}:{port} lands on {target_port}, "
                        f"not {server}'s {port_name} port")
                    admitted = cluster.allowed(pod, target, target_port)
                    assert admitted, f"NetworkPolicies block {pod.name} -> {target.name}:{target_port} ({var})"
                    if var == "AMPRL_REPLAY_ADDRESS":
                        assert target.ordinal == index, f"shard {index} of {var} is {target.name}"
                    if var == "AMPRL_REDIS_URL":
                        assert target.ordinal == pod.ordinal, (
                            f"replay shard {pod.name} stores into {target.name}, not its own Redis")
                    checked += 1
    assert checked >= len(wanted)


def amprl_containers(docs):
    """(workload, its AMP-RL container, that container's env) for every Deployment and
    StatefulSet except Redis."""
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        container = doc["spec"]["template"]["spec"]["containers"][0]
        if container["name"] != "redis":
            yield doc, container, {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_server_listens_on_the_port_its_service_and_probes_name(rendered, value_set):
    docs, _ = rendered[value_set]
    for doc, container, env in amprl_containers(docs):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(env["AMPRL_PORT"]) == ports["grpc"], doc["metadata"]["name"]
        if container["name"] == "paramserver":
            assert int(env["AMPRL_PULL_PORT"]) == ports["grpc-pull"] != ports["grpc"]
        # a server drains (NOT_SERVING) for AMPRL_DRAIN_S after SIGTERM, then stops with 5 s
        # of grace: the kubelet must not kill it before
        if container["name"] in ("replay", "paramserver", "paramserver-follower"):
            grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace >= float(env["AMPRL_DRAIN_S"]) + 5, (doc["metadata"]["name"], grace)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            spec = container[probe]
            # startup and liveness ask "liveness" (SERVING while the server answers);
            # readiness asks "" (the whole server, following its dependencies)
            service = "" if probe == "readinessProbe" else "liveness"
            if "grpc" in spec:
                assert spec["grpc"]["port"] == ports["grpc"], (doc["metadata"]["name"], probe)
                assert spec["grpc"].get("service", "") == service, (doc["metadata"]["name"], probe)
            else:
                command = spec["exec"]["command"]
                assert command[-1] == str(ports["grpc"]), (doc["metadata"]["name"], probe)
                asked = command[command.index("--service") + 1] if "--service" in command else ""
                assert asked == service, (doc["metadata"]["name"], probe)


UNMANAGED = (KUBE_DNS, INTRUDER, OUTSIDER)


def _expected(src: Pod, dst: Pod, port: int, protocol: str, flows: set) -> bool:
    if src in UNMANAGED and dst in UNMANAGED:
        return True  # not ours to restrict
    if src in UNMANAGED:
        return False  # nothing outside the release dials into it
    if dst is KUBE_DNS:
        return _component(src) in DNS_CLIENTS
    if dst in UNMANAGED:
        return False  # and it dials nothing outside itself but DNS
    return any((_component(src), _component(dst)) == (fs, fd) and dst.port_number(name) == port
               and protocol == "TCP" for fs, fd, name in flows)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_network_policies_admit_the_data_flows_and_nothing_else(rendered, value_set):
    docs, _ = rendered[value_set]
    cluster = _cluster(docs)
    # Two pods per component where a component has two (self-traffic is checked too).
    reps: dict[str, list[Pod]] = {}
    for pod in cluster.pods:
        reps.setdefault(_component(pod) if pod.namespace == NAMESPACE else pod.name, []).append(pod)
    pods = [p for group in reps.values() for p in group[:2]]
    flows = data_flows(value_set)
    wrong = []
    for src in pods:
        for dst in pods:
            if src is dst:
                continue
            for _, port, protocol in dst.ports:
                got = cluster.allowed(src, dst, port, protocol)
                if got != _expected(src, dst, port, protocol, flows):
                    wrong.append(f"{src.name} -> {dst.name}:{port}/{protocol} "
                                 f"{'admitted' if got else 'blocked'}")
    assert not wrong, "\n".join(wrong)
    # Each wanted flow really was exercised above.
    for s, d, name in flows:
        assert reps.get(s) and reps.get(d) and reps[d][0].port_number(name), (s, d, name)


def test_two_releases_in_one_namespace_cannot_reach_each_other(rendered):
    ours, _ = rendered["defaults"]
    theirs, _ = render_docs({}, name="other")
    cluster = Cluster.from_manifests(ours + theirs)
    by = {(p.labels["app.kubernetes.io/instance"], _component(p)): p for p in cluster.pods}
    replay_port = by[("myrun", "replay")].port_number("grpc")
    push_port = by[("myrun", "paramserver")].port_number("grpc")
    assert cluster.allowed(by[("myrun", "actor")], by[("myrun", "replay")], replay_port)
    assert not cluster.allowed(by[("other", "actor")], by[("myrun", "replay")], replay_port)
    assert not cluster.allowed(by[("other", "learner")], by[("myrun", "paramserver")], push_port)


def test_policies_are_not_rendered_when_disabled():
    docs, _ = render_docs({"networkPolicy": {"enabled": False}})
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]


def test_the_policy_model_follows_kubernetes_semantics():
    """The evaluator itself, on a hand-written case: isolation, union of rules, named
    ports, namespaceSelector AND podSelector, and both directions needed."""
    a = Pod("a", "ns", {"role": "a"}, (("web", 80, "TCP"),))
    b = Pod("b", "ns", {"role": "b"}, (("web", 8080, "TCP"),))
    c = Pod("c", "other", {"role": "a"}, ())
    cluster = Cluster(pods=[a, b, c], namespace_labels={"ns": {"kubernetes.io/metadata.name": "ns"},
                                                        "other": {"kubernetes.io/metadata.name": "other"}})
    assert cluster.allowed(a, b, 8080)  # nothing isolated yet
    cluster.policies.append({"metadata": {"namespace": "ns"}, "spec": {
        "podSelector": {"matchLabels": {"role": "b"}}, "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "a"}}}],
                     "ports": [{"port": "web"}]}]}})
    assert cluster.allowed(a, b, 8080)
    assert not cluster.allowed(a, b, 80)  # the named port is b's 8080
    assert not cluster.allowed(c, b, 8080)  # podSelector alone = the policy's namespace
    cluster.policies.append({"metadata": {"namespace": "ns"}, "spec": {
        "podSelector": {}, "policyTypes": ["Egress"]}})
    assert not cluster.allowed(a, b, 8080)  # a's egress is now isolated
    cluster.policies.append({"metadata": {"namespace": "ns"}, "spec": {
        "podSelector": {"matchLabels": {"role": "a"}}, "policyTypes": ["Egress"],
        "egress": [{"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"role": "b"}}}]}]}})
    assert cluster.allowed(a, b, 8080)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_amprl_container_logs_json_lines_for_the_collector(rendered, value_set):
    docs, _ = rendered[value_set]
    workloads = list(amprl_containers(docs))
    assert len(workloads) >= 5
    for doc, _, env in workloads:
        assert env.get("AMPRL_LOG_FORMAT") == "json", doc["metadata"]["name"]
