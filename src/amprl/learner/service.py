"""LearnerService: read-only status of a learner (its work is done by the loop)."""

from __future__ import annotations

from amprl.common.grpcutil import map_errors
from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc


class LearnerServicer(telemetry_pb2_grpc.LearnerServiceServicer):
    def __init__(self, learner, watch=None):
        self.learner = learner
        self.watch = watch  # the run's end as this learner follows it (evaluator.client.RunEndWatch)

    @map_errors
    def Info(self, request, context):
        s, lr = self.learner.stats, self.learner
        return telemetry_pb2.LearnerServiceInfoResponse(
            updates=s.updates, skipped_nonfinite=s.skipped_nonfinite, loss=s.loss, q_mean=s.q_mean,
            grad_norm=s.grad_norm, param_version=lr.version, device=str(lr.device),
            precision=lr.lcfg.precision, grad_scale=lr.precision.scale,
            stale_rejections=s.stale_rejections, prefetch_queue=lr.queue_size,
            run_phase=self.watch.phase if self.watch is not None else telemetry_pb2.RUN_PHASE_UNSPECIFIED)


def register(learner, watch=None):
    return [(telemetry_pb2_grpc.add_LearnerServiceServicer_to_server, LearnerServicer(learner, watch),
             "amprl.v1.LearnerService")]
