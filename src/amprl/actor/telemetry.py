"""What an actor records over time (``amprl.common.telemetry``): its ``ActorStats`` and
training returns, against its env steps."""

from __future__ import annotations

from amprl.actor.actor import Actor
from amprl.common.telemetry import Kind, Series, Telemetry

G, C, T = Kind.GAUGE, Kind.COUNTER, Kind.THROUGHPUT


def telemetry(actor: Actor) -> Telemetry[Actor]:
    return Telemetry("actor", snapshot=lambda: actor, step=lambda a: a.stats.env_steps, series=[
        Series("env_steps", "Environment steps taken (all of this actor's envs).", T,
               lambda a: a.stats.env_steps),
        Series("episodes", "Training episodes finished.", C, lambda a: a.stats.episodes),
        Series("episode_return", f"Mean undiscounted return of the last {actor.returns.maxlen} "
               "finished training episodes (exploration on).", G,
               lambda a: a.recent_return if a.returns else None),
        Series("transitions_sent", "Transitions inserted into replay.", T, lambda a: a.stats.transitions_sent),
        Series("insert_errors", "Inserts rejected for good (their transitions dropped).", C,
               lambda a: a.stats.insert_errors),
        Series("insert_retries", "Inserts tried again after RESOURCE_EXHAUSTED, UNAVAILABLE or "
               "DEADLINE_EXCEEDED.", C, lambda a: a.stats.insert_retries),
        Series("epsilon", "Exploration now (DQN: mean epsilon; TD3: Gaussian noise std in half-ranges).",
               G, lambda a: a.epsilon),
        Series("param_version", "Parameter version the actor acts with.", G, lambda a: a.version),
    ])
