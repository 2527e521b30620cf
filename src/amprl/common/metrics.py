"""``/metrics`` for Prometheus: a process's series (``amprl.common.telemetry``), its RPCs
(``amprl.common.rpcmetrics``) and its CPU and memory, on a plain-HTTP port of its own.

    server = MetricsServer.start(telemetry, host="0.0.0.0", port=9090, instance="learner-0")
    server.port         # the bound port (with port "any")
    server.stop()

The port is plain HTTP even when gRPC speaks mutual TLS (AMPRL_TLS_CERT_DIR): the usual
Prometheus practice, as a scraper holds no AMP-RL role certificate. It serves read-only
training figures; on Kubernetes the NetworkPolicy admits only the scraper to it
(docs/kubernetes.md, "Metrics").

Where it listens is the process's ``--metrics-port`` / AMPRL_METRICS_PORT (``parse_port``):
``off`` (the default: no server), ``any`` (a free port, written to ``--metrics-port-file``
for a launcher, as ``amprl run`` does) or a port number (the chart's ``metrics.port``).
"""

from __future__ import annotations

import logging
from typing import Literal

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from amprl.common.rpcmetrics import RPC_METRICS
from amprl.common.telemetry import Telemetry, prometheus_name

log = logging.getLogger(__name__)

MetricsPort = Literal["off", "any"] | int
"""``off``: no ``/metrics``; ``any``: any free port; a number: that port."""

PORT_ENV = "AMPRL_METRICS_PORT"


def parse_port(text: str) -> MetricsPort:
    """``--metrics-port``'s value: "off", "any" or a port number 1-65535; ValueError naming
    the choices otherwise."""
    word = text.strip().lower()
    if word in ("off", "any"):
        return word  # type: ignore[return-value]  # one of the two literals
    if word.isdigit() and 1 <= int(word) <= 65535:
        return int(word)
    raise ValueError(f"metrics port {text!r}: off (no /metrics), any (a free port) or a port number 1-65535")


class TelemetryCollector(Collector):
    """A service's ``Telemetry`` as Prometheus families, read at each scrape, plus
    ``amprl_service_info{service, id}`` (1), which names the process."""

    def __init__(self, telemetry: Telemetry, instance: str):
        self.telemetry = telemetry
        self.instance = instance
        self._failing = False

    def describe(self):
        """The families' names without reading the service (what registration checks)."""
        yield InfoMetricFamily("amprl_service", "The AMP-RL service this process is.")
        for s in self.telemetry.series:
            family = CounterMetricFamily if s.kind.counts else GaugeMetricFamily
            yield family(prometheus_name(self.telemetry.service, s), s.help,
                         labels=[s.label] if s.label else None)

    def collect(self):
        t = self.telemetry
        info = InfoMetricFamily("amprl_service", "The AMP-RL service this process is.")
        info.add_metric([], {"service": t.service, "id": self.instance})
        yield info
        try:
            reading = t.read()
        except Exception:  # noqa: BLE001 - the scrape still gets the RPC and process series
            if not self._failing:
                log.exception("metrics: reading the %s series failed", t.service)
            self._failing = True
            return
        if t.errors and not self._failing:
            log.warning("metrics: some %s series could not be read: %s", t.service, "; ".join(t.errors))
        self._failing = bool(t.errors)
        for s, values in reading.values:
            family = CounterMetricFamily if s.kind.counts else GaugeMetricFamily
            metric = family(prometheus_name(t.service, s), s.help, labels=[s.label] if s.label else None)
            for key, value in values.items():
                metric.add_metric([key] if s.label else [], value)
            yield metric


def registry_for(telemetry: Telemetry | None, instance: str) -> CollectorRegistry:
    """A registry of the service's series (if any), the process's RPCs and its CPU, memory
    and open files (``process_*``)."""
    registry = CollectorRegistry()
    if telemetry is not None:
        registry.register(TelemetryCollector(telemetry, instance))
    registry.register(RPC_METRICS)
    ProcessCollector(registry=registry)
    return registry


class MetricsServer:
    """A started ``/metrics`` HTTP server (prometheus_client's, on a thread of its own)."""

    def __init__(self, httpd, port: int):
        self._httpd = httpd
        self.port = port

    @classmethod
    def start(cls, telemetry: Telemetry | None, *, host: str, port: MetricsPort,
              instance: str) -> "MetricsServer":
        """Serves ``registry_for(telemetry, instance)`` on ``host:port`` (``any``: a free
        one); OSError if the port cannot be bound."""
        if port == "off":
            raise ValueError("metrics port off: nothing to start")
        httpd, _thread = start_http_server(0 if port == "any" else int(port), addr=host,
                                           registry=registry_for(telemetry, instance))
        server = cls(httpd, int(httpd.server_port))
        log.info("serving /metrics on %s:%d (plain HTTP)", host, server.port)
        return server

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
