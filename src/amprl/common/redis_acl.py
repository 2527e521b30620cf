"""Who may do what in replay's Redis: the ACL user replay connects as, and the admin.

Replay connects as its own ACL user (``amprl-replay`` unless renamed) that may touch only
the keys of its table (``<prefix>:*``; ``replay/storage.py`` keeps every key there), no
pub/sub channel, and only the commands replay sends (``REPLAY_COMMANDS``). Everything else
is refused with NOPERM: FLUSHALL, CONFIG (whose GET would show the admin password), DEBUG,
KEYS, SHUTDOWN, ACL, MODULE, a key of another table. A leaked replay password, or a bug in
replay, can then touch that table and nothing more of the server.

The ``default`` user is the admin: it keeps every right behind a password that replay never
gets (``amprl run`` keeps it in its own memory; the chart keeps it in a Secret key mounted
only in the Redis pod), or it is off.

Passwords are written as SHA-256 hashes (``#<hex>``), so the configuration that holds the
rules holds no password. The same rule is written by the embedded Redis of ``amprl run``
(``amprl.common.redis_server``) and by the chart's Redis pods
(``charts/amprl/templates/redis/configmap.yaml``; a chart test checks the two agree).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from amprl.errors import ConfigError

REPLAY_USER = "amprl-replay"
"""The replay user's name unless configured (AMPRL_REDIS_USERNAME, chart redis.auth.username)."""

REPLAY_PREFIX = "amprl:replay:default"
"""The replay table's key prefix unless configured (``--prefix``, AMPRL_REDIS_PREFIX)."""

REPLAY_COMMANDS = (
    # the table's keys (replay/storage.py)
    "get", "set", "setrange", "del", "hget", "hgetall", "hset", "hdel", "hexists",
    # every insert and priority update is one MULTI/EXEC
    "multi", "exec",
    # the priority scatter script; redis-py loads it when Redis does not know it. Its own
    # SETRANGE calls are checked against this list and the key pattern too.
    "evalsha", "script|load", "script|exists",
    # Info's memory figure and the run id that tells a restarted Redis; PING: the health
    # check of idle connections and the pods' probes
    "info", "ping",
)
"""Exactly the commands replay sends; the tests run replay against a user allowed only
these, so a command added to storage.py without being added here fails them."""

_PREFIX = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_USER = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class RedisUser:
    """An ACL user limited to ``REPLAY_COMMANDS`` on the keys under ``prefix``."""

    name: str
    password: str
    prefix: str = REPLAY_PREFIX
    """Keys it may touch: ``<prefix>:*`` (a table with this prefix, or tables whose
    prefixes start with ``<prefix>:``)."""

    def __post_init__(self) -> None:
        check_username(self.name)
        check_prefix(self.prefix)
        if not self.password:
            raise ConfigError(f"Redis user {self.name}: an empty password")

    def rule(self) -> str:
        """Its ACL rule, as ``ACL SETUSER`` and an ACL file take it."""
        return replay_rule(password_hash(self.password), self.prefix)


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a plain key prefix (letters, digits, ``_ . : -``, at most 128):
    no glob character can widen the ACL key pattern built from it."""
    if not _PREFIX.fullmatch(prefix):
        raise ConfigError(f"Redis key prefix {prefix!r}: use 1 to 128 letters, digits or "
                          f"'_.:-' (it becomes the ACL key pattern '<prefix>:*')")
    return prefix


def check_username(name: str) -> str:
    """``name`` if it is a plain ACL user name (letters, digits, ``_ . -``, at most 64)."""
    if not _USER.fullmatch(name) or name == "default":
        raise ConfigError(f"Redis user name {name!r}: use 1 to 64 letters, digits or '_.-', "
                          f"and not 'default' (the admin)")
    return name


def password_hash(password: str) -> str:
    """The ``#<sha256 hex>`` form of a password in an ACL rule."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def replay_rule(password_hash: str, prefix: str) -> str:
    """``on #<hash> ~<prefix>:* resetchannels -@all +<each of REPLAY_COMMANDS>``."""
    commands = " ".join(f"+{c}" for c in REPLAY_COMMANDS)
    return f"on {password_hash} ~{check_prefix(prefix)}:* resetchannels -@all {commands}"


def acl_lines(admin_password: str, users: tuple[RedisUser, ...] | list[RedisUser]) -> list[str]:
    """``user`` lines for a redis.conf or an ACL file: the ``default`` user with every
    right behind ``admin_password`` (off when it is ""), then each of ``users``. Written
    in full, because a configuration that names no ``default`` user leaves it open."""
    default = (f"user default on {password_hash(admin_password)} ~* &* +@all" if admin_password
               else "user default off resetpass resetkeys resetchannels -@all")
    return [default, *(f"user {u.name} {u.rule()}" for u in users)]
