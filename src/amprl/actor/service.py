"""ActorService: read-only status of an actor."""

from __future__ import annotations

from amprl.common.grpcutil import map_errors
from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc


class ActorServicer(telemetry_pb2_grpc.ActorServiceServicer):
    def __init__(self, actor):
        self.actor = actor

    @map_errors
    def Info(self, request, context):
        a = self.actor
        return telemetry_pb2.ActorServiceInfoResponse(
            actor_id=a.actor_id, env_steps=a.stats.env_steps, episodes=a.stats.episodes,
            epsilon=a.epsilon, param_version=a.version, recent_return=a.recent_return,
            transitions_sent=a.stats.transitions_sent)


def register(actor):
    return [(telemetry_pb2_grpc.add_ActorServiceServicer_to_server, ActorServicer(actor), "amprl.v1.ActorService")]
