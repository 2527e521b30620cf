"""Checks a built AMP-RL CPU image the way the chart runs it, with podman.

  python3 docker/check_image.py [IMAGE] [--podman podman] [--timeout-s 120]

IMAGE defaults to ghcr.io/amp-rl/amprl-cpu:<pyproject.toml's version>, what `make images`
tags. Each check runs the image with a read-only root filesystem, every capability dropped,
no new privileges and the image's own user (as the chart's securityContext does):

  labels       org.opencontainers.image.version is pyproject.toml's, revision/licenses/source set
  user         the image's USER is a numeric uid >= 10000 and processes run as it
  version      `amprl --version` prints that version
  service      `amprl paramserver` with the chart's environment (experiment file mounted
               read-only, /tmp and the run directory as the only writable paths) becomes
               healthy by the image's own HEALTHCHECK (`podman healthcheck run`)
  sandbox      inside that container: no effective capabilities, the root filesystem
               refuses writes, /tmp and the run directory take them
  no-tools     no compiler (gcc, cc, c++, g++, clang) and no pip (command or module)

Prints one JSON object ({"image", "ok", "checks": [{"name", "ok", "detail"}], ...}) and
exits 1 when a check fails. Every container it starts is removed, also on failure or
SIGTERM. Needs only the standard library (it runs before any venv exists).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = ROOT / "src" / "amprl" / "configs" / "cartpole-dqn.yaml"
MIN_UID = 10000  # restricted PodSecurity and checkov's CKV_K8S_40
COMPILERS = ("gcc", "cc", "c++", "g++", "clang")
PARAMSERVER_PORT = 50052  # the chart's paramserver.port and pullPort
PULL_PORT = 50056

# What the chart's containerSecurityContext amounts to for podman. --read-only-tmpfs=false:
# podman would otherwise mount writable /tmp, /run and /var/tmp that a pod does not get.
SANDBOX = ("--read-only", "--read-only-tmpfs=false", "--cap-drop=ALL",
           "--security-opt=no-new-privileges", "--network=none")

# Runs inside the service container: who it runs as and where it may write.
PROBE = """
import json, os
def writable(path):
    try:
        with open(os.path.join(path, ".amprl-write-check"), "w") as f:
            f.write("x")
        os.remove(os.path.join(path, ".amprl-write-check"))
        return True
    except OSError as exc:
        return exc.strerror
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "cap_eff": status["CapEff"].strip(),
                  "no_new_privs": status["NoNewPrivs"].strip(),
                  "writable": {p: writable(p) for p in ("/", "/opt/venv", "/home/amprl",
                                                       "/tmp", "/var/lib/amprl")}}))
"""

# Runs in a container of its own: what build tools the image holds.
TOOLS = ("for t in " + " ".join(COMPILERS) + " pip pip3; do command -v $t; done; "
         "python -m pip --version 2>&1 | head -1")


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


class Checker:
    def __init__(self, podman: str, image: str, timeout_s: float):
        self.podman, self.image, self.timeout_s = podman, image, timeout_s
        self.checks: list[dict] = []
        self.containers: list[str] = []

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([self.podman, *args], capture_output=True, text=True, timeout=timeout)

    def record(self, name: str, ok: bool, detail) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def container_name(self, role: str) -> str:
        name = f"amprl-image-check-{role}-{os.getpid()}"
        self.containers.append(name)
        return name

    def cleanup(self) -> None:
        # A SIGTERM can land while `podman run` is still creating a container: try again
        # until none of ours exists.
        left = list(self.containers)
        for _ in range(5):
            for name in left:
                self.run("rm", "--force", "--time", "2", name, timeout=60)
            left = [n for n in left if self.run("container", "exists", n, timeout=30).returncode == 0]
            if not left:
                return
            time.sleep(1)
        print(f"check_image: could not remove {left}", file=sys.stderr)

    def inspect(self) -> dict:
        proc = self.run("image", "inspect", self.image)
        if proc.returncode != 0:
            raise SystemExit(f"check_image: {self.image} not found: {proc.stderr.strip()}")
        return json.loads(proc.stdout)[0]

    def check_labels(self, config: dict, version: str) -> None:
        labels = config.get("Labels") or {}
        want = {k: labels.get(f"org.opencontainers.image.{k}", "")
                for k in ("version", "revision", "licenses", "source")}
        self.record("labels", want["version"] == version and want["revision"] not in ("", "unknown")
                    and want["licenses"] and want["source"], {**want, "expected_version": version})

    def check_user(self, config: dict) -> None:
        uid = (config.get("User") or "").split(":")[0]
        self.record("user", uid.isdigit() and int(uid) >= MIN_UID, {"image_user": config.get("User")})

    def check_version(self, version: str) -> None:
        name = self.container_name("version")
        proc = self.run("run", "--rm", "--name", name, *SANDBOX, self.image, "--version")
        out = proc.stdout.strip()
        self.record("version", proc.returncode == 0 and out == f"amprl {version}",
                    {"output": out or proc.stderr.strip()[-500:]})

    def check_service(self, image: dict) -> None:
        """paramserver with the chart's env and mounts; healthy by the image's HEALTHCHECK."""
        # podman shows the HEALTHCHECK beside Config, docker inside it
        health = (image.get("Healthcheck") or image.get("Config", {}).get("Healthcheck") or {}).get("Test")
        if not self.record("healthcheck-defined", bool(health), {"test": health}):
            return
        name = self.container_name("paramserver")
        env = {"AMPRL_CONFIG": "/etc/amprl/experiment.yaml", "AMPRL_HOST": "0.0.0.0",
               "AMPRL_PORT": str(PARAMSERVER_PORT), "AMPRL_PULL_PORT": str(PULL_PORT),
               "AMPRL_RUN_DIR": "/var/lib/amprl", "HOME": "/tmp", "AMPRL_ID": name}
        start = self.run("run", "--detach", "--name", name, *SANDBOX,
                         "--tmpfs=/tmp:rw,size=256m,mode=1777",
                         "--tmpfs=/var/lib/amprl:rw,size=256m,mode=1777",
                         f"--volume={EXPERIMENT}:/etc/amprl/experiment.yaml:ro",
                         *[f"--env={k}={v}" for k, v in env.items()],
                         self.image, "paramserver")
        if not self.record("service-started", start.returncode == 0,
                           {"container": name} if start.returncode == 0 else start.stderr.strip()[-500:]):
            return
        began, attempts, last = time.monotonic(), 0, None
        while time.monotonic() - began < self.timeout_s:
            attempts += 1
            last = self.run("healthcheck", "run", name, timeout=60)
            if last.returncode == 0:
                break
            if self.run("container", "inspect", "--format", "{{.State.Running}}", name).stdout.strip() != "true":
                break
            time.sleep(1)
        healthy = last is not None and last.returncode == 0
        logs = self.run("logs", name)
        self.record("service-healthy", healthy, {
            "command": "amprl paramserver", "healthcheck": health,
            "seconds_to_healthy": round(time.monotonic() - began, 1), "attempts": attempts,
            **({} if healthy else {"logs": (logs.stdout + logs.stderr)[-2000:]})})
        if healthy:
            self.check_sandbox(name)

    def check_sandbox(self, name: str) -> None:
        proc = self.run("exec", name, "python", "-c", PROBE)
        if not self.record("sandbox-probe", proc.returncode == 0, proc.stderr.strip()[-500:]):
            return
        seen = json.loads(proc.stdout)
        writable = seen["writable"]
        self.record("runs-as-non-root", seen["uid"] >= MIN_UID and seen["gid"] >= MIN_UID,
                    {"uid": seen["uid"], "gid": seen["gid"]})
        self.record("no-capabilities", int(seen["cap_eff"], 16) == 0 and seen["no_new_privs"] == "1",
                    {"CapEff": seen["cap_eff"], "NoNewPrivs": seen["no_new_privs"]})
        # /home/amprl belongs to the service's user: only a read-only root refuses it.
        self.record("read-only-root", writable["/home/amprl"] == "Read-only file system"
                    and all(writable[p] is not True for p in ("/", "/opt/venv"))
                    and writable["/tmp"] is True and writable["/var/lib/amprl"] is True, writable)

    def check_no_tools(self) -> None:
        name = self.container_name("tools")
        proc = self.run("run", "--rm", "--name", name, *SANDBOX, "--entrypoint", "sh", self.image,
                        "-c", TOOLS)
        lines = proc.stdout.strip().splitlines()
        found = [ln for ln in lines[:-1] if ln.strip()]
        pip_module = lines[-1] if lines else ""
        self.record("no-compiler-no-pip", not found and re.search(r"No module named pip", pip_module) is not None,
                    {"on_path": found, "python -m pip": pip_module})


def main(argv: list[str] | None = None) -> int:
    version = pyproject_version()
    p = argparse.ArgumentParser(prog="docker/check_image.py", description=__doc__.split("\n\n")[0])
    p.add_argument("image", nargs="?", default=f"ghcr.io/amp-rl/amprl-cpu:{version}")
    p.add_argument("--podman", default="podman", help="the podman command (default: podman)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="how long the service may take to become healthy (default: 120)")
    args = p.parse_args(argv)

    # SIGTERM (make interrupted, a CI timeout) still removes the containers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    checker = Checker(args.podman, args.image, args.timeout_s)
    began = time.monotonic()
    try:
        image = checker.inspect()
        config = image.get("Config") or {}
        checker.check_labels(config, version)
        checker.check_user(config)
        checker.check_version(version)
        checker.check_no_tools()
        checker.check_service(image)
    finally:
        checker.cleanup()
    ok = all(c["ok"] for c in checker.checks)
    print(json.dumps({"image": args.image, "id": image["Id"][:12], "size_bytes": image.get("Size"),
                      "ok": ok, "seconds": round(time.monotonic() - began, 1),
                      "checks": checker.checks}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
