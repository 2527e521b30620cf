"""The chart rendered by the real Helm engine (Helm's Go SDK through helm_python: no
binary, no cluster) for the value sets the issue names, shared by the chart tests."""

from __future__ import annotations

import copy
from pathlib import Path

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "amprl"
RELEASE = "myrun"
NAMESPACE = "rl"

_GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
_DIGEST = "sha256:" + "ab" * 32

# The value sets every structural test runs on (ids are the test ids).
VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "gpu-learner": {
        "learner": {"gpu": 1, "replicas": 2,
                    "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
                    "tolerations": [_GPU_TOLERATION]},
        "experiment": {"learner": {"precision": "bf16"}},
    },
    "replay-3-shards": {"replay": {"shards": 3}},
    # Mutual TLS with Secrets made by hand: the default names, one renamed.
    "tls": {"tls": {"enabled": True, "serverName": "amprl.rl.svc", "secrets": {"replay": "replay-keys"}}},
    # Mutual TLS with cert-manager writing every role's Secret, followers on.
    "tls-cert-manager": {
        "tls": {"enabled": True, "certManager": {
            "enabled": True, "issuerRef": {"name": "amprl-ca", "kind": "ClusterIssuer"},
            "operator": True}},
        "paramserver": {"followers": {"replicas": 2}},
    },
    "actors-64": {"actor": {"replicas": 64}},
    # Redis over TLS, the replay user and its key prefix renamed, fsync on every write.
    "redis-tls": {
        "redis": {"tls": {"enabled": True}, "auth": {"username": "replay-0"}, "keyPrefix": "rl:shard"},
        "experiment": {"replay": {"durability": "always"}},
    },
    "paramserver-followers": {"paramserver": {"followers": {"replicas": 3}}},
    # The production setting: digests pinned, mutual TLS from cert-manager, an existing
    # Redis secret, GPU learner, pull-only followers serving the fleet, the Prometheus
    # Operator's ServiceMonitor and the Grafana dashboard.
    "pinned": {
        "image": {"cpu": {"digest": _DIGEST}, "cuda": {"digest": _DIGEST}},
        "redis": {"image": {"digest": _DIGEST},
                  "auth": {"existingSecret": "redis-auth", "existingSecretKey": "pw"}},
        "tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "amprl-ca"}}},
        "learner": {"gpu": 1},
        "paramserver": {"followers": {"replicas": 2}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                    "grafanaDashboard": {"enabled": True}},
    },
}


def render_docs(values: dict | None = None, name: str = RELEASE,
                namespace: str = NAMESPACE) -> tuple[list[dict], str]:
    """Renders the chart: (every Kubernetes object, NOTES.txt)."""
    chart = helm_python.Chart.load(CHART)
    out = chart.render(values=copy.deepcopy(values or {}), name=name, namespace=namespace,
                       is_install=True)
    docs, notes = [], ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append({"__source__": path, **doc})
    return docs, notes


def followers(values: dict) -> int:
    """paramserver.followers.replicas of a value set."""
    return values.get("paramserver", {}).get("followers", {}).get("replicas", 0)


def strip_source(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "__source__"}
