"""LearnerService: read-only status of a learner (its work is done by the loop)."""

from __future__ import annotations

from amprl.common.grpcutil import map_errors
from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc


class LearnerServicer(telemetry_pb2_grpc.LearnerServiceServicer):
    def __init__(self, learner):
        self.learner = learner

    @map_errors
    def Info(self, request, context):
        s, lr = self.learner.stats, self.learner
        return telemetry_pb2.LearnerServiceInfoResponse(
            updates=s.updates, skipped_nonfinite=s.skipped_nonfinite, loss=s.loss, q_mean=s.q_mean,
            grad_norm=s.grad_norm, param_version=lr.version, device=str(lr.device),
            precision=lr.lcfg.precision, grad_scale=lr.precision.scale,
            stale_rejections=s.stale_rejections, prefetch_queue=lr.queue_size)


def register(learner):
    return [(telemetry_pb2_grpc.add_LearnerServiceServicer_to_server, LearnerServicer(learner),
             "amprl.v1.LearnerService")]
