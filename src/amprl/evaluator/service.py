"""EvaluatorService: the history of evaluations."""

from __future__ import annotations

from amprl.common.grpcutil import map_errors
from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc


class EvaluatorServicer(telemetry_pb2_grpc.EvaluatorServiceServicer):
    def __init__(self, evaluator):
        self.evaluator = evaluator

    @map_errors
    def Info(self, request, context):
        with self.evaluator._lock:
            return telemetry_pb2.EvaluatorServiceInfoResponse(evaluations=list(self.evaluator.evaluations))


def register(evaluator):
    return [(telemetry_pb2_grpc.add_EvaluatorServiceServicer_to_server, EvaluatorServicer(evaluator),
             "amprl.v1.EvaluatorService")]
