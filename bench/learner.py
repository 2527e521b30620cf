"""Learner throughput: the learner's own path vs a plain PyTorch loop on the same update.

    python bench/learner.py [--seconds 8] [--repeats 3] [--cases ...] [--precisions fp32,bf16]
    python bench/learner.py --cases atari256,atari512 --precisions fp32,bf16,fp16 --device cuda

For each case (CartPole DQN; a larger MLP Q-network 256x256 at batch 256; TD3 for
HalfCheetah-v5 at batch 256: actor and twin critics 256x256, critic loss every update, actor
loss and Polyak targets every 2nd; on request, ``atari256``/``atari512``: the Ape-X Nature
CNN with dueling heads of configs/pong-apex.yaml at batch 256 / 512, uint8 frame stacks cast
on the device) and precision (fp32, bf16, fp16 with its GradScaler) it measures, in one run:
  * ``plain_torch_updates_per_s``: forward, backward, clip, Adam step and target update on
    one batch in a loop;
  * ``updates_per_s``: the real Learner — batches from its prefetch queue (sampled from a live
    replay service), gradients pushed to a live parameter server (separate processes), with
    the experiment config's own push settings: the DQN cases as cartpole-dqn.yaml (one push
    in flight, applied to the learner's replica too, ``sync: local_replica``: the learner runs the
    same Adam step as the plain loop and re-bases onto the server's weights every 64
    pushes; 4 steps per call with bf16 gradients), TD3 as halfcheetah-td3.yaml (two pushes in flight, new weights pulled back in
    the background);
and prints one JSON object with the medians over ``--repeats`` and ``updates_ratio_vs_plain``
(and, per repeat, ``<case>_<precision>_updates_ratio_per_repeat``).
Where the CPU goes: ``<case>_<precision>_cpu_ms_per_update`` is the CPU time per update, over
the measured window, of this process (``learner``: the update thread and its prefetch,
priority and push threads; medians over repeats) and of each service process (``replay``,
``paramserver``, ``redis``); ``..._plain_cpu_ms_per_update`` the plain loop's;
``..._thread_cpu_ms_per_update`` the learner's process split by thread (``MainThread`` is
the update loop). On a 2-core machine the learner's rate is bounded by its own CPU and by
half the sum of all of them.
Where the update thread's time goes: ``<case>_<precision>_update_thread_ms_per_update``
splits its wall time per update (the plain loop's: ``..._plain_update_thread_ms_per_update``)
into ``on_cpu``, ``runqueue_wait`` (runnable, but its CPU was running another thread or
process) and ``other_wait`` (the rest: blocked, mostly on the GIL while a helper thread
runs Python, or on a full push window), from the kernel's per-thread ``schedstat``.
On CUDA (``--device``, default: CUDA when present) it also records the peak GPU memory
allocated by each loop (``<case>_<precision>_peak_mem_mib`` for the learner,
``..._plain_peak_mem_mib`` for the plain loop).

The services and Redis run at the CPU priority ``amprl run`` gives them (``deploy.nice``,
default: 19 steps below the learner; ``--set deploy.nice.replay=0`` etc. for equal ones): on
2 shared cores the update thread then waits ~0.13 ms per MLP update for a core instead of
~0.4-0.5 ms (docs/tuning.md, "Who gets the core first").

``--pin`` gives the learner's update thread (and the plain loop) CPU 0 alone
(``deploy.pin_learner_update_thread``) and moves the learner's other threads, replay, the
parameter server and Redis to the other CPUs, as when the learner has a core of its own (a
learner pod with dedicated cores under Kubernetes' static CPU manager; the services on other
hosts or cores): on a shared pair of cores at equal priority the update thread otherwise
waited ~1 ms per MLP update for a core that a service or helper took (``runqueue_wait``;
~0.13 ms at ``deploy.nice``'s default).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import redis as redis_py
import torch

import testing_path  # noqa: F401  (amprl_testing on the path)
from amprl.algos import build_model, builder
from amprl.common.redis_server import EmbeddedRedis
from amprl.config import dump_config, load_config
from amprl.envs.factory import env_spec
from amprl.launch.procs import set_nice, start_service, stop_services, wait_for_port
from amprl.learner.learner import Learner
from amprl.paramserver.client import ParameterClient
from amprl.replay.client import ReplayClient
from amprl_testing.replay import fill_replay

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from push import process_cpu_s, stat_cpu_s  # noqa: E402

CASES = {  # name -> (experiment, overrides)
    "cartpole": ("configs/cartpole-dqn.yaml", ["learner.batch_size=128", "network.hidden_sizes=[128, 128]"]),
    "mlp256": ("configs/cartpole-dqn.yaml", ["learner.batch_size=256", "network.hidden_sizes=[256, 256]"]),
    "td3": ("configs/halfcheetah-td3.yaml", ["learner.batch_size=256", "network.hidden_sizes=[256, 256]"]),
    # not in the default set: seconds per update on a CPU
    "atari256": ("configs/pong-apex.yaml", ["learner.batch_size=256"]),
    "atari512": ("configs/pong-apex.yaml", ["learner.batch_size=512"]),
}
DEFAULT_CASES = "cartpole,mlp256,td3"



def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of this process (all its threads) and of each service process."""
    return {"learner": time.process_time(), **{name: process_cpu_s(pid) for name, pid in pids.items()}}


def cpu_ms_per_update(before: dict[str, float], after: dict[str, float], updates: int) -> dict[str, float]:
    return {name: (after[name] - before[name]) * 1e3 / max(1, updates) for name in before}


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of each live thread of this process, by name: the Python name
    (``MainThread`` runs the update loop; ``learner-prefetch``, ``learner-priorities``,
    ``ps-push_0``, ...), else the OS name (gRPC's ``event_engine`` threads, summed)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm, cpu = stat_cpu_s(f"/proc/self/task/{tid}/stat")
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + cpu
    return out


def update_thread_ns() -> tuple[int, int, int] | None:
    """(on-CPU ns, runqueue-wait ns, wall ns) so far of the calling thread, from the
    kernel's schedstat; None where the kernel does not keep it."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, waited, _ = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return on_cpu, waited, time.perf_counter_ns()


def update_thread_ms(before, after, updates: int) -> dict[str, float]:
    """On-CPU, runqueue-wait and other-wait ms per update between two ``update_thread_ns``."""
    if before is None or after is None:
        return {}
    on_cpu, waited, wall = ((b - a) / 1e6 / max(1, updates) for a, b in zip(before, after))
    return {"on_cpu": on_cpu, "runqueue_wait": waited, "other_wait": max(0.0, wall - on_cpu - waited)}


def plain_loop(cfg, spec, sampled, seconds: float, device: torch.device) -> tuple[float, dict]:
    torch.manual_seed(0)
    cfg = copy.deepcopy(cfg)
    cfg.learner.overlap_targets = False  # plain: the whole update on this thread
    model = build_model(cfg, spec).to(device)
    algo = builder(cfg.algo).make_learner(cfg, model, device)
    batch, _ = algo.to_tensors(sampled)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.paramserver.lr)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.learner.precision)
    # fp16: the learner's loss scaling (Precision), as a plain loop would write it
    scaler = torch.amp.GradScaler(device.type, init_scale=65536.0) if dtype == torch.float16 else None

    def step(n: int) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss, _ = algo.loss(batch, n)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.grad_clip_norm)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        algo.on_weights(n + 1)  # target network: DQN's periodic copy, TD3's Polyak step

    warmup = 5  # as the learner's loop warms up: CUDA's lazy init and kernel choice stay out
    for i in range(warmup):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    n, t0, cpu0, sched0 = 0, time.perf_counter(), cpu_seconds({}), update_thread_ns()
    while time.perf_counter() - t0 < seconds:
        step(warmup + n)
        n += 1
        if device.type == "cuda" and n % 20 == 0:
            torch.cuda.synchronize()  # the clock must see the work, not its launch
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = n / (time.perf_counter() - t0)
    cpu = cpu_ms_per_update(cpu0, cpu_seconds({}), n)
    cpu["update_thread"] = update_thread_ms(sched0, update_thread_ns(), n)
    algo.close()
    return rate, cpu


def learner_loop(cfg, spec, replay_addr, ps_addr, seconds: float, device: torch.device,
                 pids: dict[str, int]) -> tuple[float, dict]:
    learner = Learner(cfg, spec, ReplayClient(replay_addr), ParameterClient(ps_addr, client_id="learner:bench"),
                      learner_id="bench", device=str(device))
    learner.start()
    stop = threading.Event()
    learner.run(stop, max_updates=20)  # warm up: fill the queue, first pulls
    start_updates, t0, cpu0 = learner.stats.updates, time.perf_counter(), cpu_seconds(pids)
    threads0, sched0 = thread_cpu_seconds(), update_thread_ns()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    learner.run(stop)
    rate = (learner.stats.updates - start_updates) / (time.perf_counter() - t0)
    updates = learner.stats.updates - start_updates
    cpu = cpu_ms_per_update(cpu0, cpu_seconds(pids), updates)
    cpu["update_thread"] = update_thread_ms(sched0, update_thread_ns(), updates)
    threads1 = thread_cpu_seconds()  # before stop(): the helper threads are still alive
    cpu["threads"] = cpu_ms_per_update({n: threads0.get(n, 0.0) for n in threads1}, threads1, updates)
    learner.stop()
    # close the channels: their gRPC threads would otherwise compete with the next
    # measurement (on one core with --pin, the next learner ran at half speed)
    learner.ps.close()
    learner.replay.close()
    return rate, cpu


def pin(services, redis, cpus: list[int]) -> None:
    """The service processes and Redis on all of ``cpus`` but the first (the learner's
    update thread pins itself to that one: ``deploy.pin_learner_update_thread``)."""
    for pid in [s.proc.pid for s in services] + [redis.pid]:
        for tid in os.listdir(f"/proc/{pid}/task"):  # affinity is per thread
            os.sched_setaffinity(int(tid), set(cpus[1:]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--pin", action="store_true",
                   help="learner on CPU 0, replay, parameter server and Redis on the others")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated subset of " + ",".join(CASES))
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated subset of fp32,bf16,fp16")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="extra config overrides, e.g. learner.sync=synchronous")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2:
        raise SystemExit("--pin needs at least 2 CPUs")
    torch.set_num_threads(1)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    results: dict = {"seconds_per_measurement": args.seconds, "repeats": args.repeats,
                     "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                     "torch_threads": 1, "pinned": args.pin}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="amprl-bench-learner-") as tmp:
        tmp = Path(tmp)
        with EmbeddedRedis(tmp / "redis") as redis:
            for case in args.cases.split(","):
                experiment, overrides = CASES[case]
                for precision in args.precisions.split(","):
                    cfg = load_config(ROOT / experiment, overrides + [
                        f"learner.precision={precision}", "replay.samples_per_insert=0",
                        "replay.min_size_to_sample=1000", "paramserver.checkpoint_interval_s=0"]
                        + (["deploy.pin_learner_update_thread=true"] if args.pin else []) + args.overrides)
                    spec = env_spec(cfg.env)
                    run_dir = tmp / f"{case}-{precision}"
                    (run_dir / "logs").mkdir(parents=True)
                    dump_config(cfg, run_dir / "config.yaml")
                    common = ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir), "--host", "127.0.0.1"]
                    redis_py.Redis.from_url(redis.url).flushall()
                    # CPU priorities as `amprl run` sets them (deploy.nice): the learner first
                    nice = cfg.deploy.nice
                    results["nice"] = {"replay": nice.replay, "paramserver": nice.paramserver, "redis": nice.redis}
                    set_nice(redis.pid, nice.redis)
                    services = [start_service("replay", "amprl.replay", common + ["--redis-url", redis.url],
                                              run_dir / "logs", nice=nice.replay),
                                start_service("paramserver", "amprl.paramserver", common, run_dir / "logs",
                                              nice=nice.paramserver)]
                    try:
                        for s in services:
                            wait_for_port(s)
                        if args.pin:
                            pin(services, redis, cpus)
                        replay = ReplayClient(services[0].address)
                        image = spec.frame_dtype == np.uint8
                        # image chunks of 250 stay well inside gRPC's 4 MiB message limit
                        fill_replay(replay, spec, max(2_000, 4 * cfg.learner.batch_size) if image else 20_000,
                                    rng, chunk=250 if image else 500)
                        sampled = replay.sample(cfg.learner.batch_size, 0.4, timeout=30)
                        pids = {"replay": services[0].proc.pid, "paramserver": services[1].proc.pid,
                                "redis": redis.pid}
                        plain, ours, plain_mem, ours_mem, plain_cpu, ours_cpu = [], [], [], [], [], []
                        for _ in range(args.repeats):
                            for loop, rates, mems, costs in (
                                    (lambda: plain_loop(cfg, spec, sampled, args.seconds, device),
                                     plain, plain_mem, plain_cpu),
                                    (lambda: learner_loop(cfg, spec, services[0].address, services[1].address,
                                                          args.seconds, device, pids),
                                     ours, ours_mem, ours_cpu)):
                                if cuda:
                                    torch.cuda.empty_cache()
                                    torch.cuda.reset_peak_memory_stats(device)
                                # with --pin the plain loop runs on the learner's update CPU (the
                                # learner pins and, at stop, unpins its own threads)
                                pin_plain = args.pin and rates is plain
                                if pin_plain:
                                    os.sched_setaffinity(0, {cpus[0]})
                                rate, cpu = loop()
                                if pin_plain:
                                    os.sched_setaffinity(0, set(cpus))
                                rates.append(rate)
                                costs.append(cpu)
                                if cuda:
                                    mems.append(torch.cuda.max_memory_allocated(device) / 2**20)
                        replay.close()
                    finally:
                        stop_services(services)
                    key = f"{case}_{precision}"
                    results[f"{key}_updates_per_s"] = round(statistics.median(ours), 1)
                    results[f"{key}_plain_torch_updates_per_s"] = round(statistics.median(plain), 1)
                    results[f"{key}_updates_ratio_vs_plain"] = round(statistics.median(ours) / statistics.median(plain), 3)
                    # each repeat's own pair (the two loops run back to back): the spread shows
                    # how much of a difference between runs is this machine's noise
                    results[f"{key}_updates_ratio_per_repeat"] = [round(o / q, 3) for o, q in zip(ours, plain)]
                    threads = [c.pop("threads") for c in ours_cpu]
                    waits = [c.pop("update_thread") for c in ours_cpu]
                    plain_waits = [c.pop("update_thread") for c in plain_cpu]
                    for name, costs in (("cpu_ms_per_update", ours_cpu), ("plain_cpu_ms_per_update", plain_cpu),
                                        ("thread_cpu_ms_per_update", threads),
                                        ("update_thread_ms_per_update", waits),
                                        ("plain_update_thread_ms_per_update", plain_waits)):
                        results[f"{key}_{name}"] = {
                            proc: round(statistics.median(c.get(proc, 0.0) for c in costs), 3)
                            for proc in sorted({p for c in costs for p in c})
                            if statistics.median(c.get(proc, 0.0) for c in costs) >= 0.001}  # idle threads out
                    if cuda:
                        results[f"{key}_peak_mem_mib"] = round(max(ours_mem), 1)
                        results[f"{key}_plain_peak_mem_mib"] = round(max(plain_mem), 1)
    if "mlp256_fp32_updates_per_s" in results:  # the headline figures: the larger update
        results["updates_per_s"] = results["mlp256_fp32_updates_per_s"]
        results["plain_torch_updates_per_s"] = results["mlp256_fp32_plain_torch_updates_per_s"]
        results["updates_ratio_vs_plain"] = results["mlp256_fp32_updates_ratio_vs_plain"]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
