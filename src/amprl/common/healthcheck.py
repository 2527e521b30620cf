"""Container health probe: asks ``grpc.health.v1.Health`` on this container's own port.

The images' ``HEALTHCHECK`` runs it, and so do the chart's probes when TLS is on (the
kubelet's native gRPC probe speaks plaintext only). Exit status 0 means SERVING, 1 means
anything else (not listening, NOT_SERVING, timeout, TLS failure), with the reason on stderr.

  python -m amprl.common.healthcheck [--port PORT] [--service NAME] [--timeout-s S]

Environment (the same variables the services read):
  AMPRL_PORT             the port to ask (flag --port wins)
  AMPRL_TLS_CERT_DIR     when set, connect with mutual TLS: present this container's own
                         certificate, trust ``ca.crt``, expect the server of the same role
  AMPRL_TLS_SERVER_NAME  the deployment's server name (default: amprl)

Only grpc, the health stubs and ``amprl.common.grpcutil`` are imported, never torch, so a probe costs well under a
second of CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from amprl import errors
from amprl.common import grpcutil
from amprl.common.channels import make_channel


def _channel(address: str) -> grpc.Channel:
    # The probe runs in the server's own container with its certificate: with TLS on it
    # presents it and expects the server to be of the same role.
    role = grpcutil.own_role() if grpcutil.tls_cert_dir() is not None else None
    return make_channel(address, server_role=role)


def check(port: int, service: str = "", timeout_s: float = 3.0, host: str = "127.0.0.1") -> str:
    """Returns "" when ``host:port`` reports SERVING for ``service``, else the reason."""
    try:
        with _channel(f"{host}:{port}") as channel:
            # types-grpcio-health-checking's HealthStub lacks the generated methods
            response = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except (errors.AmprlError, grpc.RpcError, OSError, ValueError) as exc:
        rpc = exc if isinstance(exc, grpc.RpcError) else exc.__cause__
        if isinstance(rpc, grpc.RpcError):  # the call failed (mapped or not)
            return f"{host}:{port}: {rpc.code().name}: {rpc.details()}"
        return f"TLS setup: {exc}"  # unreadable ca.crt
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{host}:{port}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m amprl.common.healthcheck",
                                description="exit 0 when the local gRPC server is SERVING")
    p.add_argument("--port", type=int, default=int(os.environ.get("AMPRL_PORT", "0") or 0))
    p.add_argument("--service", default="", help='health service name ("" = the whole server)')
    p.add_argument("--timeout-s", type=float, default=3.0)
    args = p.parse_args(argv)
    if args.port <= 0:
        print("healthcheck: no port (set AMPRL_PORT or pass --port)", file=sys.stderr)
        return 1
    reason = check(args.port, args.service, args.timeout_s)
    if reason:
        print(f"healthcheck: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
