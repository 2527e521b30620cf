"""AMP-RL: distributed reinforcement learning over gRPC (actors, replay, learner, parameter server)."""

__version__ = "0.1.0"
