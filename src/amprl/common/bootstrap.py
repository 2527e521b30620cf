"""Start-up and shutdown shared by the five service processes (each ``__main__``).

Every service starts and stops the same way, so that the launcher and Kubernetes can treat
them alike; a ``__main__`` keeps only what is its own (its flags, its worker or servicer,
its readiness rule):

    proc = ServiceProcess("learner", __doc__)
    args = proc.parse(argv)                             # base flags + proc.parser's own
    cfg = proc.setup(require=("replay", "paramserver"))  # logging, config; bad: exit 2
    wait_for_dependencies(replay=cli.replay_addresses(args.replay), paramserver=args.paramserver)
    ...                                                 # build and start the worker
    proc.serve(register(learner), port=args.port)       # health, reflection, --port-file
    learner.on_replay = proc.set_ready                  # its own readiness rule
    return proc.run_until_stopped(learner.run, grace_s=2.0, on_stop=learner.stop)

A service that builds its own server (replay's ``grpc.aio`` one, the parameter server's
with its pull port) hands it over with ``proc.attach(server, port)`` instead of ``serve``.
Both take the service's ``Telemetry`` (``amprl.common.telemetry``; each service declares
its own in ``<service>/telemetry.py``): with it the process records as it serves, on
``/metrics`` when ``--metrics-port`` is not off (``amprl.common.metrics``) and in
``RUN_DIR/tb/<id>/`` when it has a ``--run-dir`` and ``--tensorboard`` is on
(``amprl.common.tensorboard``); both stop with the server.

On SIGTERM or SIGINT (Kubernetes' stop, Ctrl-C) health goes NOT_SERVING; with ``drain``
the server keeps serving ``--drain-s`` seconds more, so that readiness probes take it out
of rotation before it goes (a second signal cuts that short); then ``on_stop()`` and the
server's stop, with ``grace_s`` for the calls still open.
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

from amprl import errors
from amprl.common import certs, channels, cli, grpcutil
from amprl.common.metrics import MetricsServer
from amprl.common.telemetry import Telemetry
from amprl.common.supervise import ThreadDied
from amprl.config import ExperimentConfig

class Renewal(enum.Enum):
    """What a process does when its mounted certificate files change (cert-manager renewed
    them; the kubelet updates a mounted Secret in place)."""

    RELOAD = "reload"
    """Nothing: its server re-reads the files at the next handshake
    (``grpcutil.server_credentials``), and it dials no one (replay, the parameter server)."""
    RESTART = "restart"
    """Stop, as on SIGTERM, with status 0 so that Kubernetes starts it again with the new
    files: its client channels hold the old certificate until they are rebuilt (workers,
    followers)."""


RENEWAL_CHECK_S = 30.0
"""How often a ``Renewal.RESTART`` process compares its certificate files with those it
started with."""

DEPENDENCY_TIMEOUT_S = 120.0
"""How long a worker waits for each server it needs (replay, parameter server) to answer
SERVING at start-up: on a fresh cluster they are scheduled and started at the same time."""


def wait_for_dependencies(*, replay: Iterable[str] = (), paramserver: str = "") -> None:
    """Blocks until each replay shard and the parameter server answers its health check
    with SERVING; Unavailable after ``DEPENDENCY_TIMEOUT_S`` for one of them. (The role of
    each is what a mutual-TLS client checks the server's certificate for.)"""
    dependencies = [(a, "replay") for a in replay] + ([(paramserver, "paramserver")] if paramserver else [])
    for address, role in dependencies:
        channels.wait_until_serving(address, timeout_s=DEPENDENCY_TIMEOUT_S, server_role=role)


class ServiceProcess:
    """One service process: its flags and config, its gRPC server and its shutdown."""

    def __init__(self, name: str, description: str):
        self.name = name
        self.log = logging.getLogger(f"amprl.{name}")
        self.parser = cli.base_parser(f"amprl {name}", description)
        self.args = argparse.Namespace()
        self.server: Any = None  # a grpc.Server, or an AioServer (the same face)
        self.port = 0
        self._stop = threading.Event()
        self._again = threading.Event()  # a second signal: the drain ends early
        self.metrics: MetricsServer | None = None
        self.tensorboard: Any = None  # a TensorBoardWriter once recording (imported when needed)

    def parse(self, argv: list[str] | None) -> argparse.Namespace:
        """The base flags (``amprl.common.cli``) and those added to ``self.parser``."""
        self.args = self.parser.parse_args(argv)
        return self.args

    def setup(self, require: Iterable[str] = ()) -> ExperimentConfig:
        """Logging and the validated config; a bad config, or a missing address flag in
        ``require`` ("replay", "paramserver"), is one error log line and exit status 2."""
        cfg = cli.setup(self.args, self.name)
        missing = list(require)
        if not all(getattr(self.args, flag) for flag in missing):
            flags = " and ".join(f"--{flag}" for flag in missing)
            env = " / ".join(cli.ADDRESS_ENV[flag] for flag in missing)
            self.log.error("%s (or %s) %s required", flags, env, "are" if len(missing) > 1 else "is")
            raise SystemExit(2)
        return cfg

    def serve(self, register: Iterable[tuple[Callable, object, str]], port: int,
              telemetry: Telemetry | None = None) -> None:
        """Starts this process's server for ``register``'s servicers (see
        ``grpcutil.create_server``: health SERVING, reflection) on ``--host``:``port``."""
        server, bound = grpcutil.create_server(register, host=self.args.host, port=port)
        self.attach(server, bound, telemetry)

    def attach(self, server: Any, port: int, telemetry: Telemetry | None = None) -> None:
        """Makes ``server``, started on ``port``, this process's server, starts recording
        ``telemetry`` (module docstring) and writes the port to ``--port-file`` (a launcher
        waits for that file, and finds ``--metrics-port-file`` written by then)."""
        self.server, self.port = server, port
        self._record(telemetry)
        cli.write_port_file(self.args.port_file, port)

    @property
    def instance(self) -> str:
        """This process among its service's: ``--id`` / AMPRL_ID when given ("actor-3", a
        pod name), else the service's name ("replay"), not the host's."""
        given = os.environ.get("AMPRL_ID") or self.args.id != self.parser.get_default("id")
        return str(self.args.id) if given and self.args.id else self.name

    def _record(self, telemetry: Telemetry | None) -> None:
        args = self.args
        if getattr(args, "metrics_port", "off") != "off":
            try:
                self.metrics = MetricsServer.start(telemetry, host=args.host, port=args.metrics_port,
                                                   instance=self.instance)
            except OSError as exc:  # a port in use: the deployment's mistake, one line
                self.log.error("--metrics-port %s (AMPRL_METRICS_PORT): cannot serve /metrics on "
                               "%s: %s", args.metrics_port, args.host, exc.strerror or exc)
                self.server.stop(0)
                raise SystemExit(2) from None
            cli.write_port_file(args.metrics_port_file, self.metrics.port)
        if telemetry is not None and args.run_dir and getattr(args, "tensorboard", "on") == "on":
            from amprl.common import tensorboard
            folder = tensorboard.run_folder(args.run_dir, self.instance)
            self.tensorboard = tensorboard.TensorBoardWriter(telemetry, folder).start()

    def record_now(self) -> None:
        """Writes the series to TensorBoard now (the evaluator, after each evaluation);
        nothing without a run folder."""
        if self.tensorboard is not None:
            self.tensorboard.write()

    def set_ready(self, ready: bool) -> None:
        """Readiness of a server from ``serve``: SERVING or NOT_SERVING (no effect once
        shutdown has begun)."""
        grpcutil.set_health(self.server, serving=ready)

    def run_until_stopped(self, run: Callable[[threading.Event], None] | None = None, *,
                          grace_s: float, drain: bool = False,
                          on_stop: Callable[[], None] | None = None,
                          renewal: Renewal = Renewal.RESTART) -> int:
        """Serves until SIGTERM or SIGINT, running ``run(stop)`` meanwhile (a worker's loop,
        which returns once ``stop`` is set), then shuts down (module docstring); with TLS on
        and ``Renewal.RESTART``, also when the certificate files change. Returns the exit
        status: 0, or 1 when ``run`` raised ThreadDied (a supervised background thread
        died), so that Kubernetes restarts the pod."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        cert_dir = grpcutil.tls_cert_dir()
        if cert_dir is not None and renewal is Renewal.RESTART:
            threading.Thread(target=self._watch_certificates, args=(cert_dir,), daemon=True,
                             name="certificate-watch").start()
        status = 0
        try:
            if run is None:
                self._stop.wait()
            else:
                run(self._stop)
        except ThreadDied as exc:
            self.log.error("%s: exiting so that the pod is restarted", exc)
            status = 1
        finally:
            self._shut_down(grace_s, self.args.drain_s if drain else 0.0, on_stop)
        return status

    def _watch_certificates(self, cert_dir: Path) -> None:
        started_with = grpcutil.read_tls_files(cert_dir)
        while not self._stop.wait(RENEWAL_CHECK_S):
            try:
                now = grpcutil.read_tls_files(cert_dir)
            except errors.ConfigError:
                continue  # caught half-way through the kubelet's swap: look again later
            if now != started_with and certs.role_of_pem(now[1]) is not None:
                self.log.info("the certificate in %s was renewed: stopping so that this "
                              "process starts again with it", cert_dir)
                self._stop.set()
                return

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.log.info("signal %d: stopping", signum)
        if self._stop.is_set():
            self._again.set()
        self._stop.set()

    def _shut_down(self, grace_s: float, drain_s: float, on_stop: Callable[[], None] | None) -> None:
        self.server.health_servicer.enter_graceful_shutdown()
        if drain_s > 0:
            self.log.info("NOT_SERVING: draining for %.0f s before stopping", drain_s)
            self._again.wait(drain_s)
        if on_stop is not None:
            on_stop()
        self.server.stop(grace_s).wait()
        if self.tensorboard is not None:
            self.tensorboard.close()  # the last point, once the worker has stopped
        if self.metrics is not None:
            self.metrics.stop()
