"""One node of pods under podman: the containers of ``podspec.PodPlan`` s on one network.

``PodmanNode`` creates an internal podman network (netavark, with aardvark-dns answering
the network aliases: the Services' names), materializes each pod's volumes under a
temporary folder (ConfigMap and Secret files with their modes and owners, emptyDir and
claim folders), starts each pod as one container with ``podman run`` and the plan's
arguments, probes it as a kubelet would (``Prober``: the gRPC probe from the node to the
pod's address, an exec probe with ``podman exec``), and stops it as a scale-down does:
SIGTERM, then SIGKILL after the pod's terminationGracePeriodSeconds.

Everything it creates carries the label ``amprl.podman-node=<pid>-<n>``; ``close()``
removes the containers, the network and the folder, also after a failure, and a
SIGTERM while the node is open becomes ``KeyboardInterrupt`` so that the ``with`` block's
exit (and pytest's teardown) run. ``sweep_stale()`` removes what a node whose process was
SIGKILLed left behind.

podman reads ``CONTAINERS_CONF`` / ``CONTAINERS_STORAGE_CONF`` from the environment (what
``make image-check`` uses: ``docker/containers.conf`` and ``build/containers/storage.conf``).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from amprl_testing.podspec import PodPlan, Probe

LABEL = "amprl.podman-node"
_counter = itertools.count()


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ...: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def sweep_stale() -> list[str]:
    """Removes the containers, networks and folders of nodes whose process is gone (one
    that was SIGKILLed); what it removed."""
    removed = []
    for c in json.loads(podman("ps", "-a", "--filter", f"label={LABEL}", "--format", "json",
                               check=False).stdout or "[]"):
        if not _alive(_owner((c.get("Labels") or {}).get(LABEL, ""))):
            name = c["Names"][0]
            podman("rm", "--force", "--time", "0", name, check=False)
            removed.append(name)
    for n in json.loads(podman("network", "ls", "--filter", f"label={LABEL}", "--format", "json",
                               check=False).stdout or "[]"):
        if not _alive(_owner((n.get("labels") or {}).get(LABEL, ""))):
            podman("network", "rm", "--force", n["name"], check=False)
            removed.append(n["name"])
    for folder in Path(tempfile.gettempdir()).glob("amprl-node-*-*-*"):
        if not _alive(_owner(folder.name.removeprefix("amprl-node-"))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def _owner(node_id: str) -> int:
    """The process id in a node id ("<pid>-<n>"); 0 when there is none."""
    head = node_id.split("-")[0]
    return int(head) if head.isdigit() else 0


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@dataclass
class ProbeRecord:
    """What one pod's probes saw. ``restart`` / ``unready`` hold why the kubelet would
    have restarted the container or taken the pod out of its Services."""

    started_after_s: float | None = None
    ready_after_s: float | None = None
    runs: dict[str, int] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)
    restart: list[str] = field(default_factory=list)
    unready: list[str] = field(default_factory=list)


@dataclass
class Pod:
    plan: PodPlan
    container: str
    ip: str
    started: float
    image: str
    record: ProbeRecord = field(default_factory=ProbeRecord)
    prober: "Prober | None" = None


class Prober:
    """A kubelet's probe loop for one pod, on its own thread: the startup probe every
    period until it passes (its failureThreshold used up: the kubelet would restart the
    container), then liveness and readiness on their own periods; failureThreshold
    failures in a row are a restart (liveness) or an unready pod (readiness)."""

    def __init__(self, node: "PodmanNode", pod: Pod):
        self.node, self.pod = node, pod
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{pod.plan.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        rec, probes = self.pod.record, self.pod.plan.probes
        t0 = self.pod.started
        startup = probes.get("startup")
        if startup is not None:
            if self._stop.wait(startup.initial_delay_s):
                return
            failed = 0
            while True:
                ok, why = self.run(startup)
                if ok:
                    break
                failed += 1
                if failed >= startup.failure_threshold:
                    rec.restart.append(f"startup: {failed} failures, last: {why}")
                    return
                if self._stop.wait(startup.period_s):
                    return
        rec.started_after_s = round(time.monotonic() - t0, 1)
        due = {k: time.monotonic() + (0 if startup else probes[k].initial_delay_s)
               for k in ("liveness", "readiness") if k in probes}
        in_row = {k: 0 for k in due}
        ready = "readiness" not in probes
        if ready:
            rec.ready_after_s = rec.started_after_s
        while not self._stop.is_set():
            now = time.monotonic()
            for kind, when in due.items():
                if now < when:
                    continue
                p = probes[kind]
                due[kind] = now + p.period_s
                ok, why = self.run(p)
                if self._stop.is_set():
                    return
                in_row[kind] = 0 if ok else in_row[kind] + 1
                if kind == "readiness":
                    if ok and not ready:
                        ready = True
                        if rec.ready_after_s is None:
                            rec.ready_after_s = round(time.monotonic() - t0, 1)
                    elif in_row[kind] == p.failure_threshold and ready:
                        ready = False
                        rec.unready.append(f"{in_row[kind]} failures in a row, last: {why}")
                elif in_row[kind] == p.failure_threshold:
                    rec.restart.append(f"liveness: {in_row[kind]} failures in a row, last: {why}")
            self._stop.wait(max(0.05, min(due.values(), default=now + 1) - time.monotonic()))

    def run(self, p: Probe) -> tuple[bool, str]:
        """One probe: (passed, why not)."""
        rec = self.pod.record
        rec.runs[p.kind] = rec.runs.get(p.kind, 0) + 1
        try:
            ok, why = self._action(p)
        except Exception as exc:  # a probe that cannot run fails, as the kubelet's does
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            rec.failures.setdefault(p.kind, []).append(f"{time.monotonic() - self.pod.started:.1f}s {why}")
        return ok, why

    def _action(self, p: Probe) -> tuple[bool, str]:
        ip = self.pod.ip
        if p.action == "grpc":
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            port = self.pod.plan.port_number(p.spec["port"])
            with grpc.insecure_channel(f"{ip}:{port}") as channel:
                try:
                    status = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                        health_pb2.HealthCheckRequest(service=p.spec.get("service", "")), timeout=p.timeout_s).status
                except grpc.RpcError as exc:
                    return False, f"{exc.code().name}: {exc.details()}"
            return status == health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        if p.action == "exec":
            try:
                proc = self.node.exec(self.pod, p.spec["command"], timeout=p.timeout_s + 5)
            except subprocess.TimeoutExpired:
                return False, f"timed out after {p.timeout_s}s"
            return proc.returncode == 0, f"exit {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-300:]}"
        if p.action == "tcpSocket":
            with socket.create_connection((ip, self.pod.plan.port_number(p.spec["port"])), timeout=p.timeout_s):
                return True, ""
        if p.action == "httpGet":
            port = self.pod.plan.port_number(p.spec["port"])
            with urllib.request.urlopen(f"http://{ip}:{port}{p.spec.get('path', '/')}", timeout=p.timeout_s) as r:
                return 200 <= r.status < 400, f"HTTP {r.status}"
        return False, f"unknown probe action {p.action}"


class PodmanNode:
    """Pods on one internal podman network; a context manager that removes them all.

    ``image_standins`` maps a rendered image reference to the local image that runs in its
    place (recorded on each ``Pod``); every other image must already be in podman's storage
    (the plan's pull policy becomes ``--pull never``: no registry is reached).
    """

    def __init__(self, image_standins: dict[str, str] | None = None, keep_dir: Path | None = None):
        self.id = f"{os.getpid()}-{next(_counter)}"
        self.name = f"amprl-node-{self.id}"
        self.image_standins = dict(image_standins or {})
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.keep_dir = keep_dir
        self.pods: dict[str, Pod] = {}
        self.helpers: list[str] = []
        self.gone: dict[str, Pod] = {}
        self._previous_sigterm: signal.Handlers | Callable | int | None = None
        self._closed = False

    # -- life of the node ------------------------------------------------------------------

    def __enter__(self) -> "PodmanNode":
        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _sigterm)
        except ValueError:  # not the main thread: the caller handles SIGTERM
            self._previous_sigterm = None
        try:
            sweep_stale()
            podman("network", "create", "--internal", "--label", f"{LABEL}={self.id}", self.name)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        old = signal.getsignal(signal.SIGTERM)
        try:
            if old is _sigterm:  # a second SIGTERM may not cut the clean-up short
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:
            pass
        try:
            for pod in self.pods.values():
                if pod.prober:
                    pod.prober._stop.set()
            if self.keep_dir is not None:
                self.save_logs(self.keep_dir)
            names = [p.container for p in self.pods.values()] + self.helpers
            for attempt in range(5):
                left = podman("ps", "-a", "--filter", f"label={LABEL}={self.id}", "--format", "{{.Names}}",
                              check=False).stdout.split()
                for name in set(left) | (set(names) if attempt == 0 else set()):
                    podman("rm", "--force", "--time", "0", name, check=False, timeout=60)
                if not left and attempt > 0:
                    break
                time.sleep(0.5)
            podman("network", "rm", "--force", self.name, check=False)
            shutil.rmtree(self.root, ignore_errors=True)
        finally:
            try:
                if self._previous_sigterm is not None:
                    signal.signal(signal.SIGTERM, self._previous_sigterm)
            except ValueError:
                pass

    # -- pods ------------------------------------------------------------------------------

    def start(self, plan: PodPlan) -> Pod:
        """Starts the pod (does not wait for it) and its probe loop."""
        if plan.name in self.pods:
            raise ValueError(f"pod {plan.name} runs already")
        image = self.image_standins.get(plan.image, plan.image)
        if podman("image", "exists", image, check=False).returncode != 0:
            raise RuntimeError(f"pod {plan.name}: image {image} is not in podman's storage"
                               + (f" (the stand-in for {plan.image})" if image != plan.image else ""))
        container = f"{self.name}-{plan.name}"
        args = plan.podman_args(container_name=container, network=self.name, image=image,
                                volume_paths=self._volumes(plan), labels={LABEL: self.id})
        podman("run", "--detach", *args, timeout=120)
        began = time.monotonic()
        ip = podman("inspect", container, "--format",
                    '{{(index .NetworkSettings.Networks "' + self.name + '").IPAddress}}').stdout.strip()
        pod = Pod(plan, container, ip, began, image)
        self.pods[plan.name] = pod
        pod.prober = Prober(self, pod)
        return pod

    def stop(self, name: str) -> tuple[int, float]:
        """Stops the pod as a scale-down does (SIGTERM; SIGKILL after its grace period);
        its probes stop first. (exit code, seconds it took)."""
        pod = self.pods.pop(name)
        if pod.prober:
            pod.prober.stop()
        began = time.monotonic()
        podman("stop", "--time", str(pod.plan.grace_s), pod.container, timeout=pod.plan.grace_s + 60)
        took = time.monotonic() - began
        code = int(podman("inspect", pod.container, "--format", "{{.State.ExitCode}}").stdout.strip())
        self.gone[name] = pod
        return code, took

    def exec(self, pod: Pod, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """``argv`` inside the pod's container, as its user and environment (an exec probe)."""
        return subprocess.run(["podman", "exec", pod.container, *argv], capture_output=True, text=True,
                              timeout=timeout)

    def logs(self, pod: Pod) -> str:
        proc = podman("logs", pod.container, check=False, timeout=60)
        return proc.stdout + proc.stderr

    def state(self, pod: Pod) -> dict:
        return json.loads(podman("inspect", pod.container, "--format", "{{json .State}}").stdout)

    def start_helper(self, role: str, args: list[str]) -> str:
        """A container on the node's network that is not a pod of the release (a debug
        pod, as ``kubectl run`` would start); ``args`` follow ``podman run``. Its name."""
        name = f"{self.name}-{role}"
        podman("run", "--detach", "--name", name, "--network", self.name, "--label", f"{LABEL}={self.id}",
               "--pull", "never", *args)
        self.helpers.append(name)
        return name

    def save_logs(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for pod in [*self.pods.values(), *self.gone.values()]:
            (folder / f"{pod.plan.name}.log").write_text(self.logs(pod))

    # -- volumes -----------------------------------------------------------------------------

    def _volumes(self, plan: PodPlan) -> dict[str, str]:
        """Host folders of the pod's volumes, made as the kubelet would make them."""
        gid = plan.fs_group
        paths = {}
        for name, vol in plan.volumes.items():
            if vol.kind == "empty_dir" and vol.tmpfs:
                continue
            if vol.kind == "claim":  # outlives the pod: the same folder for the same claim
                path = self.root / "claims" / vol.claim
                fresh = not path.exists()
                path.mkdir(parents=True, exist_ok=True)
                if fresh:
                    _own(path, gid, 0o2775 if gid is not None else 0o755)
            else:
                path = self.root / "pods" / plan.name / name
                path.mkdir(parents=True)
                if vol.kind == "empty_dir":
                    _own(path, gid, 0o2777 if gid is not None else 0o777)
                else:
                    for rel, (data, mode) in vol.files.items():
                        f = path / rel
                        f.parent.mkdir(parents=True, exist_ok=True)
                        f.write_bytes(data)
                        _own(f, gid, mode)
                    _own(path, gid, 0o2755 if gid is not None else 0o755)
            paths[name] = str(path)
        return paths


def _own(path: Path, gid: int | None, mode: int) -> None:
    if gid is not None:
        os.chown(path, 0, gid)
    os.chmod(path, mode)


def _sigterm(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")
