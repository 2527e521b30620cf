"""Learner throughput across a slow link to the parameter server.

    python bench/latency.py [--config configs/cartpole-dqn-wan.yaml] [--seconds 8] [--repeats 3]

Starts Redis, replay and the parameter server as processes on loopback, fills replay with
synthetic CartPole transitions (rate limiter off), and runs the real Learner in-process
against the parameter server *through a DelayRelay process* (listens on 127.0.0.1:0,
forwards to the server's port, RTT/2 added to each direction) for RTT 0, 100 and 300 ms.
Replay stays on plain loopback (co-located with the learner). RTTs are interleaved
within each repeat so that load drift on a shared machine hits them all alike; medians of
``--repeats`` runs of ``--seconds`` each.

Prints one JSON object: ``updates_per_s_{0,100,300}ms`` (batches trained per second),
``pushes_per_s_*`` (optimizer steps sent), ``versions_per_s_*`` (applied on the server),
``batches_per_push_*``, ``push_rtt_ms_*``, stale rejections, the window used, and
``updates_ratio_300ms`` = updates/s at 300 ms / at 0 ms, and the largest staleness the
server accepted. With ``--baseline`` (default on) it also measures the same experiment
with a plain bounded window (``learner.sync: overlapped``, 2 pushes in flight, no accumulation) at
0 and 300 ms, once each, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import testing_path  # noqa: F401  (amprl_testing on the path)
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import dump_config, load_config
from amprl.envs.factory import env_spec
from amprl.launch.procs import Service, spawn, start_service, stop_services, wait_for_port
from amprl.learner.learner import Learner
from amprl.paramserver.client import ParameterClient
from amprl.replay.client import ReplayClient
from amprl_testing.replay import fill_replay

ROOT = Path(__file__).resolve().parents[1]
RTTS_MS = (0, 100, 300)


def start_relay(target_port: int, rtt_ms: float, log_dir: Path) -> Service:
    """A DelayRelay process on 127.0.0.1:0 -> 127.0.0.1:target_port adding rtt_ms/2 each
    way, listening (its ``.address``), logging to ``log_dir/relay.log``. Its own process, so
    it does not share a GIL with whatever dials it."""
    port_file = log_dir / ".relay.port"
    relay = spawn("relay", [sys.executable, "-m", "amprl_testing.netsim.relay", "--listen", "127.0.0.1:0",
                            "--target", f"127.0.0.1:{target_port}", "--delay-ms", str(rtt_ms / 2),
                            "--log-level", "WARNING", "--port-file", str(port_file)],
                  log_dir / "relay.log", port_file=port_file)
    try:
        wait_for_port(relay, timeout_s=30)
    except BaseException:
        relay.stop(timeout_s=5)
        raise
    return relay


def measure(cfg, spec, replay_addr: str, ps_port: int, info: ParameterClient, rtt_ms: float,
            seconds: float, log_dir: Path) -> dict:
    relay = start_relay(ps_port, rtt_ms, log_dir)
    learner = Learner(cfg, spec, ReplayClient(replay_addr),
                      ParameterClient(relay.address, client_id="learner:bench-latency"),
                      learner_id="bench-latency", device="cpu")
    try:
        learner.start()
        stop = threading.Event()
        learner.run(stop, max_updates=20)  # warm up: queue filled, first pushes and pulls
        s0 = learner.stats
        u0, p0, r0 = s0.updates, s0.pushes, s0.stale_rejections
        v0, t0 = info.info().version, time.perf_counter()
        timer = threading.Timer(seconds, stop.set)
        timer.start()
        learner.run(stop)
        dt = time.perf_counter() - t0
        s = learner.stats
        updates, pushes, rejected = s.updates - u0, s.pushes - p0, s.stale_rejections - r0
        learner.stop()
        versions = info.info().version - v0
    finally:
        learner._stop.set()
        learner.ps.close()
        learner.replay.close()
        relay.stop(timeout_s=5)
    return {"updates_per_s": updates / dt, "pushes_per_s": pushes / dt,
            "versions_per_s": versions / dt, "batches_per_push": updates / max(1, pushes),
            "push_rtt_ms": s.push_rtt_ms, "stale_rejections": rejected, "push_errors": s.push_errors,
            "window": learner.window}


def med(runs: list[dict], key: str, digits: int = 1) -> float:
    return round(statistics.median(r[key] for r in runs), digits)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs/cartpole-dqn-wan.yaml"))
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-baseline", dest="baseline", action="store_false")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    torch.set_num_threads(1)
    fixed = ["replay.samples_per_insert=0", "replay.min_size_to_sample=1000",
             "paramserver.checkpoint_interval_s=0", "learner.device=cpu"]
    cfg = load_config(args.config, args.overrides + fixed)
    # the same experiment with the plain bounded window of configs/cartpole-dqn.yaml
    base = load_config(args.config, args.overrides + fixed + [
        "learner.sync=overlapped", "learner.max_pushes_in_flight=2",
        "learner.max_batches_per_push=1", "learner.pull_lag_versions=1", "learner.steps_per_push=1"])
    spec = env_spec(cfg.env)
    runs: dict[int, list[dict]] = {r: [] for r in RTTS_MS}
    baseline: dict[int, dict] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="amprl-bench-latency-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "logs").mkdir()
        dump_config(cfg, run_dir / "config.yaml")
        with EmbeddedRedis(run_dir / "redis") as redis:
            common = ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir), "--host", "127.0.0.1"]
            services = [start_service("replay", "amprl.replay", common + ["--redis-url", redis.url], run_dir / "logs"),
                        start_service("paramserver", "amprl.paramserver", common, run_dir / "logs")]
            try:
                for s in services:
                    wait_for_port(s)
                replay_addr, ps_port = services[0].address, services[1].port
                with ReplayClient(replay_addr) as replay:
                    fill_replay(replay, spec, 20_000, np.random.default_rng(0))
                with ParameterClient(services[1].address, client_id="bench-info") as info:
                    for _ in range(args.repeats):
                        for rtt in RTTS_MS:
                            runs[rtt].append(measure(cfg, spec, replay_addr, ps_port, info, rtt,
                                                     args.seconds, run_dir / "logs"))
                    max_staleness_accepted = info.info().max_staleness
                    if args.baseline:
                        for rtt in (0, 300):
                            baseline[rtt] = measure(base, spec, replay_addr, ps_port, info, rtt,
                                                    args.seconds, run_dir / "logs")
            finally:
                stop_services(services)
    out: dict = {"config": Path(args.config).name, "overrides": args.overrides,
                 "seconds_per_measurement": args.seconds, "repeats": args.repeats,
                 "device": "cpu", "torch_threads": 1, "grad_encoding": cfg.learner.grad_encoding,
                 "batch_size": cfg.learner.batch_size,
                 "window": runs[0][0]["window"], "max_batches_per_push": cfg.learner.max_batches_per_push,
                 "max_staleness": cfg.paramserver.max_staleness,
                 "sync": cfg.learner.sync,
                 "max_staleness_accepted": max_staleness_accepted,
                 "relay": "amprl_testing.netsim.relay process on 127.0.0.1, RTT/2 each way (0 ms: same relay, no delay)",
                 "loadavg_1min_before_after": [round(load_before, 1), round(os.getloadavg()[0], 1)],
                 "cpus": os.cpu_count()}
    for rtt in RTTS_MS:
        for key, digits in (("updates_per_s", 1), ("pushes_per_s", 1), ("versions_per_s", 1),
                            ("batches_per_push", 2), ("push_rtt_ms", 1)):
            out[f"{key}_{rtt}ms"] = med(runs[rtt], key, digits)
        out[f"updates_per_s_{rtt}ms_runs"] = [round(r["updates_per_s"], 1) for r in runs[rtt]]
        out[f"stale_rejections_{rtt}ms"] = sum(r["stale_rejections"] for r in runs[rtt])
        out[f"push_errors_{rtt}ms"] = sum(r["push_errors"] for r in runs[rtt])
    out["updates_ratio_300ms"] = round(out["updates_per_s_300ms"] / out["updates_per_s_0ms"], 3)
    out["updates_ratio_100ms"] = round(out["updates_per_s_100ms"] / out["updates_per_s_0ms"], 3)
    if baseline:
        out["baseline_plain_window"] = {
            "window": baseline[0]["window"], "max_batches_per_push": 1,
            **{f"updates_per_s_{r}ms": round(baseline[r]["updates_per_s"], 1) for r in baseline},
            "updates_ratio_300ms": round(baseline[300]["updates_per_s"] / baseline[0]["updates_per_s"], 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
