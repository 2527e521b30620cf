"""A fleet against one replay shard and one parameter server: N actors inserting, N actors
pulling weights, one learner sampling and pushing (issue 31). Prints ONE JSON object.

    python bench/fleet.py [--seconds 10] [--fleet-sizes 16,64,256] [--only sweep|atari]
                          [--pull-interval-s S] [--pull-encoding bf16] [--chunks-per-call 4]

Everything is real and its own OS process on loopback: an embedded Redis, the replay service
(``python -m amprl.replay --redis-url ...``), the parameter server (``python -m
amprl.paramserver``, holding configs/pong-apex.yaml's Atari network) and the load generator
(this script again, with ``--load-generator``; a new one for each phase): one asyncio
process whose grpc.aio clients drive hundreds of concurrent calls, each simulated actor on a
connection of its own. This
process only starts, waits for and stops the others (by PID and process group, also on
Ctrl-C, SIGTERM or an error).

**Sweep** (replay with CartPole observations and configs/cartpole-dqn.yaml's rate limiter:
samples_per_insert 32, min_size_to_sample 1000, error buffer 0 = 32,000, capacity 100,000).
For each N in --fleet-sizes two phases of --warmup-s + --seconds under the same insert load,
first without pullers, then with them. Running during each:

  * N actors ("actor-<k>"), one Insert call after another as the actor's sender makes them:
    --chunks-per-call chunks of 64 transitions (real CartPole-v1 observations from random
    play, rolled before timing), with the actor's deadline (``actor.INSERT_TIMEOUT_S``, 60 s).
    RESOURCE_EXHAUSTED, UNAVAILABLE and DEADLINE_EXCEEDED back off as the actor does
    (``amprl.common.backoff``) before the next call.
  * N pullers (second phase): PullParameters(have_version, --pull-encoding) each time actor
    k's stored transitions (its env steps) pass another 400 (pong-apex's
    actor.weight_refresh_steps; each actor starts at a random point of that cycle, holding
    the version current at the start), or every --pull-interval-s seconds instead. Replies
    stay raw bytes: only their version fields are read, no tensor is decoded.
  * one learner: Sample(512) with 2 calls in flight into a queue of 4 batches; per batch an
    UpdatePriorities (up to 2 in flight) and a PushGradients of the Atari network's gradient
    (encoded once, --grad-encoding, default pong-apex's learner.grad_encoding), based on the
    last reply's version, one push in flight (pong-apex's learner.max_pushes_in_flight).
  * grpc.health.v1 Check on the replay every 50 ms (deadline 1 s), replay Info every
    200 ms (deadline 2 s).

Only calls that end inside the --seconds window count. Per N (suffix ``_N``, from the phase
with pullers unless said otherwise):

  insert_transitions_per_s, sample_transitions_per_s   transitions in Insert / Sample replies
  insert_p50_ms, insert_p99_ms, sample_p99_ms, health_p99_ms, info_p99_ms
                          every call that ended, failed ones at their time to failure
                          (an Insert that waited on the rate limiter past its deadline: 60000)
  resource_exhausted      RESOURCE_EXHAUSTED answers, any call
  insert_deadline_exceeded  Insert calls whose 60 s ran out (waiting on the rate limiter is
                          the protocol's documented behaviour; the actor backs off and resends)
  errors_other, errors_by_code   every other non-OK status or exception, and by
                          "<Method> <CODE>": count and first message
  replay_rss_mb           VmRSS of the replay process at the end of the phase
  redis_used_mb, replay_size    from Info at the end of the phase
  learner_updates_per_s   pushes answered per second (each one batch sampled, its
                          priorities sent, its gradient pushed)
  learner_updates_per_s_no_pullers, learner_updates_ratio_vs_no_pullers
  pulls, paramserver_bytes_per_pull, pull_p50_ms   pulls answered, mean reply bytes
  paramserver_cpu_ms_per_pull   parameter-server CPU (/proc) in the phase with pullers, less
                          its CPU per push in the phase without times the pushes, per pull
                          (noisy with few pulls: every 400 env steps, the fleet pulls about
                          insert_transitions_per_s / 400 times a second whatever N is)
  push_p50_ms, update_priorities_p99_ms   the learner's other calls
  pull_interval_s         N * seconds / pulls: the interval each puller achieved, on average
                          (every 400 env steps it is longer than the window at large N, so
                          no puller's own gaps can show it)
  pull_gap_median_s       median of the gaps between one puller's consecutive pulls inside
                          the window (the interval itself with --pull-interval-s; under the
                          400-step rule only the short gaps a window can hold)
  replay_cpu_cores, paramserver_cpu_cores, load_generator_cpu_cores   CPU seconds per second

**Atari** (``atari_*``): a replay shard alone, no rate limit, filled with chunks of real ALE
Pong frames (bench/replay.py's ``pong_frames``; F = T + 3 + 3 frames stored once per chunk of
T = 64), then --atari-in-flight Sample(512) calls kept in flight for --seconds;
``atari_sample_transitions_per_s_b512`` counts the transitions in the replies without
decoding any frame (a GPU learner decodes on its own cores; this is what the shard serves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from amprl.actor.actor import INSERT_TIMEOUT_S
from amprl.common.backoff import Backoff
from amprl.common.grpcutil import DEFAULT_MAX_MESSAGE_BYTES
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import dump_config, load_config
from amprl.launch.procs import Service, spawn, start_service, stop_services, wait_for_port
from amprl.replay.client import insert_request
from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, replay_pb2, replay_pb2_grpc, tensor_pb2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from push import process_cpu_s  # noqa: E402
from replay import ATARI_SIZE, make_chunk, pong_frames, start_replay  # noqa: E402

CARTPOLE_CONFIG = ROOT / "configs/cartpole-dqn.yaml"
ATARI_CONFIG = ROOT / "configs/pong-apex.yaml"
CARTPOLE_SPEC = {"frame_shape": [4], "frame_dtype": "float32", "frame_stack": 1, "discrete": True,
                 "num_actions": 2}
ATARI_SPEC = {"frame_shape": [ATARI_SIZE, ATARI_SIZE], "frame_dtype": "uint8", "frame_stack": 4,
              "discrete": True, "num_actions": 6}
N_STEP = 3
MAX_CHUNKS_PER_CALL = 16  # the actor's sender puts at most this many chunks in one Insert call

# Deadlines, as the real clients set them
INSERT_DEADLINE_S = INSERT_TIMEOUT_S  # the actor's sender
SAMPLE_DEADLINE_S = 2.0  # the learner's prefetch thread
PUSH_DEADLINE_S = 10.0   # learner.push_timeout_s
PULL_DEADLINE_S = 30.0   # the actor's weight thread
HEALTH_DEADLINE_S = 1.0  # a kubelet probe's timeoutSeconds
INFO_DEADLINE_S = 2.0
FINAL_INFO_DEADLINE_S = 3.0
PHASE_SETUP_S = 15.0  # a phase's client processes import, build requests, then start together

HEALTH_EVERY_S = 0.05
INFO_EVERY_S = 0.2
SAMPLE_CALLS_IN_FLIGHT = 2  # the learner prefetches
PREFETCH_BATCHES = 4        # learner.prefetch_batches
PRIORITY_CALLS_IN_FLIGHT = 2
BETA = 0.4
OTHER_ERROR_PAUSE_S = 1.0  # after a status nobody should retry at once (a bug, a bad request)
RETRY_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
               grpc.StatusCode.DEADLINE_EXCEEDED)

INSERT = "/amprl.v1.ReplayService/Insert"
PULL = "/amprl.v1.ParameterService/PullParameters"
PUSH = "/amprl.v1.ParameterService/PushGradients"


# -- small readers --------------------------------------------------------------------------

def rss_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` (VmRSS), MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def top_fields(buf: bytes) -> dict[int, int | memoryview]:
    """The top-level fields of a serialized protobuf message, nested messages left unparsed:
    field number -> varint value, or a view of a length-delimited field's bytes (the last
    occurrence of a repeated one). Lets a puller read a weights reply's version without
    decoding its tensors."""
    out: dict[int, int | memoryview] = {}
    view = memoryview(buf)
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            out[field], i = _varint(buf, i)
        elif wire_type == 2:
            size, i = _varint(buf, i)
            out[field] = view[i:i + size]
            i += size
        elif wire_type == 1:
            i += 8
        elif wire_type == 5:
            i += 4
        else:
            raise ValueError(f"wire type {wire_type} at byte {i}: not a protobuf message")
    return out


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 1) if values else None


def stopping_if_cancelled() -> None:
    """Inside an ``except Exception``: re-raises when the running task is being cancelled, so
    that a client loop never counts a call cut short by its own cancellation (should the
    library report it as an error rather than CancelledError) and carries on past its
    phase."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def aio_channel(address: str) -> grpc.aio.Channel:
    # A subchannel pool of its own: one TCP connection per simulated actor, as separate pods
    # have (channels with equal arguments would otherwise share one).
    return grpc.aio.insecure_channel(address, options=[
        ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
        ("grpc.use_local_subchannel_pool", 1)])


# -- what one phase measures ----------------------------------------------------------------

class Window:
    """Counters and timings of one phase: only calls that end while ``on`` count."""

    def __init__(self) -> None:
        self.on = False
        self.latency_s: dict[str, list[float]] = defaultdict(list)
        self.counts: Counter = Counter()
        self.errors: dict[str, list] = {}  # "<Method> <CODE>" -> [count, first message]
        self.pull_starts: dict[int, list[float]] = defaultdict(list)

    def ok(self, method: str, t0: float, **counts: int) -> None:
        if self.on:
            self.latency_s[method].append(time.perf_counter() - t0)
            self.counts.update(counts)

    def error(self, key: str, message: str) -> None:
        self.errors.setdefault(key, [0, message[:300]])[0] += 1

    def failed(self, method: str, t0: float, exc: Exception) -> grpc.StatusCode | None:
        """Counts a failed call and returns its status code (None: not an RPC error)."""
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        if self.on:
            self.latency_s[method].append(time.perf_counter() - t0)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.counts["resource_exhausted"] += 1
            elif method == "Insert" and code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.counts["insert_deadline_exceeded"] += 1
            else:
                self.error(f"{method} {code.name if code else type(exc).__name__}",
                           (exc.details() if code else str(exc)) or "")
        return code

    def errors_json(self) -> dict:
        return {k: {"count": c, "first": m} for k, (c, m) in sorted(self.errors.items())}


# -- the sweep's clients --------------------------------------------------------------------

def cartpole_bodies(chunk: int, count: int = 64, seed: int = 0) -> list[bytes]:
    """``count`` serialized InsertRequests without an actor id (each actor prepends its own;
    protobuf merges concatenated messages): chunks of real CartPole-v1 observations from
    random play, T + n-step consecutive observations each."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    frames = np.empty((count * (chunk + N_STEP), 4), dtype=np.float32)
    for i in range(len(frames)):
        frames[i] = obs
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(2)))
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    return [insert_request("", make_chunk(f, chunk, 1, N_STEP, 2, rng),
                           rng.uniform(0.1, 2.0, chunk).astype(np.float32), chunk).SerializeToString()
            for f in frames.reshape(count, chunk + N_STEP, 4)]


def push_prefix(config_path: str, encoding: str, batch_size: int) -> bytes:
    """A serialized PushGradientsRequest of the Atari network's gradient, encoded once, with
    no base_version: each push appends its own (the last occurrence of a field wins)."""
    import torch

    from amprl.wire.compressed import ErrorFeedback
    from amprl.envs.factory import env_spec
    from amprl.algos import build_model

    torch.set_num_threads(1)
    cfg = load_config(config_path)
    model = build_model(cfg, env_spec(cfg.env))
    g = torch.Generator().manual_seed(0)
    grads = {n: 1e-3 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    return paramserver_pb2.PushGradientsRequest(
        learner_id="learner-0", gradients=ErrorFeedback(encoding).compress(grads),
        batch_size=batch_size).SerializeToString()


class Sweep:
    """The load generator's sweep: one phase per (N, pullers or not)."""

    def __init__(self, args, plan: dict):
        self.args = args
        self.plan = plan
        self.rng = random.Random(0)
        self.clients = plan["clients"]
        self.bodies = cartpole_bodies(plan["chunk"]) if "fleet" in self.clients else []
        self.push_prefix = (push_prefix(plan["config"], plan["grad_encoding"], args.batch_size)
                            if "learner" in self.clients else b"")
        self.pull_encoding = tensor_pb2.Encoding.Value(f"ENCODING_{args.pull_encoding.upper()}")
        self.priorities = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[args.batch_size],
                                            data=np.full(args.batch_size, 0.5, np.float32).tobytes())

    async def actor(self, k: int, w: Window, want_pull: asyncio.Event | None) -> None:
        prefix = replay_pb2.InsertRequest(actor_id=f"actor-{k}").SerializeToString()
        refresh = self.plan["refresh_steps"]
        steps = self.rng.randrange(refresh)  # a random point of its refresh cycle
        i, backoff = 7 * k, Backoff(rng=self.rng)
        async with aio_channel(self.plan["replay"]) as channel:
            insert = channel.stream_unary(INSERT, request_serializer=None,
                                          response_deserializer=replay_pb2.InsertResponse.FromString)
            while True:
                items = [prefix + self.bodies[(i + j) % len(self.bodies)]
                         for j in range(self.plan["chunks_per_call"])]
                i += len(items)
                t0 = time.perf_counter()
                try:
                    reply = await insert(items, timeout=INSERT_DEADLINE_S)
                except Exception as exc:  # noqa: BLE001 - counted; the actor carries on
                    stopping_if_cancelled()
                    code = w.failed("Insert", t0, exc)
                    await asyncio.sleep(backoff.next() if code in RETRY_CODES
                                        else OTHER_ERROR_PAUSE_S)
                    continue
                backoff.reset()
                w.ok("Insert", t0, inserted=reply.transitions_stored)
                before, steps = steps, steps + reply.transitions_stored
                if want_pull is not None and steps // refresh > before // refresh:
                    want_pull.set()

    async def puller(self, k: int, w: Window, want: asyncio.Event | None, version: int) -> None:
        interval = self.args.pull_interval_s
        next_at = time.perf_counter() + self.rng.uniform(0.0, interval) if interval else 0.0
        backoff = Backoff(rng=self.rng)
        async with aio_channel(self.plan["paramserver"]) as channel:
            pull = channel.unary_stream(PULL, request_serializer=paramserver_pb2.PullParametersRequest.SerializeToString,
                                        response_deserializer=None)  # raw bytes: no tensor decoded
            while True:
                if interval:
                    await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                    next_at = max(next_at + interval, time.perf_counter())
                else:
                    await want.wait()
                    want.clear()
                t0 = time.perf_counter()
                if w.on:
                    w.pull_starts[k].append(t0)
                request = paramserver_pb2.PullParametersRequest(have_version=version, encoding=self.pull_encoding,
                                                                client_id=f"actor-{k}")
                nbytes, got, unchanged, last = 0, version, False, False
                try:
                    async for raw in pull(request, timeout=PULL_DEADLINE_S):
                        nbytes += len(raw)
                        fields = top_fields(raw)
                        got, unchanged, last = fields.get(1, got), bool(fields.get(2)), bool(fields.get(4))
                    if not last:
                        raise RuntimeError(f"pull stream ended before its last message ({nbytes} bytes)")
                except Exception as exc:  # noqa: BLE001 - counted; the actor carries on
                    stopping_if_cancelled()
                    code = w.failed("PullParameters", t0, exc)
                    await asyncio.sleep(backoff.next() if code in RETRY_CODES
                                        else OTHER_ERROR_PAUSE_S)
                    if want is not None:
                        want.set()  # it still wants the weights
                    continue
                backoff.reset()
                version = got
                w.ok("PullParameters", t0, pulls=1, pull_bytes=nbytes, pulls_unchanged=int(unchanged))

    async def learner(self, w: Window, version: int) -> None:
        bs = self.args.batch_size
        async with aio_channel(self.plan["replay"]) as replay_ch, aio_channel(self.plan["paramserver"]) as ps_ch:
            replay = replay_pb2_grpc.ReplayServiceStub(replay_ch)
            push = ps_ch.unary_unary(PUSH, request_serializer=None,
                                     response_deserializer=paramserver_pb2.PushGradientsResponse.FromString)
            batches: asyncio.Queue = asyncio.Queue(PREFETCH_BATCHES)
            priority_slots = asyncio.Semaphore(PRIORITY_CALLS_IN_FLIGHT)
            helpers: set[asyncio.Task] = set()

            async def prefetch() -> None:
                request, backoff = replay_pb2.SampleRequest(batch_size=bs, beta=BETA), Backoff(rng=self.rng)
                while True:
                    t0 = time.perf_counter()
                    try:
                        resp = await replay.Sample(request, timeout=SAMPLE_DEADLINE_S)
                    except Exception as exc:  # noqa: BLE001
                        stopping_if_cancelled()
                        code = w.failed("Sample", t0, exc)
                        await asyncio.sleep(backoff.next() if code in RETRY_CODES
                                            else OTHER_ERROR_PAUSE_S)
                        continue
                    backoff.reset()
                    w.ok("Sample", t0, sampled=resp.keys.shape[0] if resp.keys.shape else 0)
                    await batches.put(resp)

            async def send_priorities(keys: tensor_pb2.Tensor) -> None:
                n = keys.shape[0] if keys.shape else 0
                prios = self.priorities if n == bs else tensor_pb2.Tensor(
                    dtype=tensor_pb2.DTYPE_FLOAT32, shape=[n], data=np.full(n, 0.5, np.float32).tobytes())
                t0 = time.perf_counter()
                try:
                    await replay.UpdatePriorities(replay_pb2.UpdatePrioritiesRequest(keys=keys, priorities=prios),
                                                  timeout=SAMPLE_DEADLINE_S)
                    w.ok("UpdatePriorities", t0)
                except Exception as exc:  # noqa: BLE001
                    stopping_if_cancelled()
                    w.failed("UpdatePriorities", t0, exc)
                finally:
                    priority_slots.release()

            for _ in range(SAMPLE_CALLS_IN_FLIGHT):
                helpers.add(asyncio.create_task(prefetch()))
            try:
                while True:
                    resp = await batches.get()
                    await priority_slots.acquire()
                    task = asyncio.create_task(send_priorities(resp.keys))
                    helpers.add(task)
                    task.add_done_callback(helpers.discard)
                    t0 = time.perf_counter()
                    try:
                        reply = await push(self.push_prefix + paramserver_pb2.PushGradientsRequest(
                            base_version=version).SerializeToString(), timeout=PUSH_DEADLINE_S)
                    except Exception as exc:  # noqa: BLE001
                        stopping_if_cancelled()
                        code = w.failed("PushGradients", t0, exc)
                        if code == grpc.StatusCode.FAILED_PRECONDITION:  # stale: re-base
                            for key, value in exc.trailing_metadata() or ():
                                if key == "amprl-current-version":
                                    version = int(value)
                        else:
                            await asyncio.sleep(Backoff(rng=self.rng).next())
                        continue
                    version = reply.version
                    w.ok("PushGradients", t0, updates=1)
            finally:
                for task in list(helpers):
                    task.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)

    async def health(self, w: Window) -> None:
        async with aio_channel(self.plan["replay"]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                t0 = time.perf_counter()
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_DEADLINE_S)
                    w.ok("Check", t0)
                    if reply.status != health_pb2.HealthCheckResponse.SERVING and w.on:
                        w.error("Check NOT_SERVING", f"status {reply.status}")
                except Exception as exc:  # noqa: BLE001
                    stopping_if_cancelled()
                    w.failed("Check", t0, exc)
                await asyncio.sleep(max(0.0, t0 + HEALTH_EVERY_S - time.perf_counter()))

    async def info(self, w: Window) -> None:
        async with aio_channel(self.plan["replay"]) as channel:
            stub = replay_pb2_grpc.ReplayServiceStub(channel)
            while True:
                t0 = time.perf_counter()
                try:
                    await stub.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=INFO_DEADLINE_S)
                    w.ok("Info", t0)
                except Exception as exc:  # noqa: BLE001
                    stopping_if_cancelled()
                    w.failed("Info", t0, exc)
                await asyncio.sleep(max(0.0, t0 + INFO_EVERY_S - time.perf_counter()))

    def cpu_s(self) -> dict[str, float]:
        return {"replay": process_cpu_s(self.plan["replay_pid"]),
                "paramserver": process_cpu_s(self.plan["paramserver_pid"]),
                "load_generator": time.process_time()}

    async def phase(self, n: int, pullers: bool) -> dict:
        w = Window()
        async with aio_channel(self.plan["paramserver"]) as channel:
            version = (await paramserver_pb2_grpc.ParameterServiceStub(channel).Info(
                paramserver_pb2.ParameterServiceInfoRequest(), timeout=30.0)).version
        coros = []
        if "fleet" in self.clients:
            by_env_steps = pullers and not self.args.pull_interval_s
            wants = [asyncio.Event() if by_env_steps else None for _ in range(n)]
            coros += [self.actor(k, w, wants[k]) for k in range(n)]
            if pullers:
                coros += [self.puller(k, w, wants[k], version) for k in range(n)]
        if "learner" in self.clients:
            coros.append(self.learner(w, version))
        if "probe" in self.clients:
            coros += [self.health(w), self.info(w)]
        # The phase's client processes set up at their own pace, then start together.
        late = time.time() - self.plan["start_at"]
        if late > 0.5:  # its window would not be the others': say so
            w.error("client started late", f"{self.clients} ready {late:.1f} s after the common start")
        await asyncio.sleep(max(0.0, -late))
        tasks = [asyncio.create_task(c) for c in coros]
        try:
            await asyncio.sleep(self.args.warmup_s)
            cpu0, t0 = self.cpu_s(), time.perf_counter()
            w.on = True
            await asyncio.sleep(self.args.seconds)
            w.on = False
            seconds, cpu1 = time.perf_counter() - t0, self.cpu_s()
        finally:
            for task in tasks:
                task.cancel()
            _, lingering = await asyncio.wait(tasks, timeout=10.0)
        if lingering:  # would load the next phase: say so
            w.error("client did not stop", f"{len(lingering)} client tasks outlived their phase")
        for task in tasks:  # a client that died of a bug is an error, not a quiet gap
            if task.done() and not task.cancelled() and task.exception() is not None:
                w.error(f"client {type(task.exception()).__name__}", str(task.exception()))
        info = None
        async with aio_channel(self.plan["replay"]) as channel:
            try:
                info = await replay_pb2_grpc.ReplayServiceStub(channel).Info(
                    replay_pb2.ReplayServiceInfoRequest(), timeout=FINAL_INFO_DEADLINE_S)
            except grpc.aio.AioRpcError as exc:
                w.error(f"final Info {exc.code().name}", exc.details() or "")
        c, lat = w.counts, w.latency_s
        gaps = [b - a for starts in w.pull_starts.values() for a, b in zip(starts, starts[1:])]
        return {
            "n": n, "pullers": pullers, "clients": self.clients, "seconds": round(seconds, 3),
            "insert_transitions_per_s": round(c["inserted"] / seconds),
            "sample_transitions_per_s": round(c["sampled"] / seconds),
            "insert_p50_ms": percentile_ms(lat["Insert"], 50),
            "insert_p99_ms": percentile_ms(lat["Insert"], 99),
            "sample_p99_ms": percentile_ms(lat["Sample"], 99),
            "health_p99_ms": percentile_ms(lat["Check"], 99),
            "info_p99_ms": percentile_ms(lat["Info"], 99),
            "insert_calls": len(lat["Insert"]), "health_checks": len(lat["Check"]),
            "resource_exhausted": c["resource_exhausted"],
            "insert_deadline_exceeded": c["insert_deadline_exceeded"],
            "errors_other": sum(count for count, _ in w.errors.values()),
            "errors_by_code": w.errors_json(),
            "replay_rss_mb": None if (r := rss_mb(self.plan["replay_pid"])) is None else round(r, 1),
            "redis_used_mb": None if info is None else round(info.redis_used_memory_bytes / 2**20, 1),
            "replay_size": None if info is None else int(info.size),
            "updates": c["updates"],
            "learner_updates_per_s": round(c["updates"] / seconds, 2),
            "pulls": c["pulls"], "pulls_unchanged": c["pulls_unchanged"],
            "paramserver_bytes_per_pull": round(c["pull_bytes"] / c["pulls"]) if c["pulls"] else None,
            "pull_p50_ms": percentile_ms(lat["PullParameters"], 50),
            "push_p50_ms": percentile_ms(lat["PushGradients"], 50),
            "update_priorities_p99_ms": percentile_ms(lat["UpdatePriorities"], 99),
            "pull_interval_s": round(n * seconds / c["pulls"], 2) if c["pulls"] else None,
            "pull_gap_median_s": round(float(np.median(gaps)), 2) if gaps else None,
            "paramserver_cpu_s": cpu1["paramserver"] - cpu0["paramserver"],
            **{f"{name}_cpu_cores": round((cpu1[name] - cpu0[name]) / seconds, 3) for name in cpu0},
        }

    async def run(self) -> None:
        if "learner" in self.clients:
            emit({"gradient_bytes_per_push": len(self.push_prefix)})
        n, pullers = self.plan["phase"]
        emit(await self.phase(n, pullers))


# -- the Atari shard on its own -------------------------------------------------------------

async def atari(args, plan: dict) -> None:
    rng = np.random.default_rng(1)
    t, stack = plan["chunk"], ATARI_SPEC["frame_stack"]
    f = t + stack - 1 + N_STEP
    distinct = 24
    frames, source = pong_frames(distinct * f)
    bodies = [insert_request("", make_chunk(frames[i * f:(i + 1) * f], t, stack, N_STEP, 6, rng),
                             rng.uniform(0.1, 2.0, t).astype(np.float32), t).SerializeToString()
              for i in range(distinct)]
    rng_backoff = random.Random(0)
    w = Window()
    w.on = True  # the fill: every failure counts
    streams, calls_needed = 4, -(-args.atari_transitions // (t * MAX_CHUNKS_PER_CALL))

    async def fill(k: int, calls: int) -> None:
        prefix = replay_pb2.InsertRequest(actor_id=f"actor-{k}").SerializeToString()
        async with aio_channel(plan["replay"]) as channel:
            insert = channel.stream_unary(INSERT, request_serializer=None,
                                          response_deserializer=replay_pb2.InsertResponse.FromString)
            for c in range(calls):
                items = [prefix + bodies[(k * 5 + c * MAX_CHUNKS_PER_CALL + j) % distinct]
                         for j in range(MAX_CHUNKS_PER_CALL)]
                t0 = time.perf_counter()
                try:
                    reply = await insert(items, timeout=60.0)
                    w.ok("Insert", t0, inserted=reply.transitions_stored)
                except grpc.aio.AioRpcError as exc:
                    w.failed("Insert", t0, exc)

    t0 = time.perf_counter()
    await asyncio.gather(*(fill(k, calls_needed // streams + (k < calls_needed % streams)) for k in range(streams)))
    fill_s = time.perf_counter() - t0
    inserted = w.counts["inserted"]
    w.on = False

    async def sampler() -> None:
        request = replay_pb2.SampleRequest(batch_size=args.batch_size, beta=BETA)
        async with aio_channel(plan["replay"]) as channel:
            sample = channel.unary_unary("/amprl.v1.ReplayService/Sample",
                                         request_serializer=replay_pb2.SampleRequest.SerializeToString,
                                         response_deserializer=None)  # raw bytes: frames stay compressed
            while True:
                t0 = time.perf_counter()
                try:
                    raw = await sample(request, timeout=10.0)
                except grpc.aio.AioRpcError as exc:
                    w.failed("Sample", t0, exc)
                    await asyncio.sleep(Backoff(rng=rng_backoff).next())
                    continue
                keys = tensor_pb2.Tensor.FromString(bytes(top_fields(raw).get(2, b"")))  # SampleResponse.keys
                w.ok("Sample", t0, sampled=keys.shape[0] if keys.shape else 0)

    tasks = [asyncio.create_task(sampler()) for _ in range(args.atari_in_flight)]
    try:
        await asyncio.sleep(args.warmup_s)
        cpu0, t0, w.on = process_cpu_s(plan["replay_pid"]), time.perf_counter(), True
        await asyncio.sleep(args.seconds)
        w.on = False
        seconds, cpu1 = time.perf_counter() - t0, process_cpu_s(plan["replay_pid"])
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=10.0)
    emit({"atari_sample_transitions_per_s_b512": round(w.counts["sampled"] / seconds),
          "atari_sample_p50_ms": percentile_ms(w.latency_s["Sample"], 50),
          "atari_sample_calls_in_flight": args.atari_in_flight,
          "atari_replay_cpu_cores": round((cpu1 - cpu0) / seconds, 3),
          "atari_transitions_stored": int(inserted),
          "atari_insert_transitions_per_s": round(inserted / fill_s),
          "atari_chunk_transitions": t, "atari_frames_per_chunk": f,
          "atari_frames_source": source,
          "atari_errors": sum(count for count, _ in w.errors.values()) + w.counts["resource_exhausted"]
          + w.counts["insert_deadline_exceeded"],
          "atari_errors_by_code": w.errors_json()})


def emit(record: dict) -> None:
    """One JSON line to the bench's main process (what ends up in the output)."""
    print(json.dumps(record), flush=True)


async def exit_with_parent(ppid: int) -> None:
    """Ends this process if the bench's main process went away (killed without cleanup)."""
    while True:
        if os.getppid() != ppid:
            os._exit(3)
        await asyncio.sleep(1.0)


async def load_generator(args, plan: dict) -> None:
    watchdog = asyncio.create_task(exit_with_parent(plan["parent_pid"]))
    try:
        if plan["role"] == "atari":
            await atari(args, plan)
        else:
            await Sweep(args, plan).run()
    finally:
        watchdog.cancel()


# -- the bench's main process: services, the load generator, the report -----------------------

def run_load_generators(argv: list[str], plans: list[dict], workdir: Path, timeout_s: float
                        ) -> tuple[list[dict], str | None]:
    """Runs this script once per plan as load-generator processes (each its own session), all
    at once, for at most ``timeout_s``; returns their JSON lines and, when one failed, why."""
    gens: list[Service] = []
    try:
        for plan in plans:
            tag = "".join(f"-{x}" for x in plan.get("phase", ())) + "".join(
                f"-{c}" for c in plan.get("clients", ()))
            name = f"load-generator-{plan['role']}{tag}"
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            gens.append(spawn(name, [sys.executable, str(Path(__file__).resolve()), *argv,
                                     "--load-generator", json.dumps(plan)],
                              workdir / f"{name}.log", env, stdout_path=workdir / f"{name}.out"))
        deadline = time.monotonic() + timeout_s
        lines, errors = [], []
        for gen in gens:
            try:
                code = gen.wait(timeout_s=max(1.0, deadline - time.monotonic()))
                error = f"load generator exited with {code}" if code else None
            except subprocess.TimeoutExpired:
                gen.kill()
                error = f"load generator killed after {timeout_s:.0f} s"
            out = (workdir / f"{gen.name}.out").read_text(errors="replace")
            lines += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if error:
                print(f"bench/fleet.py: {error}; {gen.log_path.name} ends:\n" + gen.log_tail(15),
                      file=sys.stderr)
                errors.append(f"{gen.name}: {error}")
    finally:
        for gen in gens:
            gen.kill()  # nothing if it has exited
    return lines, "; ".join(errors) or None


_OWNER = {
    # which client process measures what (the rest: the fleet's)
    "health_p99_ms": "probe", "info_p99_ms": "probe", "health_checks": "probe",
    "replay_rss_mb": "probe", "redis_used_mb": "probe", "replay_size": "probe",
    "sample_transitions_per_s": "learner", "sample_p99_ms": "learner", "updates": "learner",
    "learner_updates_per_s": "learner", "push_p50_ms": "learner",
    "update_priorities_p99_ms": "learner",
}
_SUMMED = ("resource_exhausted", "insert_deadline_exceeded", "errors_other", "load_generator_cpu_cores")


def merge_phase(records: list[dict]) -> dict:
    """One phase's record from its client processes' records (same N and pullers)."""
    by_role = {r["clients"][0]: r for r in records}
    merged = dict(by_role.get("fleet") or records[0])
    for key, role in _OWNER.items():
        if role in by_role:
            merged[key] = by_role[role].get(key)
    for key in _SUMMED:
        merged[key] = sum(r.get(key) or 0 for r in records)
    errors: dict = {}
    for r in records:
        for code, e in (r.get("errors_by_code") or {}).items():
            errors.setdefault(code, {"count": 0, "first": e["first"]})["count"] += e["count"]
    merged["errors_by_code"] = errors
    merged.pop("clients", None)
    return merged


def sweep_report(phases: list[dict], sizes: list[int]) -> dict:
    per_n = ["insert_transitions_per_s", "sample_transitions_per_s", "insert_p50_ms", "insert_p99_ms",
             "sample_p99_ms", "health_p99_ms", "info_p99_ms", "resource_exhausted",
             "insert_deadline_exceeded", "errors_other", "errors_by_code", "replay_rss_mb",
             "redis_used_mb", "replay_size", "learner_updates_per_s", "pulls", "pulls_unchanged",
             "paramserver_bytes_per_pull", "pull_p50_ms", "push_p50_ms", "update_priorities_p99_ms",
             "pull_interval_s", "pull_gap_median_s", "replay_cpu_cores", "paramserver_cpu_cores",
             "load_generator_cpu_cores"]
    out: dict = {}
    for n in sizes:
        with_p = next((p for p in phases if p["n"] == n and p["pullers"]), {})
        without = next((p for p in phases if p["n"] == n and not p["pullers"]), {})
        for key in per_n:
            out[f"{key}_{n}"] = with_p.get(key)
        base = without.get("learner_updates_per_s")
        out[f"learner_updates_per_s_no_pullers_{n}"] = base
        out[f"learner_updates_ratio_vs_no_pullers_{n}"] = (
            round(with_p["learner_updates_per_s"] / base, 3) if with_p and base else None)
        cpu_per_pull = None
        if with_p.get("pulls") and without.get("updates"):
            push_cpu = without["paramserver_cpu_s"] / without["updates"]
            cpu_per_pull = round((with_p["paramserver_cpu_s"] - push_cpu * with_p["updates"]) * 1e3
                                 / with_p["pulls"], 2)
        out[f"paramserver_cpu_ms_per_pull_{n}"] = cpu_per_pull
        out[f"errors_other_no_pullers_{n}"] = without.get("errors_other")
        out[f"errors_by_code_no_pullers_{n}"] = without.get("errors_by_code")
    return out


def _interrupted(signum, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: let the clean-up run
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per phase")
    p.add_argument("--warmup-s", type=float, default=2.0, help="seconds before each measurement")
    p.add_argument("--fleet-sizes", default="16,64,256", help="comma-separated N")
    p.add_argument("--only", choices=["sweep", "atari"], default=None)
    p.add_argument("--pull-encoding", choices=["fp32", "bf16", "fp16"], default="bf16",
                   help="weights encoding the pullers ask for (a bf16 actor's)")
    p.add_argument("--pull-interval-s", type=float, default=None,
                   help="pull every this many seconds per puller instead of every 400 env steps")
    p.add_argument("--grad-encoding", choices=["fp32", "bf16", "fp16", "onebit"], default=None,
                   help="pushed gradient's encoding (default: pong-apex's learner.grad_encoding)")
    p.add_argument("--batch-size", type=int, default=512, help="learner's Sample batch (sweep and Atari)")
    p.add_argument("--chunks-per-call", type=int, default=None,
                   help="chunks per Insert call (default: what cartpole-dqn's actor has unacknowledged "
                        "at most, max_unacked_transitions / chunk_transitions, up to 16)")
    p.add_argument("--samples-per-insert", type=float, default=None, help="default: cartpole-dqn's")
    p.add_argument("--capacity", type=int, default=None, help="replay capacity (default: cartpole-dqn's)")
    p.add_argument("--atari-transitions", type=int, default=32_000, help="Atari transitions stored first")
    p.add_argument("--atari-in-flight", type=int, default=4, help="Atari Sample calls kept in flight")
    p.add_argument("--load-generator", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.warmup_s < 0:
        p.error("--seconds must be > 0 and --warmup-s >= 0")
    if args.pull_interval_s is not None and args.pull_interval_s <= 0:
        p.error(f"--pull-interval-s {args.pull_interval_s}: must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.load_generator is not None:
        asyncio.run(load_generator(args, json.loads(args.load_generator)))
        return 0
    signal.signal(signal.SIGTERM, _interrupted)

    cartpole = load_config(CARTPOLE_CONFIG)
    pong = load_config(ATARI_CONFIG, ["paramserver.checkpoint_interval_s=0"])
    sizes = [int(s) for s in args.fleet_sizes.split(",") if s.strip()]
    rc = cartpole.replay
    spi = rc.samples_per_insert if args.samples_per_insert is None else args.samples_per_insert
    capacity = rc.capacity if args.capacity is None else args.capacity
    chunk = cartpole.actor.chunk_transitions
    chunks_per_call = args.chunks_per_call or max(1, min(MAX_CHUNKS_PER_CALL,
                                                         cartpole.actor.max_unacked_transitions // chunk))
    grad_encoding = args.grad_encoding or pong.learner.grad_encoding
    refresh = pong.actor.weight_refresh_steps
    result: dict = {
        "command": shlex.join([sys.argv[0], *argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        # the machine's other work shows here (the figures are only comparable when it is low)
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "settings": {
            "seconds_per_phase": args.seconds, "warmup_s": args.warmup_s, "fleet_sizes": sizes,
            "replay_capacity": capacity, "min_size_to_sample": rc.min_size_to_sample,
            "samples_per_insert": spi,
            # 0 = max(1, min_size_to_sample * samples_per_insert) (amprl.replay.ratelimiter)
            "samples_per_insert_error_buffer": rc.samples_per_insert_error_buffer
            or max(1.0, rc.min_size_to_sample * spi),
            "rate_limiter_from": "configs/cartpole-dqn.yaml",
            "chunk_transitions": chunk, "chunks_per_call": chunks_per_call,
            "insert_deadline_s": INSERT_DEADLINE_S,
            "insert_backoff": f"amprl.common.backoff (equal jitter, {Backoff().base_s} s doubling to {Backoff().cap_s} s), on "
                              "RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED",
            "sample_batch": args.batch_size, "sample_calls_in_flight": SAMPLE_CALLS_IN_FLIGHT,
            "sample_deadline_s": SAMPLE_DEADLINE_S, "prefetch_batches": PREFETCH_BATCHES,
            "push_deadline_s": PUSH_DEADLINE_S, "grad_encoding": grad_encoding,
            "pull_encoding": args.pull_encoding,
            "pull_interval_rule": (f"every {args.pull_interval_s} s per puller" if args.pull_interval_s
                                   else f"every {refresh} env steps (transitions stored) of its actor"),
            "health_every_s": HEALTH_EVERY_S, "health_deadline_s": HEALTH_DEADLINE_S,
            "info_every_s": INFO_EVERY_S,
            "network": "configs/pong-apex.yaml (Nature CNN, dueling)",
            "cpu_priorities": "all processes equal (no run.nice)",
        },
    }
    phase_s = args.warmup_s + args.seconds + 15.0  # + tear-down and the final Info
    try:
        with tempfile.TemporaryDirectory(prefix="amprl-bench-fleet-") as tmp:
            tmp = Path(tmp)
            if args.only in (None, "atari"):
                workdir = tmp / "atari"
                workdir.mkdir()
                with EmbeddedRedis(workdir / "redis") as redis:
                    replay = start_replay(workdir, redis.url, ATARI_SPEC, [
                        f"replay.capacity={max(capacity, args.atari_transitions)}",
                        "replay.min_size_to_sample=1000", "replay.samples_per_insert=0"])
                    try:
                        plan = {"role": "atari", "replay": replay.address, "replay_pid": replay.pid,
                                "chunk": pong.actor.chunk_transitions, "parent_pid": os.getpid()}
                        lines, error = run_load_generators(argv, [plan], workdir,
                                                          120.0 + args.atari_transitions / 500 + phase_s)
                    finally:
                        replay.stop()
                for line in lines:
                    result.update(line)
                if error:
                    result["atari_load_generator_error"] = error
            if args.only in (None, "sweep"):
                workdir = tmp / "sweep"
                (workdir / "logs").mkdir(parents=True)
                dump_config(pong, workdir / "config.yaml")
                with EmbeddedRedis(workdir / "redis") as redis:
                    replay = start_replay(workdir, redis.url, CARTPOLE_SPEC, [
                        f"replay.capacity={capacity}", f"replay.min_size_to_sample={rc.min_size_to_sample}",
                        f"replay.samples_per_insert={spi}",
                        f"replay.samples_per_insert_error_buffer={rc.samples_per_insert_error_buffer}"])
                    services = []
                    try:
                        services.append(start_service(
                            "paramserver", "amprl.paramserver",
                            ["--config", str(workdir / "config.yaml"), "--run-dir", str(workdir),
                             "--host", "127.0.0.1", "--log-level", "WARNING"], workdir / "logs"))
                        wait_for_port(services[0])
                        plan = {"role": "sweep", "replay": replay.address, "replay_pid": replay.pid,
                                "paramserver": services[0].address, "paramserver_pid": services[0].pid,
                                "config": str(workdir / "config.yaml"),
                                "chunk": chunk, "chunks_per_call": chunks_per_call,
                                "grad_encoding": grad_encoding, "refresh_steps": refresh,
                                "parent_pid": os.getpid()}
                        # One load-generator process per phase: its exit closes every
                        # connection, so no call of a phase outlives it (grpc.aio clients
                        # that cancel calls and close channels have been seen to leave the
                        # server holding some, which then queued ahead of the next phase).
                        # Per phase, three client processes: the fleet (actors, pullers), the
                        # learner, and the probe (health, Info), each on its own event loop as
                        # a real learner and a kubelet are, so that one's backlog never shows
                        # up in another's timings; and new ones each phase, whose exit closes
                        # every connection, so no call of a phase can outlive it.
                        lines, errors = [], []
                        for n in sizes:
                            for pullers in (False, True):
                                start_at = time.time() + PHASE_SETUP_S
                                got, error = run_load_generators(
                                    argv, [{**plan, "phase": [n, pullers], "clients": [c],
                                            "start_at": start_at}
                                           for c in ("fleet", "learner", "probe")],
                                    workdir, 120.0 + PHASE_SETUP_S + phase_s)
                                phase_records = [r for r in got if "n" in r]
                                if phase_records:
                                    lines.append(merge_phase(phase_records))
                                lines += [r for r in got if "n" not in r]
                                if error:
                                    errors.append(f"N={n} pullers={pullers}: {error}")
                        error = "; ".join(errors) or None
                    finally:
                        stop_services(services)
                        replay.stop()
                phases = [line for line in lines if "n" in line]
                for line in lines:
                    if "n" not in line:
                        result["settings"].update(line)
                result.update(sweep_report(phases, sizes))
                if error:
                    result["sweep_load_generator_error"] = error
    except KeyboardInterrupt:
        print("bench/fleet.py: interrupted; every child process stopped", file=sys.stderr)
        return 130
    result["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
