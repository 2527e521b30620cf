"""The images, checked without a Docker engine: hadolint (the real binary) and checkov's
dockerfile framework find nothing, the Dockerfiles keep the promises the chart relies on
(pinned bases, a non-root numeric uid >= 10000, no build tools in the runtime stage, the
`amprl` entry point, a HEALTHCHECK), take their base and package source as build
arguments, carry the one version of package and chart, `docker/build.sh` picks whichever
builder is there, and the health check works against a real server. Building and running
the image for real is `make image-check` (docker/check_image.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
import yaml

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
    """The instructions of each stage; global ARGs (before the first FROM) are left out."""
    stages = []
    for word, arg in _instructions(path):
        if word == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word, arg))
    return stages


def _arg_defaults(path):
    """Every ARG's default, global and per stage (a name means one thing in our files)."""
    return dict(a.split("=", 1) for w, a in _instructions(path) if w == "ARG" and "=" in a)


def _resolve(text, defaults):
    """${NAME} and $NAME replaced by the ARG defaults: what a build without --build-arg sees."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), text)


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


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
    defaults = _arg_defaults(DOCKERFILES[flavour])
    assert len(stages) >= 2, "multi-stage: build, then runtime"
    bases = {_resolve(stage[0][1].split()[0], defaults) for stage in stages}
    assert len(bases) == 1, f"the runtime must run the Python the build stage built for: {bases}"
    for base in bases:
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
    torch_pin = next(d for d in _pyproject()["dependencies"] if d.startswith("torch=="))
    defaults = _arg_defaults(DOCKERFILES["cpu"])
    runs = _resolve(" ".join(a for w, a in _instructions(DOCKERFILES["cpu"]) if w == "RUN"), defaults)
    assert f'--index-url "https://download.pytorch.org/whl/cpu" {torch_pin}' in runs
    cuda_runs = " ".join(a for w, a in _instructions(DOCKERFILES["cuda"]) if w == "RUN")
    assert "whl/cpu" not in cuda_runs and "TORCH_INDEX_URL" not in _arg_defaults(DOCKERFILES["cuda"])


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_base_and_package_source_are_build_arguments_with_public_defaults(flavour):
    """Users build from the pinned public base and the public indexes; an offline build
    overrides BASE_IMAGE, WHEELHOUSE and PIP_NO_INDEX=1, and none of it reaches the runtime."""
    defaults = _arg_defaults(DOCKERFILES[flavour])
    assert defaults["BASE_IMAGE"].startswith("docker.io/library/python:3.11-slim-bookworm@sha256:")
    assert defaults["PIP_INDEX_URL"] == "https://pypi.org/simple"
    assert defaults["PIP_NO_INDEX"] == "0"
    assert defaults["WHEELHOUSE"] == "docker/wheelhouse"
    build, *_, runtime = _stages(DOCKERFILES[flavour])
    assert build[0][1].split()[0] == runtime[0][1].split()[0] == "${BASE_IMAGE}"
    assert ("COPY", "${WHEELHOUSE} /wheelhouse") in build
    assert "PIP_FIND_LINKS=/wheelhouse" in dict(build)["ENV"]
    runtime_args = {a.split("=")[0] for w, a in runtime if w == "ARG"}
    assert runtime_args == {"VERSION", "REVISION"}, "package sources stay in the build stage"
    assert not any("wheelhouse" in a for w, a in runtime if w in ("COPY", "ADD", "ENV"))


def test_one_version_for_package_chart_and_images():
    """pyproject.toml's version is the one source; the chart, its image tags, the package's
    __version__ and the Dockerfiles' label default follow it."""
    import amprl

    version = _pyproject()["version"]
    chart = yaml.safe_load((ROOT / "charts" / "amprl" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "amprl" / "values.yaml").read_text())
    found = {"Chart.yaml version": chart["version"], "Chart.yaml appVersion": chart["appVersion"],
             "values image.cpu.tag": values["image"]["cpu"]["tag"],
             "values image.cuda.tag": values["image"]["cuda"]["tag"],
             "amprl.__version__": amprl.__version__,
             **{f"Dockerfile.{f} ARG VERSION": _arg_defaults(p)["VERSION"] for f, p in DOCKERFILES.items()}}
    assert {k: v for k, v in found.items() if v != version} == {}, f"pyproject.toml says {version}"


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_labels_carry_version_revision_and_licence(flavour):
    labels = dict(re.findall(r'org\.opencontainers\.image\.(\w+)="([^"]*)"',
                             dict(_stages(DOCKERFILES[flavour])[-1])["LABEL"]))
    assert labels["version"] == "${VERSION}" and labels["revision"] == "${REVISION}"
    assert labels["licenses"] == _pyproject()["license"]
    assert labels["title"] == f"amprl-{flavour}" and labels["source"].startswith("https://")


def test_dockerignore_sends_only_the_package():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "deny everything first, then re-include"
    included = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    # the package, and the wheelhouses an offline build installs from (build stage only)
    assert included == {"pyproject.toml", "README.md", "LICENSE", "src", "docker/wheelhouse",
                        "build/wheelhouse"}
    copied = {_resolve(part, _arg_defaults(p)) for p in DOCKERFILES.values() for w, a in _instructions(p)
              if w == "COPY" and not a.startswith("--from") for part in a.split()[:-1]}
    assert copied <= included, copied - included
    default_wheelhouse = {f.name for f in (ROOT / "docker" / "wheelhouse").iterdir()}
    assert default_wheelhouse == {"README.md"}, "the default wheelhouse holds no wheels"


def _stub(bin_dir, name, rc=0):
    """A fake builder that records its arguments (one per line) and exits with rc."""
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{bin_dir}/{name}.args"\nexit {rc}\n')
    path.chmod(0o755)


@pytest.mark.parametrize("present, expected", [
    ({"docker": 0, "podman": 0, "buildah": 0}, "docker"),
    ({"docker": 1, "podman": 0, "buildah": 0}, "podman"),  # a docker CLI without a daemon
    ({"buildah": 0}, "buildah"),
])
def test_build_script_uses_the_builder_that_is_there(tmp_path, present, expected):
    for name, rc in present.items():
        _stub(tmp_path, name, rc)
    for tool in ("sh", "sed", "git", "dirname"):
        target = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        (tmp_path / tool).symlink_to(target)
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run(["/bin/bash", str(ROOT / "docker" / "build.sh"), "cpu", "--network", "none"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / f"{expected}.args").read_text().splitlines()
    version = _pyproject()["version"]
    assert args[:1] == (["bud"] if expected == "buildah" else ["build"])
    if expected != "docker":
        assert "--format" in args and args[args.index("--format") + 1] == "docker"  # keeps HEALTHCHECK
    assert args[args.index("-t") + 1] == f"ghcr.io/amp-rl/amprl-cpu:{version}"
    assert f"VERSION={version}" in args and any(a.startswith("REVISION=") for a in args)
    assert args[-3:] == ["--network", "none", str(ROOT)]


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
