"""ActorService: read-only status of an actor."""

from __future__ import annotations

from amprl.common.grpcutil import map_errors
from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc


class ActorServicer(telemetry_pb2_grpc.ActorServiceServicer):
    def __init__(self, actor, watch=None):
        self.actor = actor
        self.watch = watch  # the run's end as this actor follows it (evaluator.client.RunEndWatch)

    @map_errors
    def Info(self, request, context):
        a = self.actor
        return telemetry_pb2.ActorServiceInfoResponse(
            actor_id=a.actor_id, env_steps=a.stats.env_steps, episodes=a.stats.episodes,
            epsilon=a.epsilon, param_version=a.version, recent_return=a.recent_return,
            transitions_sent=a.stats.transitions_sent,
            run_phase=self.watch.phase if self.watch is not None else telemetry_pb2.RUN_PHASE_UNSPECIFIED)


def register(actor, watch=None):
    return [(telemetry_pb2_grpc.add_ActorServiceServicer_to_server, ActorServicer(actor, watch),
             "amprl.v1.ActorService")]
