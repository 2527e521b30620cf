"""A fleet against one replay shard: waiting inserts and idle streams never starve the calls
that release them (Sample) or report on them (health, Info); everything a client can open is
bounded. Real gRPC on loopback, real Redis, many concurrent streams from one asyncio client.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
import redis as redis_lib
from grpc_health.v1 import health_pb2, health_pb2_grpc

from amprl import errors
from amprl.replay.client import ReplayClient, insert_request
from amprl_testing.replay import make_chunk, vector_spec
from amprl.v1 import replay_pb2, replay_pb2_grpc

ACTORS = 64
IDLE = 16


def requests_of(spec, actor_id: str, chunks: int, t: int = 16, seed: int = 0):
    return [insert_request(actor_id, make_chunk(spec, t, seed=seed + i), np.ones(t, np.float32), t)
            for i in range(chunks)]


async def idle_requests(stop: asyncio.Event):
    """A request stream that sends nothing until ``stop`` (then ends)."""
    await stop.wait()
    return
    yield  # pragma: no cover - makes this an async generator


async def forever_requests(prebuilt, stop: asyncio.Event):
    """An actor's stream: chunk after chunk until ``stop``."""
    i = 0
    while not stop.is_set():
        yield prebuilt[i % len(prebuilt)]
        i += 1
        await asyncio.sleep(0)


def test_64_rate_limited_actors_and_idle_streams_never_starve_health_info_or_sample(replay):
    spec = vector_spec()
    # A tight ratio: every actor's insert waits for the learner's samples almost at once.
    r = replay(spec, capacity=200_000, min_size_to_sample=256, samples_per_insert=1.0,
               samples_per_insert_error_buffer=256.0, max_insert_streams=ACTORS + IDLE)
    r.client.insert("seed", [(make_chunk(spec, 256), np.ones(256, np.float32), 256)])
    prebuilt = {k: requests_of(spec, f"actor-{k}", 4, seed=10 * k) for k in range(ACTORS)}

    async def main():
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(r.address) as ch:
            stub = replay_pb2_grpc.ReplayServiceStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            actors = [asyncio.ensure_future(stub.Insert(forever_requests(prebuilt[k], stop), timeout=60))
                      for k in range(ACTORS)]
            idle = [asyncio.ensure_future(stub.Insert(idle_requests(stop), timeout=60))
                    for _ in range(IDLE)]
            deadline = time.monotonic() + 30
            while (await stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=5)).insert_streams \
                    < ACTORS + IDLE:
                assert time.monotonic() < deadline, "the streams did not all open"
                await asyncio.sleep(0.05)

            # One stream more than the cap: refused, with what to change. (From the sync
            # client, as actors use: grpc.aio's client reports a server's early status on a
            # stream it is still writing as INTERNAL, grpc/grpc#36066.)
            with pytest.raises(errors.ResourceExhausted, match="replay.max_insert_streams"):
                await asyncio.to_thread(r.client.insert_requests, prebuilt[0][:1], timeout=5)

            # Every actor's insert now waits on the limiter; the learner's samples, Info and
            # health all answer within their deadlines, and each sample lets some through.
            info0 = await stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=1)
            assert info0.rate_limiter.waiting_inserts > 0
            for _ in range(20):
                batch = await stub.Sample(replay_pb2.SampleRequest(batch_size=64, beta=0.4), timeout=3)
                assert len(np.frombuffer(batch.keys.data, np.int64)) == 64
                status = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                assert status.status == health_pb2.HealthCheckResponse.SERVING
                await stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=1)
            info1 = await stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=1)
            assert info1.inserted_total > info0.inserted_total
            assert info1.actors_live > 1
            # The ratio held: inserted - sampled stays within max_diff (r * m + b = 512) plus
            # the one group admitted last (a group holds at most max_diff / r = 512
            # transitions, however many chunks a stream sent while it waited); letting every
            # waiting stream through at once would overshoot by ~64 groups.
            assert info1.inserted_total - info1.sampled_total <= 512 + 1024

            # The idle streams end cleanly; the actors, still waiting on the limiter, go
            # away (cancel), and the server frees every slot.
            stop.set()
            ended = await asyncio.gather(*idle, return_exceptions=True)
            assert all(isinstance(x, replay_pb2.InsertResponse) for x in ended), ended[:3]
            for call in actors:
                call.cancel()
            await asyncio.gather(*actors, return_exceptions=True)
            deadline = time.monotonic() + 10
            while (await stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=1)).insert_streams:
                assert time.monotonic() < deadline, "cancelled streams still counted"
                await asyncio.sleep(0.05)

    asyncio.run(main())


def test_an_idle_stream_is_ended_after_the_idle_limit_and_keeps_what_it_sent(replay):
    spec = vector_spec()
    r = replay(spec, capacity=1000, insert_idle_timeout_s=0.5)
    sent = requests_of(spec, "actor-idle", 1)

    async def main():
        never = asyncio.Event()

        async def one_then_silence():
            yield sent[0]
            await never.wait()

        async with grpc.aio.insecure_channel(r.address) as ch:
            stub = replay_pb2_grpc.ReplayServiceStub(ch)
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await stub.Insert(one_then_silence(), timeout=30)
            return ended.value, time.monotonic() - start

    err, took = asyncio.run(main())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "replay.insert_idle_timeout_s" in err.details() and "1 chunks" in err.details()
    assert took < 10
    info = r.client.info()
    assert info.size == 16 and info.insert_streams == 0


_HUNG_CLIENT = textwrap.dedent("""
    import asyncio, sys
    import grpc
    from amprl.v1 import replay_pb2_grpc

    async def idle(stop):
        await stop.wait()
        return
        yield

    async def main():
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(sys.argv[1]) as ch:
            stub = replay_pb2_grpc.ReplayServiceStub(ch)
            calls = [asyncio.ensure_future(stub.Insert(idle(stop))) for _ in range(int(sys.argv[2]))]
            print("open", flush=True)
            await asyncio.gather(*calls, return_exceptions=True)

    asyncio.run(main())
""")


def test_keepalive_drops_the_streams_of_a_peer_that_stopped_answering(replay):
    # A client process that opened streams and then hangs (SIGSTOP: its TCP stays open but
    # nothing answers the server's HTTP/2 pings), as a frozen or partitioned pod would.
    r = replay(vector_spec(), capacity=1000, keepalive_s=1.0, insert_idle_timeout_s=600)
    proc = subprocess.Popen([sys.executable, "-c", _HUNG_CLIENT, r.address, "5"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        deadline = time.monotonic() + 30
        while r.client.info(timeout=2).insert_streams < 5:
            assert time.monotonic() < deadline, "the client's streams never opened"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while r.client.info(timeout=2).insert_streams > 0:
            assert time.monotonic() - stopped < 20, "the hung peer's streams were never dropped"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGCONT) if proc.poll() is None else None
        proc.wait(10)
        proc.stdout.close()


def test_a_waiting_insert_is_cancelled_at_once_when_its_caller_stops(replay):
    spec = vector_spec()
    # min size 16 and a ratio of 1 with buffer 1: after the first 32 nothing more goes in
    # until something is sampled.
    r = replay(spec, capacity=1000, min_size_to_sample=16, samples_per_insert=1.0,
               samples_per_insert_error_buffer=1.0)
    r.client.insert("a", [(make_chunk(spec, 32), np.ones(32, np.float32), 32)])
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    with ReplayClient(r.address) as client, pytest.raises(errors.DeadlineExceeded, match="stopping"):
        client.insert("a", [(make_chunk(spec, 8), np.ones(8, np.float32), 8)], timeout=60,
                      cancel=stop)
    assert time.monotonic() - start < 5
    deadline = time.monotonic() + 5
    while r.client.info().rate_limiter.waiting_inserts:  # the server let go of it too
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_chunks_waiting_on_the_limiter_are_bounded_in_bytes_not_by_the_fleet(replay):
    from amprl_testing.replay import atari_spec
    spec = atari_spec(16)
    streams = 20
    probe = make_chunk(spec, 16)
    chunk_bytes = probe.frames.nbytes
    budget = 4 * chunk_bytes
    r = replay(spec, capacity=100_000, min_size_to_sample=32, samples_per_insert=1.0,
               samples_per_insert_error_buffer=1.0, max_pending_insert_bytes=budget)
    r.client.insert("seed", [(make_chunk(spec, 32), np.ones(32, np.float32), 32)])
    prebuilt = requests_of(spec, "actor", 8)

    async def main():
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(r.address) as ch:
            stub = replay_pb2_grpc.ReplayServiceStub(ch)
            calls = [asyncio.ensure_future(stub.Insert(forever_requests(prebuilt, stop), timeout=60))
                     for _ in range(streams)]
            peak = 0
            for _ in range(40):  # 2 s of a fleet pushing chunks at a closed limiter
                info = await stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=1)
                peak = max(peak, info.pending_insert_bytes)
                await asyncio.sleep(0.05)
            # Sampling opens the limiter: the held groups are stored and room returns.
            inserted = info.inserted_total
            for _ in range(10):
                await stub.Sample(replay_pb2.SampleRequest(batch_size=32, beta=0.4), timeout=3)
            after = await stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=1)
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            return peak, inserted, after

    peak, inserted, after = asyncio.run(main())
    # Once over the budget a stream reads at most the one chunk already on its way.
    assert budget <= peak <= budget + streams * chunk_bytes, (peak, budget, chunk_bytes)
    assert after.inserted_total > inserted
    deadline = time.monotonic() + 5
    while r.client.info().pending_insert_bytes:  # cancelled streams gave their bytes back
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_an_admitted_insert_whose_actor_goes_away_is_stored_and_counted_by_the_limiter(
        replay, embedded_redis):
    spec = vector_spec()
    r = replay(spec, capacity=1000, samples_per_insert=0.0)
    admin = redis_lib.Redis.from_url(embedded_redis.admin_url)
    try:
        # Redis holds writes for 1 s: the insert is admitted and its worker waits in Redis
        # while the actor cancels its call.
        admin.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
        call = r.client._stub.Insert.future(iter(requests_of(spec, "actor-gone", 1)), timeout=30)
        time.sleep(0.3)
        call.cancel()
        deadline = time.monotonic() + 10
        while r.table.inserted_total < 16:
            assert time.monotonic() < deadline, "the admitted group was not stored"
            time.sleep(0.05)
        while r.servicer.limiter.inserted < 16:  # counted once its worker finished
            assert time.monotonic() < deadline, "the stored group was not counted"
            time.sleep(0.05)
        assert r.servicer.limiter.inserted == r.table.inserted_total == 16
    finally:
        admin.close()
