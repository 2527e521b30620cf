"""EvaluatorService: the history of evaluations, the run's state and the best weights."""

from __future__ import annotations

from typing import Iterator

from amprl.common.grpcutil import map_errors
from amprl.errors import NotFound
from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc
from amprl.wire.compressed import encode

POLICY_CHUNK_BYTES = 4 * 1024 * 1024
"""Parameter bytes per GetBestPolicy message (well under any message-size limit; one
larger tensor goes alone)."""


class EvaluatorServicer(telemetry_pb2_grpc.EvaluatorServiceServicer):
    def __init__(self, evaluator):
        self.evaluator = evaluator

    @map_errors
    def Info(self, request, context):
        ev = self.evaluator
        with ev._lock:
            evaluations = list(ev.evaluations)
        return telemetry_pb2.EvaluatorServiceInfoResponse(
            evaluations=evaluations, run_state=ev.verdict.state(), summary_json=ev.verdict.summary_json())

    @map_errors
    def GetRunState(self, request, context):
        return telemetry_pb2.GetRunStateResponse(run_state=self.evaluator.verdict.state())

    @map_errors
    def GetBestPolicy(self, request, context) -> Iterator[telemetry_pb2.GetBestPolicyResponse]:
        best = self.evaluator.best_policy()
        if best is None:
            raise NotFound("no best weights yet: the evaluator keeps them in its run folder "
                           "(--run-dir / AMPRL_RUN_DIR) from its first evaluation on")
        evaluation, config_yaml, weights = best
        reply = telemetry_pb2.GetBestPolicyResponse(evaluation=evaluation, config_yaml=config_yaml)
        size = 0
        for name, tensor in weights.items():
            message = encode(name, tensor.float(), "fp32")
            n = message.ByteSize()
            if reply.parameters and size + n > POLICY_CHUNK_BYTES:
                yield reply
                reply, size = telemetry_pb2.GetBestPolicyResponse(), 0
            reply.parameters.append(message)
            size += n
        reply.last = True
        yield reply


def register(evaluator):
    return [(telemetry_pb2_grpc.add_EvaluatorServiceServicer_to_server, EvaluatorServicer(evaluator),
             "amprl.v1.EvaluatorService")]
