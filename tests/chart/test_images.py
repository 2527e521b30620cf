"""The images, checked without a Docker engine: hadolint (the real binary) and checkov's
dockerfile framework find nothing, the Dockerfiles keep the promises the chart relies on
(pinned bases, a non-root numeric uid >= 10000, no build tools in the runtime stage, the
`amprl` entry point, a HEALTHCHECK), and that health check works against a real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from chart_tools import ROOT, hadolint_binary, run_checkov

DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile.cpu", "cuda": ROOT / "docker" / "Dockerfile.cuda"}
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|make|build-essential|apt-get|apk|pip install|curl|wget)\b")


def _instructions(path):
    """(instruction, argument) pairs with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages(path):
    stages = []
    for word, arg in _instructions(path):
        if word == "FROM":
            stages.append([])
        stages[-1].append((word, arg))
    return stages


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_hadolint_finds_no_errors_or_warnings(flavour):
    proc = subprocess.run([hadolint_binary(), "--no-color", "-f", "json", str(DOCKERFILES[flavour])],
                          capture_output=True, text=True, timeout=60)
    findings = json.loads(proc.stdout or "[]")
    serious = [f"{f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
               if f["level"] in ("error", "warning")]
    assert not serious, "\n".join(serious)


def test_checkov_dockerfile_checks_pass():
    reports = run_checkov("--framework", "dockerfile",
                          *[a for p in DOCKERFILES.values() for a in ("-f", str(p))])
    assert reports, "checkov produced no report"
    summary = reports[0]["summary"]
    failed = [f"{c['check_id']} {c['check_name']}: {c['file_path']}"
              for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    assert summary["resource_count"] == len(DOCKERFILES) and summary["passed"] > 20, summary
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerfile_is_multi_stage_pinned_non_root_and_lean(flavour):
    stages = _stages(DOCKERFILES[flavour])
    assert len(stages) >= 2, "multi-stage: build, then runtime"
    for stage in stages:
        base = stage[0][1].split()[0]
        assert re.search(r":[\w.-]+@sha256:[0-9a-f]{64}$", base), f"unpinned base {base}"
    runtime = stages[-1]
    words = [w for w, _ in runtime]
    users = [a for w, a in runtime if w == "USER"]
    assert users, "runtime stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 10000, f"USER {users[-1]}: need a numeric uid >= 10000"
    assert "HEALTHCHECK" in words
    health = dict(runtime)["HEALTHCHECK"]
    assert '"-m", "amprl.common.healthcheck"' in health
    assert dict(runtime)["ENTRYPOINT"] == '["amprl"]'
    assert any(w == "COPY" and a.startswith("--from=build") for w, a in runtime)
    for word, arg in runtime:
        if word == "RUN":
            assert not BUILD_TOOLS.search(arg), f"runtime stage installs/builds: {arg}"


def test_cpu_image_takes_the_pinned_torch_from_the_cpu_index():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in deps if d.startswith("torch=="))
    runs = " ".join(a for w, a in _instructions(DOCKERFILES["cpu"]) if w == "RUN")
    assert f"--index-url https://download.pytorch.org/whl/cpu {torch_pin}" in runs
    cuda_runs = " ".join(a for w, a in _instructions(DOCKERFILES["cuda"]) if w == "RUN")
    assert "whl/cpu" not in cuda_runs


def test_dockerignore_sends_only_the_package():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "deny everything first, then re-include"
    included = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert included == {"pyproject.toml", "README.md", "LICENSE", "src"}
    copied = {part for p in DOCKERFILES.values() for w, a in _instructions(p)
              if w == "COPY" and not a.startswith("--from") for part in a.split()[:-1]}
    assert copied <= included, copied - included


def test_the_healthcheck_probe_reports_serving_not_serving_and_down():
    grpcutil = pytest.importorskip("amprl.common.grpcutil")
    from grpc_health.v1 import health_pb2

    server, port = grpcutil.create_server([], host="127.0.0.1", port=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPRL_TLS")}

    def probe(*args):
        return subprocess.run([sys.executable, "-m", "amprl.common.healthcheck", *args],
                              env={**env, "AMPRL_PORT": str(port)}, capture_output=True,
                              text=True, timeout=30)

    try:
        ok = probe()
        assert ok.returncode == 0, ok.stderr
        server.health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        sick = probe()
        assert sick.returncode == 1 and "NOT_SERVING" in sick.stderr
    finally:
        server.stop(0).wait()
    down = probe("--timeout-s", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    no_port = subprocess.run([sys.executable, "-m", "amprl.common.healthcheck"],
                             env={k: v for k, v in env.items() if k != "AMPRL_PORT"},
                             capture_output=True, text=True, timeout=30)
    assert no_port.returncode == 1 and "AMPRL_PORT" in no_port.stderr


def test_the_healthcheck_probe_speaks_mutual_tls_with_its_own_role_certificate(tmp_path, monkeypatch):
    """What the chart's exec probes do when tls.enabled: present the pod's own certificate,
    trust ca.crt, expect the server to carry the pod's own role name; a probe with
    another role's certificate, or for another server name, fails."""
    from amprl.common import certs, grpcutil

    roles = certs.make_role_certs(tmp_path, server_name="amprl.test")
    monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(roles["replay"]))
    monkeypatch.setenv("AMPRL_TLS_SERVER_NAME", "amprl.test")
    server, port = grpcutil.create_server([], host="127.0.0.1", port=0)

    def probe(role, server_name="amprl.test"):
        env = {**os.environ, "AMPRL_PORT": str(port), "AMPRL_TLS_CERT_DIR": str(roles[role]),
               "AMPRL_TLS_SERVER_NAME": server_name}
        return subprocess.run([sys.executable, "-m", "amprl.common.healthcheck", "--timeout-s", "3"],
                              env=env, capture_output=True, text=True, timeout=30)

    try:
        ok = probe("replay")
        assert ok.returncode == 0, ok.stderr
        assert probe("replay", "someone.else").returncode == 1
        other = probe("actor")  # expects actor.amprl.test; the server is replay.amprl.test
        assert other.returncode == 1 and "UNAVAILABLE" in other.stderr, other.stderr
    finally:
        server.stop(0).wait()
