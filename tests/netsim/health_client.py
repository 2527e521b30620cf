"""Test helper: calls grpc.health.v1.Health at --target and prints JSON lines.

--mode unary: --count Check calls, then {"event": "unary", "statuses": [...], "latency_ms": [...]}.
--mode watch: one {"event": "update", "status": ...} per streamed response, then
{"event": "end", "code": "OK" | status code name, "details": ...} when the stream ends.
"""

import argparse
import json
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.enable_retries", 0)]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--mode", choices=["unary", "watch"], required=True)
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--service", default="")
    args = p.parse_args()
    with grpc.insecure_channel(args.target, options=_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=args.service)
        if args.mode == "unary":
            statuses, latency_ms = [], []
            for _ in range(args.count):
                t = time.perf_counter()
                reply = stub.Check(request, timeout=10, wait_for_ready=True)
                latency_ms.append((time.perf_counter() - t) * 1e3)
                statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            emit(event="unary", statuses=statuses, latency_ms=latency_ms)
            return
        try:
            for reply in stub.Watch(request, timeout=60, wait_for_ready=True):
                emit(event="update",
                     status=health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            emit(event="end", code="OK", details="")
        except grpc.RpcError as e:
            emit(event="end", code=e.code().name, details=e.details())


if __name__ == "__main__":
    main()
