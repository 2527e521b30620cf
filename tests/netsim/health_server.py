"""Test helper: a gRPC server with only the health service, bound to --host:--port.

Prints {"event": "serving", "port": N} once started. Each stdin line (SERVING or
NOT_SERVING) sets the status of the service "amprl.test"; "" is always SERVING.
"""

import argparse
import json
import sys
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("amprl.test", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(json.dumps({"event": "serving", "port": port}), flush=True)
    for line in sys.stdin:
        status = health_pb2.HealthCheckResponse.ServingStatus.Value(line.strip())
        servicer.set("amprl.test", status)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
