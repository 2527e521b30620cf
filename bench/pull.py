"""Bytes and parameter-server CPU of one weight pull, for the Atari network.

    python bench/pull.py [--pulls 40] [--repeats 3] [--encodings fp32,bf16] [--follower]

A real parameter server (its own process, ``amprl.paramserver``, configs/pong-apex.yaml:
Nature CNN with a dueling head, ~3.3M parameters) and this process as a puller that asks
for the whole weights (``have_version`` 0) ``--pulls`` times back to back, the way a fleet
pulls one version: every pull after the first finds the version already encoded. The
replies are read as raw bytes, so this process spends no CPU decoding them. For each
encoding, medians over ``--repeats`` runs:

  * ``<enc>_bytes_per_pull``: serialized PullParametersResponse bytes of one pull (gRPC's
    5-byte message framing and HTTP/2 excluded);
  * ``<enc>_server_cpu_ms_per_pull``: user + system CPU of the whole server process
    (``/proc/<pid>/stat``) per pull.

With ``--follower`` the pulls go to a pull-only follower (``amprl paramserver --follow``)
of that server instead, and ``<enc>_main_cpu_ms_per_pull`` adds what the main server spent
meanwhile (its follower holds the version, so it should be ~0). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from amprl.common import channels
from amprl.config import dump_config, load_config
from amprl.launch.procs import start_service, stop_services, wait_for_port
from amprl.v1 import paramserver_pb2, tensor_pb2

ROOT = Path(__file__).resolve().parents[1]
ENCODINGS = {"fp32": tensor_pb2.ENCODING_FP32, "bf16": tensor_pb2.ENCODING_BF16,
             "fp16": tensor_pb2.ENCODING_FP16}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pull_bytes(pull, encoding: int) -> int:
    """One full pull; the serialized size of its replies."""
    request = paramserver_pb2.PullParametersRequest(encoding=encoding, client_id="actor:bench-pull")
    return sum(len(reply) for reply in pull(request.SerializeToString(), timeout=60, wait_for_ready=True))


def measure(pull, pids: list[int], encoding: int, pulls: int) -> tuple[int, list[float]]:
    """(bytes per pull, CPU ms per pull of each process in ``pids``)."""
    before = [process_cpu_s(pid) for pid in pids]
    sizes = [pull_bytes(pull, encoding) for _ in range(pulls)]
    after = [process_cpu_s(pid) for pid in pids]
    return statistics.median(sizes), [(a - b) * 1e3 / pulls for a, b in zip(after, before)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pulls", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--encodings", default="fp32,bf16")
    p.add_argument("--follower", action="store_true", help="pull from a follower of the server")
    args = p.parse_args()
    cfg = load_config(ROOT / "configs/pong-apex.yaml", ["paramserver.checkpoint_interval_s=0"])
    results: dict = {"config": "configs/pong-apex.yaml", "pulls": args.pulls, "repeats": args.repeats,
                     "follower": args.follower, "cpus": os.cpu_count(),
                     "load_average_1min_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="amprl-bench-pull-") as tmp:
        run_dir = Path(tmp)
        (run_dir / "logs").mkdir()
        dump_config(cfg, run_dir / "config.yaml")
        common = ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir), "--host", "127.0.0.1"]
        services = [start_service("paramserver", "amprl.paramserver", common, run_dir / "logs")]
        channel = None
        try:
            address = f"127.0.0.1:{wait_for_port(services[0])}"
            if args.follower:
                services.append(start_service("follower", "amprl.paramserver",
                                              common + ["--follow", address], run_dir / "logs"))
                address = f"127.0.0.1:{wait_for_port(services[1])}"
            channels.wait_until_serving(address, timeout_s=120)
            channel = channels.make_channel(address)
            pull = channel.unary_stream("/amprl.v1.ParameterService/PullParameters")  # raw bytes
            pids = [svc.proc.pid for svc in reversed(services)]  # the server pulled from first
            for name in args.encodings.split(","):
                encoding = ENCODINGS[name]
                pull_bytes(pull, encoding)  # warm-up: the version's first encoding
                runs = [measure(pull, pids, encoding, args.pulls) for _ in range(args.repeats)]
                results[f"{name}_bytes_per_pull"] = int(statistics.median(r[0] for r in runs))
                results[f"{name}_server_cpu_ms_per_pull"] = round(statistics.median(r[1][0] for r in runs), 3)
                if args.follower:
                    results[f"{name}_main_cpu_ms_per_pull"] = round(statistics.median(r[1][1] for r in runs), 3)
        finally:
            if channel is not None:
                channel.close()
            stop_services(list(reversed(services)))
    results["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
