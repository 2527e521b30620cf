"""``amprl status``: one screen about a running system.

    amprl status RUN_DIR                  a local run (RUN_DIR/services.json has the addresses)
    amprl status --replay H:P --paramserver H:P --learner H:P --evaluator H:P --actor H:P ...
                                          any system, e.g. through kubectl port-forward
    amprl status RUN_DIR --json           the same figures as one JSON object, for scripts
    amprl status --evaluator H:P --wait   wait until the run has finished, then show it

Asks every service for its health (grpc.health.v1) and Info twice, ``--interval`` seconds
apart, for the rates (``--interval 0``: once, no rates): replay size and inserts/samples per
second, actors live, the parameter server's version and staleness counts, each learner's
updates/s and lag behind the server, each actor's env steps and training return, the last
evaluation, and the run's state as the evaluator decides it (running, stopping, finished
with its reason and summary). Exit status 0 when every service is SERVING, 1 when one is not
(named, with the reason), 2 for a usage error. With ``--wait``: the evaluator is asked
every ``--interval`` seconds (at least 1) until it reports the run finished, then the
status is shown and the exit status is 0 (what the chart's done Job runs, which
``kubectl wait --for=condition=complete`` waits on).

Mutual TLS: RUN_DIR/tls/operator when the run has one (``amprl run --tls``), DIR/operator
with ``--certs DIR`` (``amprl certs DIR``), else AMPRL_TLS_CERT_DIR from the environment;
none of them: plaintext.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from amprl import errors
from amprl.common import runend
from amprl.launch.progress import Progress, ServiceState

ROLE_FLAGS = ("replay", "paramserver", "learner", "actor", "evaluator")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="amprl status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", default=None, type=Path,
                   help="run folder of `amprl run` (its services.json lists every address)")
    for role in ROLE_FLAGS:
        p.add_argument(f"--{role}", action="append", default=[], metavar="HOST:PORT",
                       help=f"{role} address (repeatable or comma-separated; adds to RUN_DIR's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the screen")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between the two polls the rates come from; 0 = one poll, no rates")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds each call may take")
    p.add_argument("--certs", type=Path, default=None, metavar="DIR",
                   help="mutual TLS with DIR/operator (a folder made by `amprl certs DIR`)")
    p.add_argument("--wait", action="store_true",
                   help="wait until the evaluator reports the run finished (exit 0), then show it")
    return p.parse_args(argv)


def service_addresses(run_dir: Path | None, flags: dict[str, list[str]]) -> dict[str, str]:
    """{service name: address} from RUN_DIR/services.json and the role flags; a role given
    several addresses is named "<role>-0", "<role>-1", ... (actors always are)."""
    found: dict[str, str] = {}
    if run_dir is not None:
        listing = run_dir / "services.json"
        try:
            found = {name: s["address"] for name, s in json.loads(listing.read_text()).items()}
        except FileNotFoundError:
            raise errors.ConfigError(f"{listing}: not found; `amprl run` writes it once every service "
                                     f"is up (is RUN_DIR a run folder, and has the run started?)") from None
        except (ValueError, KeyError, AttributeError) as exc:
            raise errors.ConfigError(f"{listing}: not a services.json of `amprl run` ({exc})") from None
    for role, values in flags.items():
        addresses = [a.strip() for v in values for a in v.split(",") if a.strip()]
        for i, address in enumerate(addresses):
            name = role if len(addresses) == 1 and role != "actor" else f"{role}-{i}"
            found[name] = address
    if not found:
        raise errors.ConfigError("no services: give a RUN_DIR or addresses (--replay H:P --paramserver H:P ...)")
    return found


def operator_cert_dir(run_dir: Path | None, certs_dir: Path | None) -> Path | None:
    """The certificate folder to dial with: --certs DIR's operator, the run's own
    tls/operator, or None (AMPRL_TLS_CERT_DIR from the environment, or plaintext)."""
    if certs_dir is not None:
        return certs_dir / "operator"
    if run_dir is not None and (run_dir / "tls" / "operator" / "tls.crt").exists():
        return run_dir / "tls" / "operator"
    return None


def use_certificate(cert_dir: Path) -> None:
    """Points this process's channels at ``cert_dir``, with the server name its
    certificate was made for."""
    from amprl.common import certs, grpcutil
    server_name = certs.server_name_in(cert_dir / "tls.crt")  # ConfigError when unreadable
    os.environ[grpcutil.TLS_CERT_DIR_ENV] = str(cert_dir)
    os.environ[grpcutil.TLS_SERVER_NAME_ENV] = server_name


def _rate(rates: dict[str, float] | None, key: str) -> float | None:
    value = None if rates is None else rates.get(key)
    return None if value is None else round(value, 1)


def details(state: ServiceState, rates: dict[str, float] | None, ps_version: int | None) -> dict[str, Any]:
    """The figures that matter of one service's last Info; rates None when there are none."""
    i, n = state.info, state.name
    if i is None:
        return {}
    if state.role == "replay":
        lim = i.rate_limiter
        return {"size": i.size, "capacity": i.capacity, "env_steps": i.env_steps_total,
                "inserts_per_s": _rate(rates, f"{n}.inserted_total"),
                "samples_per_s": _rate(rates, f"{n}.sampled_total"),
                "actors_live": i.actors_live, "insert_streams": i.insert_streams,
                "waiting_samples": lim.waiting_samples, "waiting_inserts": lim.waiting_inserts,
                "missing_transitions": i.missing_transitions}
    if state.role == "paramserver":
        return {"version": i.version, "versions_per_s": _rate(rates, f"{n}.version"),
                "learners_live": i.learners_live, "actors_live": i.actors_live,
                "pushes_applied": i.pushes_applied, "pushes_scaled": i.pushes_scaled,
                "pushes_rejected_stale": i.pushes_rejected_stale, "max_staleness": i.max_staleness,
                "checkpoint_version": i.checkpoint_version}
    if state.role == "learner":
        lag = max(ps_version - i.param_version, 0) if ps_version is not None else None
        return {"updates": i.updates, "updates_per_s": _rate(rates, f"{n}.updates"),
                "loss": i.loss, "q_mean": i.q_mean, "grad_norm": i.grad_norm,
                "param_version": i.param_version, "lag_versions": lag,
                "stale_rejections": i.stale_rejections, "skipped_nonfinite": i.skipped_nonfinite,
                "device": i.device, "precision": i.precision}
    if state.role == "actor":
        return {"env_steps": i.env_steps, "env_steps_per_s": _rate(rates, f"{n}.env_steps"),
                "episodes": i.episodes, "epsilon": i.epsilon, "param_version": i.param_version,
                "recent_return": i.recent_return if i.episodes else None}
    last = i.evaluations[-1] if i.evaluations else None
    return {"evaluations": len(i.evaluations), "last": None if last is None else {
        "param_version": last.param_version, "mean_return": last.mean_return,
        "std_return": last.std_return, "env_steps": last.env_steps,
        "age_seconds": round(max(time.time() - last.unix_time, 0.0), 1)}}


def version_of(role: str, d: dict[str, Any]) -> int | None:
    """The parameter version a service holds (the evaluator: the one it last evaluated)."""
    if role == "evaluator":
        return d["last"]["param_version"] if d.get("last") else None
    return d.get("version", d.get("param_version"))


def run_of(progress: Progress) -> dict[str, Any] | None:
    """The run's state from the evaluator's Info (None without an answer from one):
    phase, stop_reason ("" while running), env_steps, wall_seconds and, once finished, the
    summary."""
    evaluators = progress.infos("evaluator")
    if not evaluators:
        return None
    info = evaluators[0]
    state = info.run_state
    return {"phase": runend.phase_name(state.phase), "stop_reason": runend.REASONS.get(state.stop_reason, ""),
            "env_steps": state.env_steps, "wall_seconds": round(state.wall_seconds, 1),
            "summary": json.loads(info.summary_json) if info.summary_json else None}


def snapshot(progress: Progress, interval_s: float, run_dir: Path | None = None) -> dict[str, Any]:
    """Everything ``amprl status`` reports, as the JSON object ``--json`` prints."""
    rates = (progress.rates() or None) if interval_s > 0 else None
    ps_version = progress.version if progress.infos("paramserver") else None
    services = {}
    for name, s in progress.services.items():
        d = details(s, rates, ps_version)
        services[name] = {"role": s.role, "address": s.address, "health": s.health,
                          "version": version_of(s.role, d), "error": s.error, "details": d}
    down = [name for name, s in services.items() if s["health"] != "SERVING"]
    evals = progress.evaluations
    fleet = {"env_steps": progress.env_steps, "env_steps_per_s": _rate(rates, "env_steps"),
             "updates": progress.updates, "updates_per_s": _rate(rates, "updates"),
             "replay_size": progress.replay_size, "version": progress.version,
             "recent_return": progress.recent_return,
             "last_eval_return": evals[-1].mean_return if evals else None}
    out: dict[str, Any] = {"run_dir": str(run_dir) if run_dir else None, "ok": not down, "down": down,
                           "rate_seconds": interval_s if rates is not None else None,
                           "services": services, "fleet": fleet, "run": run_of(progress)}
    if run_dir is not None:
        summary = run_dir / "summary.json"
        if summary.exists():
            out["finished"] = json.loads(summary.read_text()).get("stop_reason", "")
        if (run_dir / "config.yaml").exists():
            from amprl.config import load_config
            fleet["total_env_steps"] = load_config(str(run_dir / "config.yaml"), []).run.total_env_steps
    return out


def _n(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def describe(role: str, d: dict[str, Any]) -> str:
    """One service's figures in words (``details``)."""
    if not d:
        return ""
    if role == "replay":
        return (f"{d['size']:,} / {d['capacity']:,} transitions, {_n(d['inserts_per_s'])} inserts/s, "
                f"{_n(d['samples_per_s'])} samples/s, {d['actors_live']} actors live, "
                f"waiting {d['waiting_samples']} samples / {d['waiting_inserts']} inserts")
    if role == "paramserver":
        return (f"{_n(d['versions_per_s'])} versions/s, live: {d['learners_live']} learner(s), "
                f"{d['actors_live']} actor(s); staleness: max {d['max_staleness']}, "
                f"{d['pushes_scaled']:,} scaled, {d['pushes_rejected_stale']:,} rejected; "
                f"checkpoint v{d['checkpoint_version']:,}")
    if role == "learner":
        return (f"{d['updates']:,} updates ({_n(d['updates_per_s'])}/s), loss {d['loss']:.4g}, "
                f"Q {d['q_mean']:.2f}, grad norm {d['grad_norm']:.3g}, {_n(d['lag_versions'])} versions "
                f"behind, {d['stale_rejections']:,} stale rejections, {d['device']} {d['precision']}")
    if role == "actor":
        return (f"{d['env_steps']:,} env steps ({_n(d['env_steps_per_s'])}/s), {d['episodes']:,} episodes, "
                f"epsilon {d['epsilon']:.3f}, training return {_n(d['recent_return'], '.1f')}")
    last = d["last"]
    if last is None:
        return "no evaluation yet"
    return (f"{d['evaluations']} evaluations, last {last['mean_return']:.1f} ± {last['std_return']:.1f} "
            f"at {last['env_steps']:,} env steps, {last['age_seconds']:.0f} s ago")


def screen(snap: dict[str, Any]) -> str:
    """The text ``amprl status`` prints."""
    services = snap["services"]
    width = max([len("SERVICE"), *map(len, services)])
    addr = max([len("ADDRESS"), *(len(s["address"]) for s in services.values())])
    rates = f"rates over {snap['rate_seconds']:g} s" if snap["rate_seconds"] else "no rates"
    lines = [" ".join(["amprl status", *([snap["run_dir"]] if snap["run_dir"] else []), f"({rates})"]),
             f"{'SERVICE':<{width}}  {'ADDRESS':<{addr}}  {'HEALTH':<11}  {'VERSION':>9}  FIGURES"]
    for name, s in services.items():
        lines.append(f"{name:<{width}}  {s['address']:<{addr}}  {s['health']:<11}  "
                     f"{_n(s['version'], ','):>9}  {describe(s['role'], s['details'])}".rstrip())
    f = snap["fleet"]
    total = f.get("total_env_steps")
    budget = f" of {total:,} ({f['env_steps'] / total:.0%})" if total else ""
    lines += ["", f"fleet: {f['env_steps']:,} env steps ({_n(f['env_steps_per_s'])}/s){budget}, "
                  f"{f['updates']:,} updates ({_n(f['updates_per_s'])}/s), version {f['version']:,}, "
                  f"training return {_n(f['recent_return'], '.1f')}, "
                  f"last eval {_n(f['last_eval_return'], '.1f')}"]
    if snap["ok"]:
        lines.append(f"all {len(services)} services SERVING")
    else:
        lines.append(f"not serving: {len(snap['down'])} of {len(services)}")
        lines += [f"  {name}: {services[name]['health']}"
                  + (f" ({services[name]['error']})" if services[name]["error"] else "") for name in snap["down"]]
    run = snap.get("run")
    if run is not None and run["phase"] in ("stopping", "finished"):
        lines.append(f"the run {'has finished' if run['phase'] == 'finished' else 'is stopping'} "
                     f"({run['stop_reason']}, the evaluator's verdict at {run['env_steps']:,} env steps, "
                     f"{run['wall_seconds']:,.0f} s)")
        if run["summary"]:
            s = run["summary"]
            lines.append(f"  final eval {_n(s.get('final_eval_return'), '.1f')}, best "
                         f"{_n(s.get('best_eval_return'), '.1f')}, solved: {'yes' if s.get('solved') else 'no'}")
    elif "finished" in snap:
        lines.append(f"the run has finished ({snap['finished']}; summary.json)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        addresses = service_addresses(args.run_dir, {r: getattr(args, r) for r in ROLE_FLAGS})
        cert_dir = operator_cert_dir(args.run_dir, args.certs)
        if cert_dir is not None:
            use_certificate(cert_dir)
        progress = Progress(addresses, timeout_s=args.timeout)
    except errors.ConfigError as exc:
        print(f"amprl status: {exc}", file=sys.stderr)
        return 2
    try:
        if args.wait:
            if wait_until_finished(progress, max(args.interval, 1.0)) is None:
                print("amprl status: --wait needs the evaluator's address (--evaluator H:P, or a "
                      "RUN_DIR): it decides when the run ends", file=sys.stderr)
                return 2
        progress.poll(health=True)
        if args.interval > 0 and any(s.info is not None for s in progress.services.values()):
            time.sleep(args.interval)
            progress.poll(health=True)
        snap = snapshot(progress, args.interval, args.run_dir)
    finally:
        progress.close()
    try:
        print(json.dumps(snap, indent=2) if args.json else screen(snap), flush=True)
    except BrokenPipeError:  # `amprl status --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if snap["ok"] or args.wait else 1


def wait_until_finished(progress: Progress, interval_s: float) -> bool | None:
    """Polls until the evaluator's Info says FINISHED (True); None without an evaluator.
    A call that fails (the evaluator restarting) is retried at the next interval."""
    evaluators = [s for s in progress.services.values() if s.role == "evaluator"]
    if not evaluators:
        return None
    reported = ""
    while True:
        progress.poll()
        state = progress.run_state
        phase = runend.phase_name(state.phase) if state is not None else "unknown"
        if phase != reported:  # one line per change, for the Job's log
            why = f" ({runend.REASONS.get(state.stop_reason, '')})" if state is not None and state.stop_reason else ""
            print(f"amprl status: the run is {phase}{why}", flush=True)
            reported = phase
        if state is not None and state.phase == runend.FINISHED:
            return True
        time.sleep(interval_s)


if __name__ == "__main__":
    sys.exit(main())
