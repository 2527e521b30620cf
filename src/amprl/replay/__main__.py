"""The replay service process: ``python -m amprl.replay`` / ``amprl replay``.

Builds the EnvSpec from the config's env, opens the table in Redis (``--redis-url``, or an
embedded redis-server in ``<run-dir>/redis`` when none is given, with random passwords and
the replay ACL user of ``amprl.common.redis_acl``), serves until SIGTERM.

Besides the base flags (``amprl.common.cli``; the Redis user, password and TLS come from
AMPRL_REDIS_USERNAME, AMPRL_REDIS_PASSWORD_FILE and AMPRL_REDIS_TLS_CA_FILE):

  --prefix P          AMPRL_REDIS_PREFIX    the table's key prefix (amprl:replay:default)
  --live-window-s S   AMPRL_LIVE_WINDOW_S   Info's actors_live window (default 60)
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import tempfile
from pathlib import Path

import numpy as np

from amprl.common import cli
from amprl.common.bootstrap import Renewal, ServiceProcess
from amprl.common.redis_acl import REPLAY_PREFIX, REPLAY_USER, RedisUser
from amprl.common.redis_server import EmbeddedRedis
from amprl.envs.factory import env_spec
from amprl.envs.spec import EnvSpec
from amprl.errors import ConfigError
from amprl.replay.service import create_server
from amprl.replay.telemetry import telemetry
from amprl.replay.actors import LIVE_WINDOW_S

log = logging.getLogger("amprl.replay")


def spec_from_json(text: str) -> EnvSpec:
    d = json.loads(text)
    try:
        return EnvSpec(frame_shape=tuple(d["frame_shape"]), frame_dtype=np.dtype(d["frame_dtype"]),
                       frame_stack=int(d.get("frame_stack", 1)), discrete=bool(d["discrete"]),
                       num_actions=int(d.get("num_actions", 0)),
                       action_dim=int(d.get("action_dim", 0)))
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"--spec-json: {exc}; expected frame_shape, frame_dtype, discrete, ...") from None


def main(argv: list[str] | None = None) -> int:
    proc = ServiceProcess("replay", "Prioritized replay service (gRPC) backed by Redis.")
    parser = proc.parser
    parser.add_argument("--prefix", default=os.environ.get("AMPRL_REDIS_PREFIX") or REPLAY_PREFIX,
                        help="Redis key prefix of the table (one per shard sharing a Redis); "
                             "the replay ACL user may touch only '<prefix>:*'")
    parser.add_argument("--seed", type=int, default=None, help="sampling RNG seed")
    parser.add_argument("--spec-json", default="",
                        help="EnvSpec fields as JSON (frame_shape, frame_dtype, frame_stack, "
                             "discrete, num_actions, action_dim) instead of building cfg.env; "
                             "for benchmarks and replay hosts without the env's suite")
    parser.add_argument("--live-window-s", type=float,
                        default=float(os.environ.get("AMPRL_LIVE_WINDOW_S") or LIVE_WINDOW_S),
                        help="an actor counts as live in Info if it inserted within this many seconds")
    args = proc.parse(argv)
    cfg = proc.setup()
    if args.live_window_s <= 0:
        parser.error(f"--live-window-s {args.live_window_s}: must be > 0")
    spec = spec_from_json(args.spec_json) if args.spec_json else env_spec(cfg.env)
    port = args.port or cfg.replay.port
    redis_url = cli.redis_connection_url(args.redis_url or cfg.replay.redis_url)
    embedded = None
    if not redis_url:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="amprl-replay-"))
        user = RedisUser(REPLAY_USER, secrets.token_urlsafe(24), args.prefix)
        embedded = EmbeddedRedis(run_dir / "redis", users=[user],
                                 appendfsync=cfg.replay.durability)
        redis_url = embedded.user_url()
    try:
        replay = create_server(cfg, spec, redis_url, args.host, port, seed=args.seed,
                               prefix=args.prefix, live_window_s=args.live_window_s)
        proc.attach(replay.server, replay.port, telemetry(replay))
        log.info("replay ready on port %d (redis %s)", replay.port, redis_url.split("@")[-1])
        try:
            # replay dials no one over gRPC: its server re-reads a renewed certificate in place
            return proc.run_until_stopped(grace_s=5.0, drain=True, renewal=Renewal.RELOAD)
        finally:
            replay.table.storage.close()
    finally:
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    raise SystemExit(main())
