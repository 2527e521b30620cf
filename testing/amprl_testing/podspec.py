"""What a kubelet would make of a rendered pod spec, as plain data for podman.

``plan_pods(objects)`` takes the objects of one Helm render (parsed YAML) and returns one
``PodPlan`` per pod its Deployments and StatefulSets would create: the pod's name and
labels, the container's image, entry point and arguments, its environment, the user and
sandbox flags, the volumes and where they are mounted, the probes, the grace period and
the DNS names the Services give it. ``PodPlan.podman_args`` turns a plan into the
arguments of ``podman run``; ``amprl_testing.podman_node`` runs them. Nothing here runs a
process, so every mapping below is tested as a function (``tests/chart/test_podspec.py``).

The mapping follows the Kubernetes API reference (core/v1 and apps/v1):

  pod name         Deployment: <name>-<pod-template-hash>-<5 random>; StatefulSet:
                   <name>-<ordinal>, hostname = pod name, subdomain = serviceName; the
                   labels the controllers add (pod-template-hash; pod-name, pod-index)
  command, args    command replaces the image's ENTRYPOINT (and drops its CMD), args its
                   CMD (podman --entrypoint / trailing arguments); $(VAR) expanded
  env              in order, each value's $(VAR) expanded against the ones before it ($$
                   is a literal $); valueFrom: fieldRef (metadata.name, .namespace, .uid,
                   .labels['k'], .annotations['k']), secretKeyRef, configMapKeyRef;
                   envFrom: configMapRef, secretRef
  securityContext  the container's over the pod's: runAsUser/runAsGroup -> --user,
                   fsGroup and supplementalGroups -> --group-add, runAsNonRoot refused
                   for uid 0, readOnlyRootFilesystem -> --read-only (and no tmpfs podman
                   would add), capabilities -> --cap-drop/--cap-add,
                   allowPrivilegeEscalation false -> no-new-privileges, seccomp
                   RuntimeDefault -> podman's default profile
  volumes          configMap / secret -> files with their rendered modes, read-only,
                   owned root:<fsGroup> (mode | 0440) as the kubelet's ownership pass
                   leaves them; emptyDir -> an empty 02777 folder of group fsGroup
                   (medium Memory -> tmpfs); persistentVolumeClaim and a StatefulSet's
                   volumeClaimTemplates -> a folder that outlives the pod (02775, group
                   fsGroup), named after the claim; subPath -> that file or folder only
  resources        limits.cpu -> --cpus, limits.memory -> --memory (requests are for the
                   scheduler, which there is none of)
  probes           startup/liveness/readiness with grpc, exec, tcpSocket or httpGet,
                   period, timeout and thresholds as rendered (``Probe``)
  termination      terminationGracePeriodSeconds -> --stop-timeout (SIGTERM, then SIGKILL)
  Services         every Service whose selector matches the pod's labels names it
                   (<svc>.<ns>.svc.<domain>), and a StatefulSet pod of a headless Service
                   also <pod>.<svc>.<ns>.svc.<domain>: network aliases, so DNS answers the
                   pod's own address (a ClusterIP's virtual IP and load balancing are not
                   emulated: a Service port must equal its target port)

What a kubelet does and this does not is refused, not ignored: a field this module does
not know raises ``NotTranslatable`` naming it, so a chart change that adds one fails the
podman test until the mapping learns it. Scheduling fields (``IGNORED_POD_FIELDS``) are
ignored on purpose: there is one node.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import re
from dataclasses import dataclass, field

WORKLOAD_KINDS = ("Deployment", "StatefulSet")

# Fields a kubelet on one node has no use for (scheduling, identity for the API server,
# pulling): ignored, with the reason in the module docstring.
IGNORED_POD_FIELDS = frozenset({
    "nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName",
    "serviceAccountName", "imagePullSecrets", "schedulerName", "automountServiceAccountToken"})
POD_FIELDS = IGNORED_POD_FIELDS | {"containers", "securityContext", "terminationGracePeriodSeconds",
                                   "volumes", "enableServiceLinks", "initContainers"}
CONTAINER_FIELDS = frozenset({
    "name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "ports", "startupProbe",
    "livenessProbe", "readinessProbe", "resources", "securityContext", "volumeMounts", "workingDir",
    "terminationMessagePath", "terminationMessagePolicy"})
POD_SECURITY_FIELDS = frozenset({"runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "fsGroupChangePolicy",
                                 "seccompProfile", "supplementalGroups"})
CONTAINER_SECURITY_FIELDS = frozenset({"runAsUser", "runAsGroup", "runAsNonRoot", "privileged",
                                       "allowPrivilegeEscalation", "readOnlyRootFilesystem",
                                       "capabilities", "seccompProfile"})
PROBE_FIELDS = frozenset({"grpc", "exec", "tcpSocket", "httpGet", "periodSeconds", "timeoutSeconds",
                          "failureThreshold", "successThreshold", "initialDelaySeconds"})

# Deployment pod names: ReplicaSet's pod-template-hash and the pod's random suffix are
# drawn from this alphabet (k8s.io/apimachinery/pkg/util/rand: no vowels, no 0/1/3).
SAFE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


class NotTranslatable(ValueError):
    """A rendered field the podman mapping does not emulate; the message names it."""


# -- Kubernetes' $(VAR) expansion ------------------------------------------------------------

def expand(text: str, defined: dict[str, str]) -> str:
    """Kubernetes' expansion (k8s.io/kubernetes third_party/forked/golang/expansion):
    ``$(NAME)`` becomes NAME's value when defined and stays as written when not, ``$$`` is
    one ``$``, any other ``$`` is kept. So a shell's ``$(cat file)`` passes through."""
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch != "$" or i + 1 == len(text):
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
            else:
                name = text[i + 2:close]
                out.append(defined[name] if name in defined else f"$({name})")
                i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


# -- quantities ------------------------------------------------------------------------------

_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value) -> float:
    """A Kubernetes resource quantity ("250m", "1Gi", 2) as a number."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    if not m or m.group(2) not in _SUFFIX:
        raise NotTranslatable(f"resource quantity {value!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


# -- the plan --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    """One of a container's probes, as rendered."""

    kind: str  # startup, liveness, readiness
    action: str  # grpc, exec, tcpSocket, httpGet
    spec: dict  # the action's own fields (port, service, command, path, ...)
    period_s: float = 10
    timeout_s: float = 1
    failure_threshold: int = 3
    initial_delay_s: float = 0


@dataclass(frozen=True)
class Mount:
    """A path inside the container and what backs it. ``source`` names a ``Volume``;
    ``sub_path`` picks one file or folder of it."""

    source: str
    path: str
    read_only: bool
    sub_path: str = ""


@dataclass
class Volume:
    """A pod volume in the shape podman needs. kind: ``files`` (a ConfigMap or Secret:
    ``files`` maps a relative path to (bytes, mode)), ``empty_dir`` (``tmpfs`` when the
    medium is Memory) or ``claim`` (a PersistentVolumeClaim, ``claim`` its name)."""

    name: str
    kind: str
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    tmpfs: bool = False
    claim: str = ""
    size_limit: str = ""


@dataclass
class PodPlan:
    """One pod of a workload, ready to become one podman container."""

    name: str
    namespace: str
    workload_kind: str
    workload: str
    labels: dict[str, str]
    container: str
    image: str
    entrypoint: list[str] | None  # None: the image's ENTRYPOINT (and its CMD when args is None too)
    args: list[str] | None  # None: the image's CMD when entrypoint is None, nothing otherwise
    env: dict[str, str]
    uid: int | None  # None: the image's USER
    gid: int | None
    groups: list[int]
    fs_group: int | None
    read_only_root: bool
    cap_drop: list[str]
    cap_add: list[str]
    no_new_privileges: bool
    seccomp: str  # RuntimeDefault, Unconfined
    cpus: float | None
    memory_bytes: int | None
    volumes: dict[str, Volume]
    mounts: list[Mount]
    probes: dict[str, Probe]
    grace_s: int
    hostname: str
    subdomain: str
    dns_names: list[str]
    dns_search: list[str]
    working_dir: str = ""
    image_pull_policy: str = "IfNotPresent"
    ports: list[dict] = field(default_factory=list)

    def port_number(self, port) -> int:
        """A probe's port: a number, or the name of one of the container's ports."""
        if isinstance(port, int):
            return port
        for p in self.ports:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise NotTranslatable(f"pod {self.name}: no container port named {port!r}")

    def podman_args(self, *, container_name: str, network: str, image: str,
                    volume_paths: dict[str, str], labels: dict[str, str] | None = None) -> list[str]:
        """``podman run`` arguments (without ``podman run`` itself) for this pod:
        ``image`` is what to run (the rendered one, or its stand-in), ``volume_paths`` maps
        each volume with host storage (files, empty_dir without tmpfs, claim) to its
        folder on the host."""
        a = ["--name", container_name, "--hostname", self.name, "--network", network, "--pull", "never"]
        for alias in self.dns_names:
            a += ["--network-alias", alias]
        for domain in self.dns_search:
            a += ["--dns-search", domain]
        a += ["--dns-option", "ndots:5"]
        for key, value in sorted({**self.labels, **(labels or {})}.items()):
            a += ["--label", f"{key}={value}"]
        if self.uid is not None:
            a += ["--user", f"{self.uid}:{self.gid if self.gid is not None else self.uid}"]
        for g in self.groups:
            a += ["--group-add", str(g)]
        if self.read_only_root:
            # podman would otherwise mount writable /tmp, /run and /var/tmp a pod lacks
            a += ["--read-only", "--read-only-tmpfs=false"]
        for cap in self.cap_drop:
            a += ["--cap-drop", cap]
        for cap in self.cap_add:
            a += ["--cap-add", cap]
        if self.no_new_privileges:
            a += ["--security-opt", "no-new-privileges"]
        if self.seccomp == "Unconfined":
            a += ["--security-opt", "seccomp=unconfined"]
        if self.cpus is not None:
            a += ["--cpus", f"{self.cpus:g}"]
        if self.memory_bytes is not None:
            a += ["--memory", str(self.memory_bytes)]
        a += ["--stop-timeout", str(self.grace_s)]
        if self.working_dir:
            a += ["--workdir", self.working_dir]
        for key, value in self.env.items():
            a += ["--env", f"{key}={value}"]
        for m in self.mounts:
            vol = self.volumes[m.source]
            if vol.kind == "empty_dir" and vol.tmpfs:
                if m.sub_path:
                    raise NotTranslatable(f"pod {self.name}: subPath {m.sub_path!r} of a Memory emptyDir")
                opts = f"type=tmpfs,destination={m.path},tmpfs-mode=0777"
                if vol.size_limit:
                    opts += f",tmpfs-size={int(quantity(vol.size_limit))}"
                a += ["--mount", opts]
                continue
            src = volume_paths[m.source] + (f"/{m.sub_path}" if m.sub_path else "")
            # ConfigMap and Secret volumes are read-only whatever the mount says.
            ro = m.read_only or vol.kind == "files"
            a += ["--mount", f"type=bind,source={src},destination={m.path}" + (",ro=true" if ro else "")]
        if self.entrypoint is not None:
            a += ["--entrypoint", json.dumps(self.entrypoint)]
        a.append(image)
        a += self.args or []
        return a


# -- from the render to plans -----------------------------------------------------------------

class Objects:
    """The objects of one render, by kind and name."""

    def __init__(self, docs: list[dict], cluster_domain: str = "cluster.local"):
        self.docs = [d for d in docs if d]
        self.cluster_domain = cluster_domain

    def get(self, kind: str, name: str) -> dict | None:
        for d in self.docs:
            if d.get("kind") == kind and d["metadata"]["name"] == name:
                return d
        return None

    def of_kind(self, *kinds: str) -> list[dict]:
        return [d for d in self.docs if d.get("kind") in kinds]

    def data(self, kind: str, name: str) -> dict[str, bytes] | None:
        """A ConfigMap's or Secret's keys as bytes (Secret data decoded), or None."""
        doc = self.get(kind, name)
        if doc is None:
            return None
        out: dict[str, bytes] = {}
        if kind == "Secret":
            out.update({k: base64.b64decode(v) for k, v in (doc.get("data") or {}).items()})
            out.update({k: str(v).encode() for k, v in (doc.get("stringData") or {}).items()})
        else:
            out.update({k: str(v).encode() for k, v in (doc.get("data") or {}).items()})
            out.update({k: base64.b64decode(v) for k, v in (doc.get("binaryData") or {}).items()})
        return out


def selects(selector: dict, labels: dict) -> bool:
    """A Service's selector (a plain map) or a LabelSelector's matchLabels."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def template_hash(template: dict) -> str:
    """A stable pod-template-hash (FNV-1a of the template, safe-encoded as Kubernetes does)."""
    h = 0x811C9DC5
    for b in json.dumps(template, sort_keys=True).encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return "".join(SAFE_ALPHABET[int(c) % len(SAFE_ALPHABET)] for c in str(h))[:10]


def pod_identity(workload: dict, index: int, rng: random.Random | None = None) -> tuple[str, dict[str, str]]:
    """(pod name, pod labels) of a workload's pod: a StatefulSet's ``index``-th, or a
    Deployment's new pod with a random suffix (``rng``)."""
    meta, spec = workload["metadata"], workload["spec"]
    labels = dict(spec["template"]["metadata"].get("labels") or {})
    if workload["kind"] == "StatefulSet":
        name = f"{meta['name']}-{index}"
        labels.update({"statefulset.kubernetes.io/pod-name": name, "apps.kubernetes.io/pod-index": str(index)})
        return name, labels
    tmpl = template_hash(spec["template"])
    suffix = "".join((rng or random.Random()).choice(SAFE_ALPHABET) for _ in range(5))
    labels["pod-template-hash"] = tmpl
    return f"{meta['name']}-{tmpl}-{suffix}", labels


def plan_pod(objects: Objects, workload: dict, index: int = 0, rng: random.Random | None = None) -> PodPlan:
    """The ``index``-th pod of ``workload`` (a Deployment's pods differ only in name)."""
    meta = workload["metadata"]
    where = f"{workload['kind']} {meta['name']}"
    if workload["kind"] not in WORKLOAD_KINDS:
        raise NotTranslatable(f"{where}: kind")
    name, labels = pod_identity(workload, index, rng)
    namespace = meta.get("namespace", "default")
    tmpl = workload["spec"]["template"]
    annotations = tmpl["metadata"].get("annotations") or {}
    spec = tmpl["spec"]
    _known(spec, POD_FIELDS, f"{where} pod spec")
    if spec.get("initContainers"):
        raise NotTranslatable(f"{where}: initContainers")
    if spec.get("enableServiceLinks", True):
        raise NotTranslatable(f"{where}: enableServiceLinks (Service environment variables)")
    if len(spec["containers"]) != 1:
        raise NotTranslatable(f"{where}: {len(spec['containers'])} containers (one per pod is emulated)")
    c = spec["containers"][0]
    where = f"{where} container {c['name']}"
    _known(c, CONTAINER_FIELDS, where)

    env = container_env(objects, c, name, namespace, labels, annotations, where)
    entrypoint = [expand(s, env) for s in c["command"]] if "command" in c else None
    args = [expand(s, env) for s in c["args"]] if "args" in c else None

    psc, csc = spec.get("securityContext") or {}, c.get("securityContext") or {}
    _known(psc, POD_SECURITY_FIELDS, f"{where} pod securityContext")
    _known(csc, CONTAINER_SECURITY_FIELDS, f"{where} securityContext")
    if csc.get("privileged"):
        raise NotTranslatable(f"{where}: privileged")
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) and uid == 0:
        raise NotTranslatable(f"{where}: runAsNonRoot with runAsUser 0 (the kubelet refuses to start it)")
    fs_group = psc.get("fsGroup")
    groups = ([fs_group] if fs_group is not None else []) + list(psc.get("supplementalGroups") or [])
    caps = csc.get("capabilities") or {}
    seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {"type": "RuntimeDefault"})["type"]
    if seccomp not in ("RuntimeDefault", "Unconfined"):
        raise NotTranslatable(f"{where}: seccompProfile {seccomp}")

    limits = (c.get("resources") or {}).get("limits") or {}
    extra = set(limits) - {"cpu", "memory"}
    if extra:
        raise NotTranslatable(f"{where}: resource limits {sorted(extra)}")

    volumes = pod_volumes(objects, workload, name, fs_group, where)
    mounts = []
    for m in c.get("volumeMounts") or []:
        if m["name"] not in volumes:
            raise NotTranslatable(f"{where}: volumeMount of unknown volume {m['name']!r}")
        mounts.append(Mount(m["name"], m["mountPath"], bool(m.get("readOnly")), m.get("subPath", "")))

    probes = {}
    for kind in ("startup", "liveness", "readiness"):
        p = c.get(f"{kind}Probe")
        if p:
            probes[kind] = probe(p, kind, where)

    subdomain = workload["spec"].get("serviceName", "") if workload["kind"] == "StatefulSet" else ""
    domain = objects.cluster_domain
    return PodPlan(
        name=name, namespace=namespace, workload_kind=workload["kind"], workload=meta["name"], labels=labels,
        container=c["name"], image=c["image"], entrypoint=entrypoint, args=args, env=env,
        uid=uid, gid=gid, groups=groups, fs_group=fs_group,
        read_only_root=bool(csc.get("readOnlyRootFilesystem")),
        cap_drop=list(caps.get("drop") or []), cap_add=list(caps.get("add") or []),
        no_new_privileges=csc.get("allowPrivilegeEscalation") is False, seccomp=seccomp,
        cpus=quantity(limits["cpu"]) if "cpu" in limits else None,
        memory_bytes=int(quantity(limits["memory"])) if "memory" in limits else None,
        volumes=volumes, mounts=mounts, probes=probes,
        grace_s=int(spec.get("terminationGracePeriodSeconds", 30)),
        hostname=name, subdomain=subdomain,
        dns_names=dns_names(objects, namespace, name, labels, subdomain, c.get("ports") or []),
        dns_search=[f"{namespace}.svc.{domain}", f"svc.{domain}", domain],
        working_dir=c.get("workingDir", ""), image_pull_policy=c.get("imagePullPolicy", "IfNotPresent"),
        ports=list(c.get("ports") or []))


def plan_pods(objects: Objects, replicas: dict[str, int] | None = None,
              rng: random.Random | None = None) -> list[PodPlan]:
    """Every pod of every Deployment and StatefulSet; ``replicas`` overrides a
    workload's count by name (what ``kubectl scale`` would set)."""
    plans = []
    for w in objects.of_kind(*WORKLOAD_KINDS):
        n = (replicas or {}).get(w["metadata"]["name"], w["spec"].get("replicas", 1))
        plans += [plan_pod(objects, w, i, rng) for i in range(n)]
    return plans


def container_env(objects: Objects, c: dict, pod: str, namespace: str, labels: dict, annotations: dict,
                  where: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it (envFrom first, then env in
    order; $(VAR) in a value expands to a variable defined before it)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom") or []:
        ref_kind = "ConfigMap" if "configMapRef" in src else "Secret" if "secretRef" in src else ""
        if not ref_kind:
            raise NotTranslatable(f"{where}: envFrom {sorted(src)}")
        ref = src["configMapRef" if ref_kind == "ConfigMap" else "secretRef"]
        data = objects.data(ref_kind, ref["name"])
        if data is None:
            if ref.get("optional"):
                continue
            raise NotTranslatable(f"{where}: envFrom {ref_kind} {ref['name']} is not in the render")
        for k, v in data.items():
            env[src.get("prefix", "") + k] = v.decode()
    for item in c.get("env") or []:
        name = item["name"]
        if "valueFrom" not in item:
            env[name] = expand(str(item.get("value", "")), env)
            continue
        vf = item["valueFrom"]
        if "fieldRef" in vf:
            path = vf["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
            if path == "metadata.name":
                env[name] = pod
            elif path == "metadata.namespace":
                env[name] = namespace
            elif m:
                env[name] = (labels if m.group(1) == "labels" else annotations).get(m.group(2), "")
            else:
                raise NotTranslatable(f"{where}: env {name} fieldRef {path}")
        elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
            ref_kind = "Secret" if "secretKeyRef" in vf else "ConfigMap"
            ref = vf["secretKeyRef" if ref_kind == "Secret" else "configMapKeyRef"]
            data = objects.data(ref_kind, ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise NotTranslatable(f"{where}: env {name}: {ref_kind} {ref['name']} key {ref['key']} "
                                      "is not in the render")
            env[name] = data[ref["key"]].decode()
        else:
            raise NotTranslatable(f"{where}: env {name} valueFrom {sorted(vf)}")
    return env


def pod_volumes(objects: Objects, workload: dict, pod: str, fs_group: int | None, where: str) -> dict[str, Volume]:
    out: dict[str, Volume] = {}
    for v in workload["spec"]["template"]["spec"].get("volumes") or []:
        name = v["name"]
        if "configMap" in v or "secret" in v:
            kind = "ConfigMap" if "configMap" in v else "Secret"
            src = v["configMap" if kind == "ConfigMap" else "secret"]
            ref = src.get("name") or src.get("secretName")
            data = objects.data(kind, ref)
            if data is None:
                if src.get("optional"):
                    out[name] = Volume(name, "files")
                    continue
                raise NotTranslatable(f"{where}: volume {name}: {kind} {ref} is not in the render")
            mode = int(src.get("defaultMode", 0o644))
            items = src.get("items")
            files = {}
            if items:
                for it in items:
                    if it["key"] not in data:
                        if src.get("optional"):
                            continue
                        raise NotTranslatable(f"{where}: volume {name}: {kind} {ref} has no key {it['key']}")
                    files[it["path"]] = (data[it["key"]], int(it.get("mode", mode)))
            else:
                files = {k: (b, mode) for k, b in data.items()}
            if fs_group is not None:  # the kubelet's ownership pass: group-readable
                files = {p: (b, m | 0o440) for p, (b, m) in files.items()}
            out[name] = Volume(name, "files", files=files)
        elif "emptyDir" in v:
            ed = v["emptyDir"] or {}
            out[name] = Volume(name, "empty_dir", tmpfs=ed.get("medium") == "Memory",
                               size_limit=str(ed.get("sizeLimit", "")))
        elif "persistentVolumeClaim" in v:
            out[name] = Volume(name, "claim", claim=v["persistentVolumeClaim"]["claimName"])
        else:
            raise NotTranslatable(f"{where}: volume {name} of type {sorted(set(v) - {'name'})}")
    for t in workload["spec"].get("volumeClaimTemplates") or []:
        tname = t["metadata"]["name"]
        out[tname] = Volume(tname, "claim", claim=f"{tname}-{pod}")
    return out


def probe(p: dict, kind: str, where: str) -> Probe:
    _known(p, PROBE_FIELDS, f"{where} {kind}Probe")
    actions = [a for a in ("grpc", "exec", "tcpSocket", "httpGet") if a in p]
    if len(actions) != 1:
        raise NotTranslatable(f"{where} {kind}Probe: actions {actions}")
    if p.get("successThreshold", 1) != 1:
        raise NotTranslatable(f"{where} {kind}Probe: successThreshold {p['successThreshold']}")
    return Probe(kind, actions[0], copy.deepcopy(p[actions[0]]), float(p.get("periodSeconds", 10)),
                 float(p.get("timeoutSeconds", 1)), int(p.get("failureThreshold", 3)),
                 float(p.get("initialDelaySeconds", 0)))


def dns_names(objects: Objects, namespace: str, pod: str, labels: dict, subdomain: str,
              ports: list[dict]) -> list[str]:
    """The DNS names that lead to this pod: every Service selecting it, and its own name
    under its StatefulSet's headless Service."""
    domain = objects.cluster_domain
    names = []
    by_name = {p.get("name"): int(p["containerPort"]) for p in ports}
    for svc in objects.of_kind("Service"):
        if svc["metadata"].get("namespace", "default") != namespace:
            continue
        if not selects(svc["spec"].get("selector") or {}, labels):
            continue
        sname = svc["metadata"]["name"]
        for sp in svc["spec"].get("ports") or []:
            target = sp.get("targetPort", sp["port"])
            number = by_name.get(target) if isinstance(target, str) else int(target)
            if number != sp["port"]:
                raise NotTranslatable(f"Service {sname} port {sp['port']} -> {target} ({number}): "
                                      "only port == targetPort is emulated (no virtual IP)")
        names.append(f"{sname}.{namespace}.svc.{domain}")
        if subdomain == sname and svc["spec"].get("clusterIP") == "None":
            names.append(f"{pod}.{sname}.{namespace}.svc.{domain}")
    return names


def _known(d: dict, known: frozenset[str] | set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise NotTranslatable(f"{where}: {', '.join(unknown)} (not emulated under podman)")
