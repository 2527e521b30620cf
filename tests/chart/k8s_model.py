"""A small model of what a cluster makes of rendered manifests: the pods the workloads
create, where a DNS name and port lead, and which TCP/UDP flows the NetworkPolicies admit.

Plain functions over parsed YAML, so the semantic tests can ask "does the actor's
AMPRL_REPLAY_ADDRESS reach a replay pod, and may it?" without a cluster. NetworkPolicy
semantics follow the Kubernetes API reference (networking.k8s.io/v1):

- a pod is isolated for a direction when some policy in its namespace selects it and lists
  that direction in policyTypes; an isolated pod admits only what some selecting policy's
  rules allow (rules are a union, never a subtraction);
- a peer with only podSelector means pods in the policy's own namespace; with a
  namespaceSelector it means pods in matching namespaces (both together: AND); ipBlock
  peers never match a pod here (the chart does not use them for pod traffic);
- an empty or absent ``from``/``to`` matches every peer, an empty or absent ``ports`` every
  port; a named port resolves against the destination pod's container ports;
- a connection needs both the source's egress and the destination's ingress.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from amprl_testing.podspec import Objects, container_env

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict
    ports: tuple  # ((name, number, protocol), ...)
    env: tuple = ()  # the first container's env list, as rendered
    workload: str = ""
    ordinal: int | None = None  # StatefulSet pods only

    def port_number(self, port, protocol: str = "TCP") -> int | None:
        if isinstance(port, int):
            return port
        for name, number, proto in self.ports:
            if name == port and proto == protocol:
                return number
        return None


@dataclass
class Cluster:
    """Pods, Services, StatefulSets and NetworkPolicies of one rendering, plus extras."""

    pods: list[Pod] = field(default_factory=list)
    services: dict = field(default_factory=dict)  # (namespace, name) -> Service
    statefulsets: dict = field(default_factory=dict)  # (namespace, name) -> StatefulSet
    policies: list[dict] = field(default_factory=list)
    namespace_labels: dict = field(default_factory=dict)  # namespace -> labels

    @classmethod
    def from_manifests(cls, docs: list[dict]) -> "Cluster":
        c = cls()
        for doc in docs:
            kind, meta = doc["kind"], doc["metadata"]
            ns = meta["namespace"]
            c.namespace_labels.setdefault(ns, {"kubernetes.io/metadata.name": ns})
            if kind == "Service":
                c.services[(ns, meta["name"])] = doc
            elif kind == "NetworkPolicy":
                c.policies.append(doc)
            elif kind in WORKLOAD_KINDS:
                if kind == "StatefulSet":
                    c.statefulsets[(ns, meta["name"])] = doc
                c.pods.extend(_pods_of(doc))
        return c

    def add_pod(self, pod: Pod, namespace_labels: dict | None = None) -> None:
        self.pods.append(pod)
        self.namespace_labels.setdefault(
            pod.namespace, namespace_labels or {"kubernetes.io/metadata.name": pod.namespace})

    # -- where names lead ---------------------------------------------------------------

    def resolve(self, host: str, port: int, domain: str) -> list[tuple[Pod, int]]:
        """The (pod, container port) pairs a client dialing ``host:port`` reaches.

        ``<svc>.<ns>.svc.<domain>`` is a Service: its virtual port maps to targetPort on
        every selected pod (a headless Service maps the port straight through).
        ``<pod>.<svc>.<ns>.svc.<domain>`` is one StatefulSet pod of a headless Service
        (the StatefulSet's serviceName), dialed directly on ``port``.
        Unknown names resolve to nothing.
        """
        suffix = f".svc.{domain}"
        if not host.endswith(suffix):
            return []
        parts = host[: -len(suffix)].split(".")
        if len(parts) == 2:
            svc = self.services.get((parts[1], parts[0]))
            return self._service_targets(svc, port) if svc else []
        if len(parts) == 3:
            pod_name, svc_name, ns = parts
            svc = self.services.get((ns, svc_name))
            if not svc or svc["spec"].get("clusterIP") != "None":
                return []
            for pod in self.pods:
                sts = self.statefulsets.get((ns, pod.workload))
                if (pod.name == pod_name and pod.namespace == ns and sts is not None
                        and sts["spec"]["serviceName"] == svc_name
                        and _selects(svc["spec"].get("selector") or {}, pod.labels)
                        and any(n == port for _, n, _ in pod.ports)):
                    return [(pod, port)]
        return []

    def _service_targets(self, svc: dict, port: int) -> list[tuple[Pod, int]]:
        ns = svc["metadata"]["namespace"]
        selector = svc["spec"].get("selector") or {}
        for sp in svc["spec"].get("ports", []):
            if sp["port"] != port:
                continue
            target = sp.get("targetPort", sp["port"])
            out = []
            for pod in self.pods:
                if pod.namespace == ns and selector and _selects(selector, pod.labels):
                    number = pod.port_number(target, sp.get("protocol", "TCP"))
                    if number is not None and any(n == number for _, n, _ in pod.ports):
                        out.append((pod, number))
            return out
        return []

    # -- what the policies admit ------------------------------------------------------

    def allowed(self, src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
        return (self._admits(src, dst, port, protocol, "Egress")
                and self._admits(dst, src, port, protocol, "Ingress"))

    def _admits(self, subject: Pod, peer: Pod, port: int, protocol: str, direction: str) -> bool:
        """Whether ``subject``'s policies for ``direction`` admit traffic with ``peer``
        on the destination ``port`` (destination = peer for Egress, subject for Ingress)."""
        selecting = [p for p in self.policies
                     if p["metadata"]["namespace"] == subject.namespace
                     and direction in _policy_types(p)
                     and _selects_pod(p["spec"].get("podSelector") or {}, subject.labels)]
        if not selecting:
            return True  # not isolated in this direction
        dst = peer if direction == "Egress" else subject
        key, peers_key = ("egress", "to") if direction == "Egress" else ("ingress", "from")
        for policy in selecting:
            for rule in policy["spec"].get(key) or []:
                peers = rule.get(peers_key)
                if peers and not any(self._peer_matches(pp, peer, policy) for pp in peers):
                    continue
                ports = rule.get("ports")
                if ports and not any(_port_matches(rp, dst, port, protocol) for rp in ports):
                    continue
                return True
        return False

    def _peer_matches(self, peer_spec: dict, pod: Pod, policy: dict) -> bool:
        if "ipBlock" in peer_spec:
            return False
        ns_sel = peer_spec.get("namespaceSelector")
        pod_sel = peer_spec.get("podSelector")
        if ns_sel is None:
            in_ns = pod.namespace == policy["metadata"]["namespace"]
        else:
            in_ns = _selects_pod(ns_sel, self.namespace_labels.get(pod.namespace, {}))
        return in_ns and (pod_sel is None or _selects_pod(pod_sel, pod.labels))


def _policy_types(policy: dict) -> list[str]:
    spec = policy["spec"]
    if "policyTypes" in spec:
        return spec["policyTypes"]
    return ["Ingress"] + (["Egress"] if "egress" in spec else [])


def _port_matches(rule_port: dict, dst: Pod, port: int, protocol: str) -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    if "port" not in rule_port:
        return True
    number = dst.port_number(rule_port["port"], protocol)
    if number is None:
        return False
    end = rule_port.get("endPort", number)
    return number <= port <= end


def _selects(match_labels: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def _selects_pod(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); {} selects everything."""
    if not _selects(selector.get("matchLabels") or {}, labels):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _pods_of(workload: dict) -> list[Pod]:
    meta, spec = workload["metadata"], workload["spec"]
    template = spec["template"]
    labels = dict(template["metadata"].get("labels") or {})
    containers = template["spec"]["containers"]
    ports = tuple((p.get("name", ""), p["containerPort"], p.get("protocol", "TCP"))
                  for c in containers for p in c.get("ports", []))
    env = tuple(containers[0].get("env", []))
    replicas = spec.get("replicas", 1)
    pods = []
    for i in range(replicas):
        if workload["kind"] == "StatefulSet":
            name = f"{meta['name']}-{i}"
            pod_labels = {**labels, "statefulset.kubernetes.io/pod-name": name,
                          "apps.kubernetes.io/pod-index": str(i)}
            pods.append(Pod(name, meta["namespace"], pod_labels, ports, env, meta["name"], i))
        else:
            name = f"{meta['name']}-{i:05d}"
            pods.append(Pod(name, meta["namespace"], labels, ports, env, meta["name"]))
    return pods


def env_of(pod: Pod) -> dict[str, str]:
    """The pod's environment as the kubelet builds it: fieldRefs to the pod's name and
    labels filled in, and $(VAR) references to earlier variables expanded in order (one
    home for that: ``amprl_testing.podspec``, which the podman test runs pods with)."""
    return container_env(Objects([]), {"env": list(pod.env)}, pod.name, pod.namespace, pod.labels, {},
                         f"pod {pod.name}")


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
