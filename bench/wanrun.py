"""``amprl run`` with the parameter server across a slow link from the learner.

    python bench/wanrun.py CONFIG --run-dir DIR [--rtt-ms 300] [--set key=value ...]
    python bench/wanrun.py CONFIG --run-dir DIR --paramserver HOST:PORT   # a remote server

Starts what ``amprl run`` starts (embedded Redis, replay, parameter server, learner,
``actor.num_actors`` actors, evaluator; each its own OS process) but puts a DelayRelay
process between the learner and the parameter server: the learner dials the relay
(127.0.0.1:0, ``rtt_ms / 2`` added to each direction; with ``--rtt-ms 0`` no relay, the
learner dials the server); actors and the evaluator dial the server directly. With
``--paramserver`` no server is started: every service dials the given address (e.g. a relay into another network namespace: tests/integration/latency/).

Stops at the target (``run.stop_at_target``), the step budget or ``run.max_wall_seconds``,
as ``amprl run`` does: the evaluator decides (``amprl.common.runend``), the learner and the
actors idle, the final weights are evaluated once more. Writes ``<run-dir>/summary.json`` (the fields of ``amprl run``'s summary plus
``rtt_ms``, ``versions_per_s``, the learner's ``stale_rejections`` and the server's
``gradient_bytes_received``) and prints it as one
JSON line; progress lines go to stdout every ``--progress-interval`` seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from amprl.common.redis_server import EmbeddedRedis
from amprl.config import dump_config, load_config
from amprl.launch.procs import free_port, set_nice, start_service, stop_services, stop_together, wait_for_port
from amprl.launch.progress import Progress
from amprl.launch.run import stop_reason, wait_until_finished

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import start_relay  # noqa: E402 - bench/ is not a package


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round trip added between learner and server")
    p.add_argument("--paramserver", default="", help="use this (remote) parameter server instead of starting one")
    p.add_argument("--progress-interval", type=float, default=5.0)
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir)
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    common = ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir), "--host", "127.0.0.1"]
    services, relay, redis, progress = [], None, None, None
    summary: dict = {}
    failure = None
    t_start = time.monotonic()

    def start(name, module, extra=()):  # at the CPU priority amprl run gives it (deploy.nice)
        svc = start_service(name, module, [*common, *extra], log_dir, nice=cfg.deploy.nice.of(name))
        services.append(svc)
        return svc

    try:
        redis = EmbeddedRedis(run_dir / "redis")
        set_nice(redis.pid, cfg.deploy.nice.redis)
        replay = start("replay", "amprl.replay", ["--redis-url", redis.url])
        if args.paramserver:
            ps_addr = learner_ps = args.paramserver
        else:
            ps = start("paramserver", "amprl.paramserver")
            wait_for_port(ps)
            ps_addr = ps.address
            if args.rtt_ms > 0:
                relay = start_relay(ps.port, args.rtt_ms, log_dir)
                learner_ps = relay.address
            else:  # no relay at all: the local link, not a relay adding 0 ms
                learner_ps = ps.address
        wait_for_port(replay)
        evaluator_port = free_port()  # the workers follow its verdict on the run's end
        ends = ["--evaluator", f"127.0.0.1:{evaluator_port}"]
        learner = start("learner", "amprl.learner", ["--replay", replay.address, "--paramserver", learner_ps,
                                                     "--id", "learner-0", *ends])
        addrs = ["--replay", replay.address, "--paramserver", ps_addr]
        actors = [start(f"actor-{i}", "amprl.actor", [*addrs, "--id", f"actor-{i}", *ends])
                  for i in range(cfg.actor.num_actors)]
        evaluator = start("evaluator", "amprl.evaluator",
                          [*addrs, "--id", "evaluator", "--port", str(evaluator_port)])
        for svc in [learner, *actors, evaluator]:
            wait_for_port(svc)
        progress = Progress({"replay": replay.address, "paramserver": ps_addr,
                             "learner": learner.address, "evaluator": evaluator.address})
        startup = time.monotonic() - t_start
        t0, t0_unix = time.monotonic(), time.time()
        reason, last_print = "", 0.0
        while True:
            time.sleep(0.25)
            elapsed = time.monotonic() - t0
            dead = [s for s in services if not s.alive()]
            if dead:
                failure = f"{dead[0].name} died ({dead[0].returncode}):\n{dead[0].log_tail()}"
                reason = "service died"
                break
            progress.poll()
            if elapsed - last_print >= args.progress_interval:
                print(progress.line(elapsed), flush=True)
                last_print = elapsed
            reason = stop_reason(progress)
            if reason:
                break
        if failure is None:
            wait_until_finished(progress, evaluator, cfg.evaluator.interval_s + 180)
        wall = time.monotonic() - t0
        if failure is None:
            progress.wait_learners_idle(timeout_s=30)  # the final figures agree (updates >= version)
        else:
            progress.poll()
        learner_info = progress.services["learner"].info  # before the learner is stopped
        stop_together([s for s in services if s.name.startswith("actor")] + [learner])
        progress.poll()
        evals = progress.evaluations
        ps_info = progress.services["paramserver"].info
        hit = next((e for e in evals if e.mean_return >= cfg.run.target_return), None)
        summary = {
            "name": cfg.name, "rtt_ms": args.rtt_ms if not args.paramserver else None,
            "paramserver": args.paramserver or None, "stop_reason": reason, "solved": hit is not None,
            "target_return": cfg.run.target_return,
            "final_eval_return": evals[-1].mean_return if evals else None,
            "best_eval_return": max((e.mean_return for e in evals), default=None),
            "env_steps": progress.env_steps, "updates": progress.updates,
            "learner_q_mean": round(progress.q_mean, 3),  # as amprl run's summary
            "param_version": progress.version, "wall_seconds": round(wall, 2),
            "versions_per_s": round(progress.version / max(wall, 1e-6), 1),
            "updates_per_s": round(progress.updates / max(wall, 1e-6), 1),
            "stale_rejections": learner_info.stale_rejections if learner_info else None,
            # the gradient payload the server received (data + scales: the bytes the encoding decides)
            "gradient_bytes_received": ps_info.gradient_bytes_received if ps_info else None,
            "time_to_target_seconds": round(hit.unix_time - t0_unix, 2) if hit else None,
            "steps_to_target": hit.env_steps if hit else None,
            "evaluations": [[round(e.unix_time - t0_unix, 1), e.env_steps, e.param_version,
                             round(e.mean_return, 1)] for e in evals],
            "startup_seconds": round(startup, 2), "error": failure,
        }
    finally:
        if progress is not None:
            progress.close()
        stop_services(list(reversed(services)))
        if relay is not None:
            relay.stop(timeout_s=5)
        if redis is not None:
            redis.stop()
    if summary:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary), flush=True)
    if failure:
        print(failure, file=sys.stderr)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
