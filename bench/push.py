"""CPU cost of one gradient push, by gradient encoding and optimizer steps per call.

    python bench/push.py [--steps 800] [--repeats 3] [--hidden 256] [--encodings fp32,bf16]
                         [--steps-per-call 1,2,4]

A real parameter server (its own process, ``amprl.paramserver``) and this process as the
learner's client, pushing the gradients of the CartPole Q-network (``--hidden`` units per
layer; 256: ~70k parameters, 280 KB in fp32) back to back with ``ParameterClient.push``,
``learner.steps_per_push``-style: each call carries ``k`` consecutive steps (``more_steps``),
each one Adam step and version on the server. For each (encoding, k), medians over
``--repeats`` runs of ``--steps`` steps:

  * ``client_cpu_ms_per_step``: CPU time of the pushing thread (building and serialising
    the request, gRPC), per optimizer step;
  * ``server_cpu_ms_per_step``: CPU time of the whole server process (gRPC, decoding,
    validation, Adam), per optimizer step;
  * ``total_cpu_ms_per_step``: their sum, the CPU a step's trip costs the machine
    (encoding the gradient on the learner is not included: ``bench/compression.py``).

On a machine whose cores are shared by learner, parameter server, replay and actors (a
laptop run, this 2-core box), that total is CPU the learner's updates do not get.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from amprl.algos import build_model
from amprl.wire.compressed import ErrorFeedback
from amprl.config import dump_config, load_config
from amprl.envs.factory import env_spec
from amprl.launch.procs import start_service, stop_services, wait_for_port
from amprl.paramserver.client import ParameterClient

ROOT = Path(__file__).resolve().parents[1]


def stat_cpu_s(stat_path: str) -> tuple[str, float]:
    """(name, user + system CPU seconds) from a ``/proc/.../stat`` file (a process's or a
    thread's, ``/proc/<pid>/task/<tid>/stat``)."""
    with open(stat_path) as f:
        stat = f.read()
    fields = stat.rsplit(")", 1)[1].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    return stat_cpu_s(f"/proc/{pid}/stat")[1]


def measure(client: ParameterClient, server_pid: int, msgs, k: int, steps: int) -> tuple[float, float]:
    calls = max(1, steps // k)
    version = client.info().version
    for _ in range(max(1, 20 // k)):  # warm-up
        version = client.push(version, msgs, more_steps=[(msgs, 0)] * (k - 1)).version
    c0, s0 = time.thread_time(), process_cpu_s(server_pid)
    for _ in range(calls):
        version = client.push(version, msgs, more_steps=[(msgs, 0)] * (k - 1)).version
    n = calls * k
    return (time.thread_time() - c0) * 1e3 / n, (process_cpu_s(server_pid) - s0) * 1e3 / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--encodings", default="fp32,bf16")
    p.add_argument("--steps-per-call", default="1,2,4")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs/cartpole-dqn.yaml", [
        f"network.hidden_sizes=[{args.hidden}, {args.hidden}]", "paramserver.checkpoint_interval_s=0",
        "paramserver.max_staleness=1000000"])
    model = build_model(cfg, env_spec(cfg.env))
    g = torch.Generator().manual_seed(0)
    grads = {n: 1e-3 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    results: dict = {"steps": args.steps, "repeats": args.repeats, "hidden": args.hidden,
                     "parameters": sum(t.numel() for t in grads.values()), "cpus": os.cpu_count(),
                     "load_average_1min_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="amprl-bench-push-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "logs").mkdir()
        dump_config(cfg, run_dir / "config.yaml")
        server = start_service("paramserver", "amprl.paramserver",
                               ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir),
                                "--host", "127.0.0.1"], run_dir / "logs")
        client = None
        try:
            wait_for_port(server)
            client = ParameterClient(f"127.0.0.1:{server.port}", client_id="learner:bench")
            for enc in args.encodings.split(","):
                msgs = ErrorFeedback(enc).compress(grads)
                for k in [int(x) for x in args.steps_per_call.split(",")]:
                    runs = [measure(client, server.proc.pid, msgs, k, args.steps) for _ in range(args.repeats)]
                    c, s = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
                    key = f"{enc}_k{k}"
                    results[f"{key}_client_cpu_ms_per_step"] = round(c, 3)
                    results[f"{key}_server_cpu_ms_per_step"] = round(s, 3)
                    results[f"{key}_total_cpu_ms_per_step"] = round(c + s, 3)
        finally:
            if client is not None:
                client.close()
            stop_services([server])
    results["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
