"""The replay ACL rule as text (amprl.common.redis_acl); tests/integration/replay runs it on
a real redis-server."""

from __future__ import annotations

import hashlib

import pytest

from amprl.common.redis_acl import REPLAY_COMMANDS, RedisUser, acl_lines, replay_rule
from amprl.errors import ConfigError


def test_the_rule_allows_the_prefix_no_channel_and_only_replays_commands():
    rule = RedisUser("amprl-replay", "pw", "amprl:replay:default").rule()
    sha = hashlib.sha256(b"pw").hexdigest()
    assert rule == (f"on #{sha} ~amprl:replay:default:* resetchannels -@all "
                    + " ".join("+" + c for c in REPLAY_COMMANDS))
    assert "pw" not in rule.replace(sha, "")


def test_no_dangerous_command_is_on_the_list():
    for command in ("flushall", "flushdb", "config", "debug", "keys", "scan", "shutdown", "acl",
                    "module", "eval", "script", "script|flush", "monitor", "client", "select"):
        assert command not in REPLAY_COMMANDS


@pytest.mark.parametrize("prefix", ["", "amprl:*", "a?b", "a[b]", "a b", "a\\b", "x" * 129])
def test_a_prefix_that_could_widen_the_key_pattern_is_refused(prefix):
    with pytest.raises(ConfigError, match="key prefix"):
        replay_rule("#00", prefix)


@pytest.mark.parametrize("name", ["", "default", "a b", "a>b"])
def test_a_user_name_that_is_not_plain_or_is_the_admin_is_refused(name):
    with pytest.raises(ConfigError, match="user name"):
        RedisUser(name, "pw")


def test_the_default_user_is_the_admin_behind_its_password_or_off():
    user = RedisUser("amprl-replay", "pw")
    on, replay = acl_lines("admin-pw", [user])
    assert on == f"user default on #{hashlib.sha256(b'admin-pw').hexdigest()} ~* &* +@all"
    assert replay == f"user amprl-replay {user.rule()}"
    assert acl_lines("", [user])[0].startswith("user default off ")
