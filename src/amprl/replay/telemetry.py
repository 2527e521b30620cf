"""What a replay shard records over time (``amprl.common.telemetry``): the figures of its
Info (table, rate limiter, actors, Redis), against the transitions inserted."""

from __future__ import annotations

from amprl.common.telemetry import Kind, Series, Telemetry
from amprl.replay.service import ReplayServer, ReplayServicer

G, C, T = Kind.GAUGE, Kind.COUNTER, Kind.THROUGHPUT


def figures(servicer: ReplayServicer) -> dict:
    """``ReplayTable.info()`` and the servicer's own figures; read on the server's event
    loop while it runs (the actor registry and the streams belong to it)."""
    lim = servicer.limiter
    return {**servicer.table.info(),
            "waiting_samples": lim.waiting_samples, "waiting_inserts": lim.waiting_inserts,
            "sample_wait_seconds": lim.sample_wait_seconds, "insert_wait_seconds": lim.insert_wait_seconds,
            "actors_live": servicer.actors.live(), "insert_streams": servicer.inserts.streams,
            "pending_insert_bytes": servicer.inserts.pending_insert_bytes,
            "redis_used_memory_bytes": servicer.redis_used_memory_bytes}


def telemetry(replay: ReplayServer) -> Telemetry[dict]:
    async def on_loop() -> dict:
        return figures(replay.servicer)

    def snapshot() -> dict:
        if replay.server.loop.is_running():
            return replay.server.call(on_loop(), timeout=5.0)
        return figures(replay.servicer)  # stopped: nothing else touches them now

    def f(key: str):
        return lambda d: d[key]

    return Telemetry("replay", snapshot=snapshot, step=f("inserted_total"), series=[
        Series("size", "Transitions stored.", G, f("size")),
        Series("capacity", "Transitions the table holds at most.", G, f("capacity")),
        Series("inserted", "Transitions inserted.", T, f("inserted_total")),
        Series("sampled", "Transitions sampled (a batch of B counts B).", T, f("sampled_total")),
        Series("env_steps", "Env steps the actors report with their inserts.", T, f("env_steps_total")),
        Series("priority_updates", "Priorities updated by learners.", T, f("priority_updates_total")),
        Series("missing_transitions", "Transitions the index expected but Redis had lost "
               "(reconciled after a Redis restart).", G, f("missing")),
        Series("total_priority", "Sum of the priorities p_i^alpha in the sum-tree.", G, f("total_priority")),
        Series("rate_limiter_waiting_samples", "Sample calls waiting on the rate limiter now.", G,
               f("waiting_samples")),
        Series("rate_limiter_waiting_inserts", "Inserts waiting on the rate limiter now.", G,
               f("waiting_inserts")),
        Series("rate_limiter_sample_wait_seconds", "Seconds Sample calls have waited on the rate "
               "limiter, summed over calls.", C, f("sample_wait_seconds")),
        Series("rate_limiter_insert_wait_seconds", "Seconds inserts have waited on the rate limiter, "
               "summed over inserts.", C, f("insert_wait_seconds")),
        Series("actors_live", "Actors that inserted within the live window.", G, f("actors_live")),
        Series("insert_streams", "Insert streams open.", G, f("insert_streams")),
        Series("pending_insert_bytes", "Bytes of received chunks waiting to be stored.", G,
               f("pending_insert_bytes")),
        Series("redis_used_memory_bytes", "Redis's used_memory (bytes), read every second.", G,
               f("redis_used_memory_bytes")),
    ])
