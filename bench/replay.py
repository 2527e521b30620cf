"""Replay service throughput over gRPC on loopback, against an embedded real Redis.

The service runs as its own process (``python -m amprl.replay``); this process is the
client. Prints ONE JSON object:

  insert_transitions_per_s, sample_transitions_per_s (batch 256)   CartPole-sized
  atari_insert_transitions_per_s, atari_sample_transitions_per_s (batch 32)
  atari_redis_bytes_per_transition   Redis used_memory delta / transitions stored
  atari_frames_source                "ale-py Pong" or "synthetic"

Insert requests are built before timing (that is the actor's work, not replay's); several
streams insert concurrently as several actors would. Sampling keeps a few requests in
flight as a prefetching learner does.

    python bench/replay.py [--seconds 5] [--cartpole-transitions 400000] [--durability always] ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from amprl.common.channels import wait_until_serving
from amprl.common.redis_server import EmbeddedRedis
from amprl.launch.procs import Service, spawn, wait_for_port
from amprl.replay.client import ReplayClient, insert_request, sampled_batch_from_proto
from amprl.rl.transitions import Chunk

ATARI_SIZE = 84


# -- frames -------------------------------------------------------------------------------

def _resize_matrix(n_out: int, n_in: int) -> np.ndarray:
    """Area-averaging resize as a matrix: out = R @ in (cv2.INTER_AREA-like)."""
    r = np.zeros((n_out, n_in), dtype=np.float32)
    scale = n_in / n_out
    for i in range(n_out):
        lo, hi = i * scale, (i + 1) * scale
        for j in range(int(lo), min(int(np.ceil(hi)), n_in)):
            r[i, j] = min(hi, j + 1) - max(lo, j)
        r[i] /= r[i].sum()
    return r


def pong_frames(n: int, seed: int = 0) -> tuple[np.ndarray, str]:
    """n preprocessed 84x84 grayscale Pong frames (frame skip 4, random play), or
    synthetic Pong-like frames when ale-py is not installed."""
    try:
        import ale_py
        import gymnasium as gym
    except ImportError:
        return synthetic_pong(n, seed), "synthetic (ale-py not installed)"
    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", obs_type="grayscale", frameskip=4,
                   repeat_action_probability=0.25)
    rows, cols = _resize_matrix(ATARI_SIZE, 210), _resize_matrix(ATARI_SIZE, 160)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    out = np.empty((n, ATARI_SIZE, ATARI_SIZE), dtype=np.uint8)
    for i in range(n):
        out[i] = np.clip(rows @ obs.astype(np.float32) @ cols.T + 0.5, 0, 255).astype(np.uint8)
        obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
        if term or trunc:
            obs, _ = env.reset()
    env.close()
    return out, "ale-py ALE/Pong-v5 (grayscale, frameskip 4, area-resized to 84x84)"


def synthetic_pong(n: int, seed: int = 0) -> np.ndarray:
    """Pong-like frames: flat background, walls, two paddles, a ball, a score."""
    rng = np.random.default_rng(seed)
    frames = np.full((n, ATARI_SIZE, ATARI_SIZE), 87, dtype=np.uint8)
    frames[:, 14:17, :] = 236
    frames[:, 80:83, :] = 236
    for i in range(n):
        y1, y2 = 20 + (i * 3) % 50, 20 + int(rng.integers(50))
        frames[i, y1:y1 + 8, 8:10] = 147
        frames[i, y2:y2 + 8, 74:76] = 123
        by, bx = 18 + (i * 5) % 60, 10 + (i * 7) % 64
        frames[i, by:by + 2, bx:bx + 1] = 236
        frames[i, 2:10, 20:26] = 150 + (i // 200) % 3
    return frames


# -- chunks -------------------------------------------------------------------------------

def make_chunk(frames: np.ndarray, t: int, stack: int, n_step: int, num_actions: int,
               rng: np.random.Generator) -> Chunk:
    """T consecutive transitions over F = T + stack - 1 + n_step frames."""
    obs = np.arange(t, dtype=np.int32)[:, None] + np.arange(stack, dtype=np.int32)[None, :]
    return Chunk(frames=frames, obs_idx=obs, next_obs_idx=obs + n_step,
                 actions=rng.integers(num_actions, size=t).astype(np.int64),
                 rewards=rng.standard_normal(t).astype(np.float32),
                 discounts=np.full(t, 0.99 ** n_step, dtype=np.float32))


# -- service process ----------------------------------------------------------------------

def start_replay(workdir: Path, redis_url: str, spec: dict, sets: list[str]) -> Service:
    """A replay process for the env ``spec`` (with this process's environment), serving;
    ``.stop()`` it when done."""
    port_file = workdir / "replay.port"
    cmd = [sys.executable, "-m", "amprl.replay", "--host", "127.0.0.1", "--port", "0",
           "--port-file", str(port_file), "--redis-url", redis_url,
           "--spec-json", json.dumps(spec), "--log-level", "WARNING"]
    for s in sets:
        cmd += ["--set", s]
    replay = spawn("replay", cmd, workdir / "replay.log", port_file=port_file)
    try:  # whatever stops the start (Ctrl-C included) stops the process too
        wait_for_port(replay, timeout_s=60)
        wait_until_serving(replay.address)
    except BaseException:
        replay.stop()
        raise
    return replay


def run_inserts(address: str, requests: list, total_chunks: int, streams: int,
                chunks_per_call: int) -> float:
    """Inserts total_chunks chunks (cycling through ``requests``) over ``streams``
    concurrent Insert streams; returns seconds taken."""
    per_stream = total_chunks // streams
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with ReplayClient(address) as client:
                done = 0
                while done < per_stream:
                    n = min(chunks_per_call, per_stream - done)
                    base = (k * 7919 + done) % len(requests)
                    client.insert_requests(requests[(base + i) % len(requests)] for i in range(n))
                    done += n
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(streams)]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def run_samples(address: str, batch_size: int, seconds: float, in_flight: int) -> float:
    """Samples (and decodes) batches for ``seconds``; returns transitions per second."""
    with ReplayClient(address) as client:
        client.sample(batch_size, 0.4)  # warm up
        pending: deque = deque(client.sample_future(batch_size, 0.4) for _ in range(in_flight))
        n = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            resp = pending.popleft().result()
            pending.append(client.sample_future(batch_size, 0.4))
            batch = sampled_batch_from_proto(resp)
            n += len(batch)
        elapsed = time.perf_counter() - start
        for f in pending:
            f.result()
    return n / elapsed


def bench_cartpole(args, workdir: Path) -> dict:
    rng = np.random.default_rng(0)
    t = args.cartpole_chunk
    frames_n = t + args.n_step
    requests = [insert_request("bench", make_chunk(rng.standard_normal((frames_n, 4)).astype(np.float32),
                                                   t, 1, args.n_step, 2, rng),
                               rng.uniform(0.1, 2.0, t).astype(np.float32), t)
                for _ in range(64)]
    spec = {"frame_shape": [4], "frame_dtype": "float32", "frame_stack": 1, "discrete": True,
            "num_actions": 2}
    with EmbeddedRedis(workdir / "redis-cartpole") as redis_server:
        proc = start_replay(workdir, redis_server.url, spec,
                            [f"replay.capacity={args.capacity}", "replay.min_size_to_sample=1000",
                             f"replay.durability={args.durability}"])
        try:
            chunks = args.cartpole_transitions // t
            elapsed = run_inserts(proc.address, requests, chunks, args.streams, args.chunks_per_call)
            insert_rate = chunks * t / elapsed
            sample_rate = run_samples(proc.address, 256, args.seconds, args.in_flight)
        finally:
            proc.stop()
    return {"insert_transitions_per_s": round(insert_rate),
            "sample_transitions_per_s": round(sample_rate),
            "cartpole_chunk_transitions": t}


def bench_atari(args, workdir: Path) -> dict:
    rng = np.random.default_rng(1)
    t, stack, n_step = args.atari_chunk, 4, args.n_step
    f = t + stack - 1 + n_step
    num_distinct = 24
    frames, source = pong_frames(num_distinct * f)
    requests = [insert_request("bench", make_chunk(frames[i * f:(i + 1) * f], t, stack, n_step, 6, rng),
                               rng.uniform(0.1, 2.0, t).astype(np.float32), t)
                for i in range(num_distinct)]
    spec = {"frame_shape": [ATARI_SIZE, ATARI_SIZE], "frame_dtype": "uint8", "frame_stack": stack,
            "discrete": True, "num_actions": 6}
    chunks = args.atari_transitions // t
    capacity = max(args.capacity, chunks * t)  # nothing evicted: bytes/transition is exact
    with EmbeddedRedis(workdir / "redis-atari") as redis_server:
        proc = start_replay(workdir, redis_server.url, spec,
                            [f"replay.capacity={capacity}", "replay.min_size_to_sample=1000",
                             f"replay.durability={args.durability}"])
        try:
            with ReplayClient(proc.address) as client:
                before = client.info().redis_used_memory_bytes
                elapsed = run_inserts(proc.address, requests, chunks, args.streams, args.chunks_per_call)
                info = client.info()
                bytes_per = (info.redis_used_memory_bytes - before) / info.size
            insert_rate = chunks * t / elapsed
            sample_rate = run_samples(proc.address, 32, args.seconds, args.in_flight)
        finally:
            proc.stop()
    return {"atari_insert_transitions_per_s": round(insert_rate),
            "atari_sample_transitions_per_s": round(sample_rate),
            "atari_redis_bytes_per_transition": round(bytes_per, 1),
            "atari_frames_source": source,
            "atari_chunk_transitions": t,
            "atari_transitions_stored": int(info.size)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="sampling time per phase")
    p.add_argument("--cartpole-transitions", type=int, default=400_000)
    p.add_argument("--atari-transitions", type=int, default=64_000)
    p.add_argument("--cartpole-chunk", type=int, default=64, help="transitions per chunk")
    p.add_argument("--atari-chunk", type=int, default=64, help="transitions per chunk")
    p.add_argument("--capacity", type=int, default=100_000)
    p.add_argument("--n-step", type=int, default=3)
    p.add_argument("--streams", type=int, default=2, help="concurrent Insert streams (actors)")
    p.add_argument("--chunks-per-call", type=int, default=50, help="chunks per Insert stream")
    p.add_argument("--in-flight", type=int, default=4, help="Sample calls kept in flight")
    p.add_argument("--only", choices=["cartpole", "atari"], default=None)
    p.add_argument("--durability", choices=["everysec", "always"], default="everysec",
                   help="replay.durability (Redis's appendfsync)")
    args = p.parse_args(argv)
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="amprl-bench-replay-") as tmp:
        workdir = Path(tmp)
        if args.only in (None, "cartpole"):
            result.update(bench_cartpole(args, workdir))
        if args.only in (None, "atari"):
            result.update(bench_atari(args, workdir))
    result["cpus"] = os.cpu_count()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
