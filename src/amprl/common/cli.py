"""Flag and environment parsing shared by every service's ``__main__``.

Each service accepts the same base flags; on Kubernetes the same values come from the
environment (a flag wins over its variable):

  --config PATH        AMPRL_CONFIG              experiment YAML (the ConfigMap)
  --set KEY=VALUE      AMPRL_SET (";"-separated)  config overrides, repeatable
  --host HOST          AMPRL_HOST                listen address (default 0.0.0.0)
  --port PORT          AMPRL_PORT                listen port (0 = any free port)
  --replay ADDR        AMPRL_REPLAY_ADDRESS      replay service host:port; with several
                                                 shards, every shard's, comma-separated
  --paramserver ADDR   AMPRL_PARAMSERVER_ADDRESS parameter server host:port
  --evaluator ADDR     AMPRL_EVALUATOR_ADDRESS   evaluator host:port: actors and learners
                                                 stop and idle when it says the run ended
  --redis-url URL      AMPRL_REDIS_URL           redis://[user:password@]host:port/db
                                                 (rediss:// for TLS)
                       AMPRL_REDIS_USERNAME      the ACL user replay connects as
                       AMPRL_REDIS_PASSWORD_FILE file holding the password (a mounted Secret)
                       AMPRL_REDIS_PASSWORD      password, if not in the URL nor in a file
                       AMPRL_REDIS_TLS_CA_FILE   TLS to Redis, whose certificate must chain
                                                 to this CA (PEM)
  --id NAME            AMPRL_ID / HOSTNAME       identity (actor id; the pod name on k8s)
  --run-dir DIR        AMPRL_RUN_DIR             run folder (checkpoints, logs, eval history)
  --port-file PATH                               write the bound port here once serving
  --log-format F       AMPRL_LOG_FORMAT          text (default) or json: one object per line
  --drain-s S          AMPRL_DRAIN_S             servers: NOT_SERVING for S seconds after
                                                 SIGTERM, then stop (default 0)
  --metrics-port P     AMPRL_METRICS_PORT        /metrics for Prometheus (amprl.common.metrics):
                                                 off (default), any (a free port) or a number
  --metrics-port-file PATH                       write the bound metrics port here
  --tensorboard M      AMPRL_TENSORBOARD         on (default): event files in RUN_DIR/tb/<id>
                                                 when there is a --run-dir; off: none
                       AMPRL_TLS_CERT_DIR        TLS on every server and client (see
                       AMPRL_TLS_SERVER_NAME     amprl.common.grpcutil)
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from amprl.common import metrics
from amprl.config import ExperimentConfig, load_config
from amprl.errors import ConfigError


ADDRESS_ENV = {"replay": "AMPRL_REPLAY_ADDRESS", "paramserver": "AMPRL_PARAMSERVER_ADDRESS",
               "evaluator": "AMPRL_EVALUATOR_ADDRESS"}
"""The variable that stands in for each address flag (``--replay``, ``--paramserver``,
``--evaluator``)."""


def base_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    env = os.environ.get
    p.add_argument("--config", default=env("AMPRL_CONFIG"), help="experiment YAML")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE",
                   default=[s for s in env("AMPRL_SET", "").split(";") if s],
                   help="config override, e.g. learner.batch_size=64 (repeatable)")
    p.add_argument("--host", default=env("AMPRL_HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(env("AMPRL_PORT", "0")))
    p.add_argument("--replay", default=env(ADDRESS_ENV["replay"], ""), help="replay host:port")
    p.add_argument("--paramserver", default=env(ADDRESS_ENV["paramserver"], ""),
                   help="parameter server host:port")
    p.add_argument("--evaluator", default=env(ADDRESS_ENV["evaluator"], ""),
                   help="evaluator host:port (actors, learners: they stop when the run ends)")
    p.add_argument("--redis-url", default=env("AMPRL_REDIS_URL", ""))
    p.add_argument("--id", default=env("AMPRL_ID") or env("HOSTNAME") or socket.gethostname())
    p.add_argument("--run-dir", default=env("AMPRL_RUN_DIR", ""))
    p.add_argument("--port-file", default="", help="write the bound port to this file")
    p.add_argument("--log-level", default=env("AMPRL_LOG_LEVEL", "INFO"))
    p.add_argument("--log-format", choices=("text", "json"), default=env("AMPRL_LOG_FORMAT", "text"),
                   help="text lines, or one JSON object per line (for log collectors)")
    p.add_argument("--drain-s", type=float, default=float(env("AMPRL_DRAIN_S") or 0),
                   help="servers: seconds of NOT_SERVING after SIGTERM before stopping")
    p.add_argument("--metrics-port", type=_metrics_port, default=env(metrics.PORT_ENV) or "off",
                   metavar="off|any|PORT",
                   help="serve /metrics (Prometheus, plain HTTP) on this port: off (default), "
                        "any (a free port, see --metrics-port-file) or a port number")
    p.add_argument("--metrics-port-file", default="", help="write the bound metrics port to this file")
    p.add_argument("--tensorboard", choices=("on", "off"), default=env("AMPRL_TENSORBOARD") or "on",
                   help="on: write TensorBoard event files to RUN_DIR/tb/<id> when there is a "
                        "--run-dir (default); off: none (the chart: pods' run folders are small)")
    return p


def _metrics_port(text: str) -> metrics.MetricsPort:
    try:
        return metrics.parse_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def redis_password() -> str:
    """The Redis password: the file named by AMPRL_REDIS_PASSWORD_FILE (a Secret mounted as
    a file, so it never shows in the pod spec or ``/proc/<pid>/environ``), else
    AMPRL_REDIS_PASSWORD, else ""."""
    path = os.environ.get("AMPRL_REDIS_PASSWORD_FILE", "")
    if path:
        try:
            # Secrets written by hand often end with a newline that is not part of it.
            return Path(path).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"AMPRL_REDIS_PASSWORD_FILE={path}: {exc.strerror}") from None
    return os.environ.get("AMPRL_REDIS_PASSWORD", "")


def redis_connection_url(url: str) -> str:
    """``url`` completed from the environment: the ACL user (AMPRL_REDIS_USERNAME) and its
    password (``redis_password``) where the URL carries no credentials, percent-encoded so
    "@", ":" or "/" cannot break it (redis-py decodes them); TLS where
    AMPRL_REDIS_TLS_CA_FILE names a CA: the scheme becomes ``rediss`` and Redis's
    certificate must chain to that CA and name the host."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return url
    scheme, netloc, query = parts.scheme, parts.netloc, parts.query
    username = os.environ.get("AMPRL_REDIS_USERNAME", "")
    password = redis_password()
    if "@" not in netloc and (username or password):
        netloc = f"{quote(username, safe='')}:{quote(password, safe='')}@{netloc}"
    ca_file = os.environ.get("AMPRL_REDIS_TLS_CA_FILE", "")
    if ca_file:
        if not Path(ca_file).is_file():
            raise ConfigError(f"AMPRL_REDIS_TLS_CA_FILE={ca_file}: no such file")
        scheme = "rediss"
        query = "&".join(q for q in (query, "ssl_cert_reqs=required",
                                     "ssl_ca_certs=" + quote(ca_file, safe="/")) if q)
    return urlunsplit((scheme, netloc, parts.path, query, parts.fragment))


def replay_addresses(value: str) -> list[str]:
    """The replay shards' addresses from ``--replay`` / AMPRL_REPLAY_ADDRESS (comma list)."""
    return [a.strip() for a in value.split(",") if a.strip()]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC), service, level, logger, message, and
    the traceback as ``exception`` when there is one."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds"),
               "service": self.service, "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(args: argparse.Namespace, name: str) -> ExperimentConfig:
    """Logging (``--log-format``: text or JSON lines) + the validated config of a service
    process; a bad config is logged and ends the process with status 2."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(name) if args.log_format == "json" else logging.Formatter(
        f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:  # a log line naming the key (JSON too), not a traceback
        logging.getLogger(f"amprl.{name}").error("config error: %s", exc)
        raise SystemExit(2) from None


def write_port_file(path: str, port: int) -> None:
    """Atomically writes the bound port so a launcher can read it once it exists."""
    if not path:
        return
    tmp = Path(path + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(path)
