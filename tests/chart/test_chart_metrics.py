"""Prometheus in the chart (metrics.*): every AMP-RL container and Service carries the
metrics port, the pods the scrape annotations, the NetworkPolicies admit the scraper to
that port and to nothing else, the optional ServiceMonitor has the Prometheus Operator's
v1 shape and finds every target, and the optional Grafana dashboard queries only series
the services serve."""

from __future__ import annotations

import collections
import json
import re
from types import SimpleNamespace

import pytest

from chartkit import NAMESPACE, RELEASE, VALUE_SETS, helm_python, render_docs
from k8s_model import Cluster, Pod

COMPONENT = "app.kubernetes.io/component"
AMPRL = {"actor", "learner", "evaluator", "replay", "paramserver", "paramserver-follower"}
PROMETHEUS = Pod("prometheus-0", "monitoring", {"app.kubernetes.io/name": "prometheus"},
                 (("web", 9090, "TCP"),))
INTRUDER = Pod("intruder", NAMESPACE, {"app": "intruder"}, ())
WITH_FOLLOWERS = {"paramserver": {"followers": {"replicas": 1}}}

# The fields of monitoring.coreos.com/v1 ServiceMonitor's spec and of an endpoint (the
# Prometheus Operator's API reference). kubernetes-validate knows no CRDs, so this is the
# check of their shape.
SERVICE_MONITOR_SPEC_FIELDS = {
    "endpoints", "selector", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels",
    "sampleLimit", "targetLimit", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit",
    "keepDroppedTargets", "attachMetadata", "scrapeProtocols", "fallbackScrapeProtocol",
    "scrapeClass", "bodySizeLimit", "selectorMechanism", "serviceDiscoveryRole",
    "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor",
    "scrapeClassicHistograms", "convertClassicHistogramsToNHCB",
}
ENDPOINT_FIELDS = {
    "port", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "tlsConfig",
    "bearerTokenFile", "bearerTokenSecret", "authorization", "honorLabels", "honorTimestamps",
    "trackTimestampsStaleness", "basicAuth", "oauth2", "metricRelabelings", "relabelings",
    "proxyUrl", "noProxy", "proxyFromEnvironment", "proxyConnectHeader", "followRedirects",
    "enableHttp2", "filterRunning",
}
PROM_DURATION = re.compile(r"^(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?$")


def workloads(docs):
    """(component, its first container, the pod template) of every workload."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            template = d["spec"]["template"]
            yield template["metadata"]["labels"][COMPONENT], template["spec"]["containers"][0], template


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", [{}, WITH_FOLLOWERS], ids=["defaults", "followers"])
def test_every_amprl_container_and_service_has_the_metrics_port_and_redis_none(values):
    docs, _ = render_docs(values)
    seen = set()
    for component, container, template in workloads(docs):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        annotations = template["metadata"].get("annotations", {})
        if component == "redis":
            assert "metrics" not in ports and "prometheus.io/scrape" not in annotations
            continue
        seen.add(component)
        assert ports["metrics"] == 9090 and env["AMPRL_METRICS_PORT"] == "9090", component
        assert env["AMPRL_TENSORBOARD"] == "off", component  # pods' run folders are small
        assert annotations["prometheus.io/scrape"] == "true", component
        assert annotations["prometheus.io/port"] == "9090" and annotations["prometheus.io/path"] == "/metrics"
    assert seen == AMPRL - ({"paramserver-follower"} if not values else set())
    for svc in by_kind(docs, "Service"):
        component = svc["metadata"]["labels"][COMPONENT]
        names = {p["name"]: p for p in svc["spec"]["ports"]}
        headless = svc["spec"].get("clusterIP") == "None"
        if component in AMPRL and not headless:
            assert names["metrics"]["port"] == 9090 and names["metrics"]["targetPort"] == "metrics"
        else:  # Redis; the headless replay Service (one target per pod is the other's job)
            assert "metrics" not in names, svc["metadata"]["name"]


def test_metrics_off_renders_no_port_annotation_policy_or_monitor():
    docs, _ = render_docs({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True},
                                       "grafanaDashboard": {"enabled": True}}})
    for component, container, template in workloads(docs):
        assert "metrics" not in {p["name"] for p in container["ports"]}, component
        assert "AMPRL_METRICS_PORT" not in {e["name"] for e in container.get("env", [])}, component
        assert "prometheus.io/scrape" not in template["metadata"].get("annotations", {}), component
    assert not [d for d in docs if d["kind"] == "ServiceMonitor" or "metrics" in d["metadata"]["name"]
                or "grafana" in d["metadata"]["name"]]
    assert not [p for s in by_kind(docs, "Service") for p in s["spec"]["ports"] if p["name"] == "metrics"]


def cluster_of(docs) -> Cluster:
    cluster = Cluster.from_manifests(docs)
    cluster.add_pod(PROMETHEUS)
    cluster.add_pod(INTRUDER)
    return cluster


@pytest.mark.parametrize("values", [{}, WITH_FOLLOWERS], ids=["defaults", "followers"])
def test_the_scraper_reaches_the_metrics_port_of_every_amprl_pod_and_nothing_else(values):
    docs, _ = render_docs(values)
    cluster = cluster_of(docs)
    ours = [p for p in cluster.pods if p.namespace == NAMESPACE and p is not INTRUDER]
    assert {p.labels[COMPONENT] for p in ours} >= AMPRL - ({"paramserver-follower"} if not values else set())
    for pod in ours:
        metrics = pod.port_number("metrics")
        if pod.labels[COMPONENT] in ("redis", "done"):  # the done Job's pod serves nothing
            assert metrics is None
        else:
            assert cluster.allowed(PROMETHEUS, pod, metrics), pod.name
            assert not cluster.allowed(INTRUDER, pod, metrics), pod.name
            for other in ours:  # the release's own pods do not scrape each other
                assert other is pod or not cluster.allowed(other, pod, metrics), (other.name, pod.name)
        for name, number, protocol in pod.ports:
            if name != "metrics":
                assert not cluster.allowed(PROMETHEUS, pod, number, protocol), (pod.name, name)


def test_the_scraper_is_whoever_metrics_scraper_names():
    in_release_ns = Pod("vmagent-0", NAMESPACE, {"app": "vmagent"}, ())
    docs, _ = render_docs({"metrics": {"scraper": [{"podSelector": {"matchLabels": {"app": "vmagent"}}}]}})
    cluster = cluster_of(docs)
    cluster.add_pod(in_release_ns)
    learner = next(p for p in cluster.pods if p.labels.get(COMPONENT) == "learner")
    assert cluster.allowed(in_release_ns, learner, 9090)
    assert not cluster.allowed(PROMETHEUS, learner, 9090)
    docs, _ = render_docs({"metrics": {"scraper": []}})  # nobody: no policy opens the port
    assert not [d for d in docs if d["metadata"]["name"] == f"{RELEASE}-amprl-metrics"]
    cluster = cluster_of(docs)
    learner = next(p for p in cluster.pods if p.labels.get(COMPONENT) == "learner")
    assert not cluster.allowed(PROMETHEUS, learner, 9090)


def test_the_service_monitor_has_the_operators_v1_shape_and_finds_every_amprl_service():
    docs, _ = render_docs(VALUE_SETS["pinned"])
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    assert set(spec) <= SERVICE_MONITOR_SPEC_FIELDS, set(spec) - SERVICE_MONITOR_SPEC_FIELDS
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= ENDPOINT_FIELDS, set(endpoint) - ENDPOINT_FIELDS
        assert PROM_DURATION.match(endpoint["interval"]) and endpoint["path"] == "/metrics"
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selected = [s for s in by_kind(docs, "Service")
                if all(s["metadata"]["labels"].get(k) == v for k, v in spec["selector"]["matchLabels"].items())]
    scraped = {s["metadata"]["labels"][COMPONENT] for s in selected
               if any(p["name"] == spec["endpoints"][0]["port"] for p in s["spec"]["ports"])}
    assert scraped == AMPRL  # the pinned set has followers
    assert by_kind(render_docs({})[0], "ServiceMonitor") == []  # off by default


# -- the Grafana dashboard ----------------------------------------------------------------


def served_series() -> set[str]:
    """Every sample name the services serve: their declared series (each service's
    telemetry(), built on a stand-in: a declaration reads nothing until it is read),
    counters with _total, plus the RPC histogram and counter and the process figures."""
    from amprl.actor.telemetry import telemetry as actor
    from amprl.common.telemetry import prometheus_name
    from amprl.evaluator.telemetry import telemetry as evaluator
    from amprl.learner.telemetry import telemetry as learner
    from amprl.paramserver.telemetry import telemetry as paramserver
    from amprl.replay.telemetry import telemetry as replay

    stand_in = SimpleNamespace(returns=collections.deque(maxlen=20))
    names = {"amprl_service_info", "grpc_server_handled_total", "process_cpu_seconds_total",
             "process_resident_memory_bytes"}
    names |= {f"grpc_server_handling_seconds_{s}" for s in ("bucket", "count", "sum")}
    for make in (actor, evaluator, learner, paramserver, replay):
        t = make(stand_in)
        names |= {prometheus_name(t.service, s) + ("_total" if s.kind.counts else "") for s in t.series}
    return names


def dashboard(values: dict, name: str = RELEASE) -> tuple[dict, dict]:
    docs, _ = render_docs(values, name=name)
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-grafana-dashboard")]
    (text,) = cm["data"].values()
    return cm, json.loads(text)


def test_the_dashboard_is_a_config_map_for_the_sidecar_and_off_by_default():
    cm, board = dashboard({"metrics": {"grafanaDashboard": {"enabled": True}}})
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert list(cm["data"]) == [f"{RELEASE}-amprl.json"]
    assert board["uid"] == f"{RELEASE}-amprl" and RELEASE in board["title"]
    release = next(v for v in board["templating"]["list"] if v["name"] == "release")
    assert release["query"] == RELEASE
    # Helm merges a map into the default one: null removes the default label
    cm, _ = dashboard({"metrics": {"grafanaDashboard": {
        "enabled": True, "labels": {"dashboards": "amprl", "grafana_dashboard": None},
        "annotations": {"grafana_folder": "RL"}}}})
    assert cm["metadata"]["labels"]["dashboards"] == "amprl" and "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["annotations"] == {"grafana_folder": "RL"}
    assert not [d for d in render_docs({})[0] if "grafana" in d["metadata"]["name"]]
    _, board = dashboard({"metrics": {"grafanaDashboard": {"enabled": True}}}, name="r" * 36)
    assert len(board["uid"]) <= 40  # Grafana's limit


def test_the_dashboard_queries_only_series_the_services_serve():
    pytest.importorskip("amprl.common.telemetry")
    _, board = dashboard({"metrics": {"grafanaDashboard": {"enabled": True}}})
    served = served_series()
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    asked = {m for e in exprs for m in re.findall(r"\b((?:amprl|grpc_server|process)_[a-z0-9_]+)\b", e)}
    assert asked and not asked - served, sorted(asked - served)
    for expr in exprs:  # each query keeps to this release's pods
        assert 'namespace="$namespace", pod=~"$release-amprl-.+"' in expr, expr
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


# -- values ---------------------------------------------------------------------------------


def test_render_refuses_a_metrics_port_that_a_grpc_port_uses():
    with pytest.raises(helm_python.HelmError, match="metrics.port .* must differ from replay.port"):
        render_docs({"metrics": {"port": 50051}})


@pytest.mark.parametrize("values, where", [
    ({"metrics": {"port": 0}}, "/metrics/port"),
    ({"metrics": {"enabled": "yes"}}, "/metrics/enabled"),
    ({"metrics": {"scraper": "everyone"}}, "/metrics/scraper"),
    ({"metrics": {"scraper": [{}]}}, "/metrics/scraper/0"),
    ({"metrics": {"serviceMonitor": {"interval": "soon"}}}, "/metrics/serviceMonitor/interval"),
    ({"metrics": {"grafanaDashboard": {"labels": {"grafana_dashboard": None}}}},  # none: never loaded
     "/metrics/grafanaDashboard/labels"),
    ({"metrics": {"grafanaDashboard": {"label": "x"}}}, "label"),
])
def test_schema_rejects_bad_metrics_values_naming_the_key(chart, values, where):
    with pytest.raises(helm_python.HelmValuesError) as info:
        chart.validate_schema(values)
    assert where in str(info.value)


def test_notes_show_how_to_look_at_metrics_when_they_are_on():
    _, notes = render_docs({})
    assert f"port-forward deployment/{RELEASE}-amprl-learner 9090:9090" in notes
    assert "curl -s localhost:9090/metrics" in notes
    assert "/metrics" not in render_docs({"metrics": {"enabled": False}})[1]
