"""``amprl run [CONFIG] [--set key=value ...]``: the whole system on one machine.

Starts an embedded Redis (a real redis-server), then replay, parameter server, learner,
``actor.num_actors`` actors and the evaluator, each as its own OS process talking gRPC on
loopback; shows live progress (``amprl.launch.progress``: in place on a terminal, a line
a second otherwise); stops when the evaluator says the run has ended (the target eval
return, the step budget or the wall limit: ``amprl.common.runend``; the workers idle by
themselves then, as on a cluster), on Ctrl-C, or when any service dies (whose log tail is
shown). ``--resume RUN_DIR``
goes on with a stopped run, ``--init-from RUN_DIR`` starts from another run's weights
(``amprl.launch.resume``). With ``--tls`` every
connection is mutual TLS and each service holds only its own role's certificate
(``amprl.common.certs``). Writes the run folder:

    <run_dir>/<name>-<time>/config.yaml      resolved config
                            logs/<service>.log
                            checkpoints/      parameter server checkpoints (final one included)
                            eval.jsonl        every evaluation
                            best/             the best-scoring weights and their config
                            end.json          the evaluator's verdict: why the run ended
                            services.json     name -> pid, address, log, metrics (its /metrics URL)
                            tb/<service>/     TensorBoard event files (tensorboard --logdir)
                            summary.json      solved, final_eval_return, env_steps, updates, ...
                            curves.png        eval return against env steps and wall time (amprl plot)
                            tls/              with --tls: the CA and one folder per role
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from amprl.cli import debug
from amprl.common import runend
from amprl.config import dump_config, packaged_configs
from amprl.launch import resume
from amprl.launch.procs import Service, free_port, set_nice, start_service, stop_services, stop_together
from amprl.launch.progress import Progress, ProgressDisplay, role_of_service
from amprl.launch.startup import check_experiment, wait_started

log = logging.getLogger("amprl.run")

DEFAULT_CONFIG = "cartpole-dqn"
"""The packaged experiment ``amprl run`` trains when given none (``amprl.config.resolve_config``)."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="amprl run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG,
                   help=f"experiment YAML, or the name of a packaged one: {', '.join(packaged_configs())} "
                        f"(default: {DEFAULT_CONFIG})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. run.total_env_steps=20000 (repeatable)")
    p.add_argument("--run-dir", default="", help="exact run folder (default: <run.run_dir>/<name>-<time>)")
    p.add_argument("--progress-interval", type=float, default=1.0,
                   help="seconds between progress lines (when stdout is not a terminal)")
    p.add_argument("--tls", action="store_true",
                   help="mutual TLS between every service, with a CA and role certificates made "
                        "in <run folder>/tls (or taken from --certs)")
    p.add_argument("--certs", default="", metavar="DIR",
                   help="with --tls: role certificates from `amprl certs DIR` instead of new ones")
    resume.add_arguments(p)
    return p.parse_args(argv)


def tls_env(args, run_dir: Path) -> Callable[[str], dict[str, str]]:
    """Environment that gives each service its own role's certificate folder (an empty
    one with TLS off). The launcher itself reads Info with the operator certificate."""
    if not (args.tls or args.certs):
        return lambda role: {}
    from amprl.common import certs, grpcutil
    folder = Path(args.certs) if args.certs else run_dir / "tls"
    if not args.certs:
        certs.make_role_certs(folder, release=run_dir.name)
    # the server name the certificates were made for
    server_name = certs.server_name_in(folder / "replay" / "tls.crt")
    return lambda role: {grpcutil.TLS_CERT_DIR_ENV: str(folder / role),
                         grpcutil.TLS_SERVER_NAME_ENV: server_name}


def stop_reason(progress: Progress) -> str:
    """Why a healthy run stops now ("" = it goes on): the evaluator's verdict, read from its
    Info as workers, ``amprl status`` and the chart's done Job read it. The evaluator judges
    the rule of the run section (``amprl.common.runend``): the target reached (with
    ``run.stop_at_target``), the step budget or the wall-clock limit."""
    state = progress.run_state
    if state is None or state.phase not in (runend.STOPPING, runend.FINISHED):
        return ""
    return runend.REASONS.get(state.stop_reason, "ended")


def wait_until_finished(progress: Progress, evaluator: Service, timeout_s: float) -> None:
    """Waits while the evaluator ends the run: the workers stop at their next poll, the
    weights settle, the evaluator evaluates them once more and writes the summary."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and evaluator.alive():
        progress.poll()
        state = progress.run_state
        if state is not None and state.phase == runend.FINISHED:
            return
        time.sleep(0.25)
    log.warning("the evaluator did not finish the run within %.0f s", timeout_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # stderr is for problems (a mistake is one line: amprl.cli); --debug adds the INFO lines
    logging.basicConfig(level="INFO" if debug() else "WARNING",
                        format="%(asctime)s run %(levelname)s: %(message)s")
    cfg = resume.run_config(args, DEFAULT_CONFIG)  # ConfigError: one line, exit 2 (amprl.cli)
    check_experiment(cfg)
    previous = resume.previous_summary(args)
    run_dir = Path(args.run_dir) if args.run_dir else Path(cfg.run.run_dir) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "config.yaml"
    dump_config(cfg, config_file)
    print(f"amprl run: {cfg.name} ({cfg.algo} on {cfg.env.id}), run folder {run_dir}", flush=True)

    from amprl.common.redis_acl import REPLAY_USER, RedisUser
    from amprl.common.redis_server import EmbeddedRedis

    interrupted = {"flag": False}

    def _sigint(signum, frame):
        interrupted["flag"] = True

    old_int = signal.signal(signal.SIGINT, _sigint)
    old_term = signal.signal(signal.SIGTERM, _sigint)
    services: list[Service] = []
    redis = None
    progress = None
    display = None
    saved_env: dict[str, str | None] = {}
    failure = None
    t0 = time.monotonic()
    summary: dict = {}
    try:
        if cfg.replay.redis_url:
            redis_url = cfg.replay.redis_url
        else:
            # Replay connects as an ACL user limited to its table's keys and commands
            # (amprl.common.redis_acl); the admin password stays in this process. Both are
            # random, so nothing else on the machine can read or write the run's replay;
            # replay gets its own in its environment, not on its command line.
            replay_user = RedisUser(REPLAY_USER, secrets.token_urlsafe(24))
            redis = EmbeddedRedis(run_dir / "redis", password=secrets.token_urlsafe(24),
                                  users=[replay_user], appendfsync=cfg.replay.durability)
            redis_url = redis.url
            set_nice(redis.pid, cfg.deploy.nice.redis)
        common = ["--config", str(config_file), "--run-dir", str(run_dir), "--host", "127.0.0.1"]
        role_env = tls_env(args, run_dir)
        saved_env = {k: os.environ.get(k) for k in role_env("operator")}
        os.environ.update(role_env("operator"))  # the launcher's own Info calls

        def start(name, module, extra=(), env=None):
            env = {**role_env(role_of_service(name)), **(env or {})}
            svc = start_service(name, module, [*common, *extra], log_dir, env, nice=cfg.deploy.nice.of(name),
                                metrics=True)
            services.append(svc)
            return svc

        replay = start("replay", "amprl.replay", ["--redis-url", redis_url],
                       env={"AMPRL_REDIS_USERNAME": replay_user.name,
                            "AMPRL_REDIS_PASSWORD": replay_user.password,
                            "AMPRL_REDIS_PREFIX": replay_user.prefix} if redis is not None else None)
        ps = start("paramserver", "amprl.paramserver", resume.paramserver_args(args, run_dir))
        wait_started(replay)
        wait_started(ps)
        addrs = ["--replay", replay.address, "--paramserver", ps.address]
        # workers follow the evaluator's verdict on the run's end (amprl.common.runend); its
        # port is chosen now so that it starts with them and its clock with theirs
        evaluator_port = free_port()
        workers = [*addrs, "--evaluator", f"127.0.0.1:{evaluator_port}"]
        learner = start("learner", "amprl.learner", [*workers, "--id", "learner-0"])
        actors = [start(f"actor-{i}", "amprl.actor", [*workers, "--id", f"actor-{i}"])
                  for i in range(cfg.actor.num_actors)]
        evaluator = start("evaluator", "amprl.evaluator",
                          [*addrs, "--id", "evaluator", "--port", str(evaluator_port)])
        for svc in [learner, *actors, evaluator]:
            wait_started(svc)
        (run_dir / "services.json").write_text(json.dumps(
            {s.name: {"pid": s.pid, "address": s.address, "log": str(s.log_path), "metrics": s.metrics_url}
             for s in services}, indent=2))
        progress = Progress({s.name: s.address for s in services})
        display = ProgressDisplay(progress, cfg.run, interval_s=args.progress_interval,
                                  title=f"amprl run {cfg.name}: {run_dir}")
        startup = time.monotonic() - t0
        t0 = time.monotonic()
        reason = ""
        while True:
            time.sleep(0.25)
            elapsed = time.monotonic() - t0
            dead = [s for s in services if not s.alive()]
            if dead:
                s = dead[0]
                failure = f"service {s.name} died with exit code {s.returncode}; last lines of {s.log_path}:\n{s.log_tail()}"
                reason = "service died"
                break
            if interrupted["flag"]:
                reason = "interrupted"
                break
            progress.poll()
            display.update(elapsed)
            reason = stop_reason(progress)
            if reason:
                break
        display.close()
        print(f"amprl run: stopping ({reason})", flush=True)
        if failure is None and not interrupted["flag"]:
            wait_until_finished(progress, evaluator, cfg.evaluator.interval_s + 180)
        wall = time.monotonic() - t0
        if failure is None and not interrupted["flag"]:
            progress.wait_learners_idle(timeout_s=30)  # their last pushes landed: the figures agree
        # the weights are final once the learner is gone (it idles already)
        stop_together([s for s in services if s.name.startswith("actor")] + [learner])
        progress.poll()
        summary = runend.summary(cfg, reason, progress.evaluations, env_steps=progress.env_steps,
                                 param_version=progress.version, wall_seconds=wall,
                                 replay_size=progress.replay_size, run_dir=run_dir)
        summary.update({
            "updates": progress.updates,
            # the learner's mean Q(s, a) over its last 50 updates (see LearnerStats.q_mean)
            "learner_q_mean": round(progress.q_mean, 3),
            # wall_seconds counts from the moment every service was serving, this long after start
            "startup_seconds": round(startup, 2),
            "error": failure,
        })
    finally:
        if display is not None:
            display.close()
        if progress is not None:
            progress.close()
        stop_services(list(reversed(services)))
        if redis is not None:
            redis.stop()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    if failure:
        print(f"amprl run: {failure}", file=sys.stderr, flush=True)
    if summary:
        if previous is not None:  # resumed: the summary covers the whole run
            summary = resume.whole_run(summary, previous, run_dir, cfg.run.target_return)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps({k: v for k, v in summary.items() if k != "error"}), flush=True)
        if (run_dir / "eval.jsonl").exists():
            try:  # the curves are a convenience: failing to draw them never fails the run
                from amprl.launch.plot import plot_runs
                plot_runs([run_dir], run_dir / "curves.png")
            except Exception as exc:  # noqa: BLE001 - whatever matplotlib raises
                log.warning("could not plot %s: %s", run_dir / "curves.png", exc)
    return 1 if failure else (130 if interrupted["flag"] else 0)


if __name__ == "__main__":
    sys.exit(main())
