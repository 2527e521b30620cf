"""What a running system is doing, read over gRPC, and how ``amprl run`` shows it.

``Progress`` polls every service's Info (and, for ``amprl status``, its grpc.health.v1
status) in parallel and keeps the last answer of each; the figures the run loop, the stop
rule, the summary and ``amprl status`` need are read from those answers. Rates (env
steps/s, updates/s, inserts/s, ...) are differences of the services' counters between
polls at most ``rate_window_s`` apart, so a single poll has none.

``ProgressDisplay`` is ``amprl run``'s progress on stdout: on a terminal a rich display
updated in place (``render``: % of the step budget, ETA, recent training return, last
evaluation); otherwise (a pipe, a log file, CI) the plain ``Progress.line`` every interval.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import IO, Any, Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from amprl import errors
from amprl.common.channels import make_channel
from amprl.config import RunConfig
from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, replay_pb2, replay_pb2_grpc
from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc

INFO: dict[str, tuple[Callable[[grpc.Channel], Any], Callable[[], Any]]] = {
    "replay": (replay_pb2_grpc.ReplayServiceStub, replay_pb2.ReplayServiceInfoRequest),
    "paramserver": (paramserver_pb2_grpc.ParameterServiceStub, paramserver_pb2.ParameterServiceInfoRequest),
    "learner": (telemetry_pb2_grpc.LearnerServiceStub, telemetry_pb2.LearnerServiceInfoRequest),
    "actor": (telemetry_pb2_grpc.ActorServiceStub, telemetry_pb2.ActorServiceInfoRequest),
    "evaluator": (telemetry_pb2_grpc.EvaluatorServiceStub, telemetry_pb2.EvaluatorServiceInfoRequest),
}
"""Role -> (the stub with its Info method, Info's request)."""

COUNTERS = {
    "replay": ("env_steps_total", "inserted_total", "sampled_total"),
    "paramserver": ("version", "pushes_applied"),
    "learner": ("updates",),
    "actor": ("env_steps", "episodes"),
    "evaluator": (),
}
"""Role -> the Info fields that only grow, whose rates ``Progress.rates`` gives."""


def role_of_service(name: str) -> str:
    """The role of a service by its name ("actor-3" -> "actor"), which is also the role of
    its certificate."""
    return name.split("-", 1)[0]


def failure(exc: BaseException) -> tuple[str, str]:
    """(status code name, details) of a failed call, mapped (``amprl.errors``) or not."""
    rpc = exc if isinstance(exc, grpc.RpcError) else exc.__cause__
    if isinstance(rpc, grpc.RpcError) and hasattr(rpc, "code"):
        return rpc.code().name, rpc.details() or ""
    return type(exc).__name__, str(exc)


@dataclass
class ServiceState:
    """One service as the last poll saw it."""

    name: str
    address: str
    health: str = "UNKNOWN"
    """grpc.health.v1 status ("SERVING", "NOT_SERVING") or, when the check failed, its
    status code ("UNAVAILABLE", "DEADLINE_EXCEEDED", ...); "UNKNOWN" before a health poll."""
    info: Any = None
    """The last Info answer (kept when a later call fails; None before the first)."""
    error: str = ""
    """Why the last poll's calls failed ("" when they did not)."""

    @property
    def role(self) -> str:
        return role_of_service(self.name)


class Progress:
    """Polls the services ``{name: "host:port"}`` (names as in services.json: "replay",
    "paramserver", "learner", "actor-0", ..., "evaluator"; the role is the part before
    "-") and keeps the figures the progress line, the stop rule and ``amprl status`` use.
    With TLS on (AMPRL_TLS_CERT_DIR) each channel expects its server's role."""

    def __init__(self, services: Mapping[str, str], *, timeout_s: float = 2.0, rate_window_s: float = 5.0):
        self.timeout_s = timeout_s
        self.rate_window_s = rate_window_s
        self.services = {name: ServiceState(name, address) for name, address in services.items()}
        unknown = [s.name for s in self.services.values() if s.role not in INFO]
        if unknown:
            raise errors.ConfigError(f"unknown service {unknown[0]!r}: a name starts with one of "
                                     f"{', '.join(INFO)}")
        self._channels = {name: make_channel(s.address, server_role=s.role) for name, s in self.services.items()}
        self._window: deque[tuple[float, dict[str, float]]] = deque()

    def poll(self, *, health: bool = False) -> None:
        """Asks every service for its Info (and its health with ``health``) at once and
        waits for the answers, ``timeout_s`` at most. A service that does not answer keeps
        its previous Info; its failure is in ``error`` (a restarting service is not an
        error of the poll: ``amprl run`` notices a dead one by its process)."""
        calls = []
        for name, state in self.services.items():
            state.error = ""
            stub, request = INFO[state.role]
            channel = self._channels[name]
            calls.append((state, "info", stub(channel).Info.future(request(), timeout=self.timeout_s)))
            if health:
                # types-grpcio-health-checking's HealthStub lacks the generated methods
                check = health_pb2_grpc.HealthStub(channel).Check  # type: ignore[attr-defined]
                calls.append((state, "health", check.future(health_pb2.HealthCheckRequest(service=""),
                                                            timeout=self.timeout_s)))
        for state, kind, call in calls:
            try:
                reply = call.result()
            except (errors.AmprlError, grpc.RpcError) as exc:
                code, details = failure(exc)
                state.error = state.error or f"{kind}: {code}: {details}"
                if kind == "health":
                    state.health = code
                continue
            if kind == "info":
                state.info = reply
            else:
                state.health = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        self.record()

    def record(self, now: float | None = None) -> None:
        """Adds the current counters to the rate window (``poll`` does it)."""
        now = time.monotonic() if now is None else now
        self._window.append((now, self.counters()))
        while len(self._window) > 2 and now - self._window[0][0] > self.rate_window_s:
            self._window.popleft()

    # --- the figures, from the last answers ---------------------------------------------

    def infos(self, role: str) -> list[Any]:
        """The last Info answers of the services of ``role`` (those that answered)."""
        return [s.info for s in self.services.values() if s.role == role and s.info is not None]

    @property
    def env_steps(self) -> int:
        """Env steps of the whole actor fleet (replay's count, over all shards)."""
        return sum(r.env_steps_total for r in self.infos("replay"))

    @property
    def replay_size(self) -> int:
        return sum(r.size for r in self.infos("replay"))

    @property
    def version(self) -> int:
        """The parameter server's version (0 before it answers)."""
        return max((p.version for p in self.infos("paramserver")), default=0)

    @property
    def updates(self) -> int:
        """Optimizer updates of all learners."""
        return sum(learner.updates for learner in self.infos("learner"))

    @property
    def q_mean(self) -> float:
        """The learners' mean Q(s, a) over their last updates (LearnerServiceInfoResponse.q_mean)."""
        learners = self.infos("learner")
        return sum(x.q_mean for x in learners) / len(learners) if learners else 0.0

    @property
    def evaluations(self) -> list[Any]:
        """Every evaluation so far, oldest first."""
        return [e for ev in self.infos("evaluator") for e in ev.evaluations]

    @property
    def run_state(self) -> Any:
        """The evaluator's RunState (whether the run goes on, and why it ended); None
        before it answers, or without an evaluator."""
        evaluators = self.infos("evaluator")
        return evaluators[0].run_state if evaluators else None

    def wait_learners_idle(self, timeout_s: float, interval_s: float = 0.5) -> bool:
        """After the evaluator ended the run: polls until every learner reports the end
        (its run_phase) and neither its update count nor the parameter server's version
        moved since the previous poll (its last pushes have landed), so that the figures
        read now are final and agree (updates >= version). A run that ends at its target
        is FINISHED at once, before the learners' next poll of the verdict; stopping a
        learner still at work would send pushes after its last Info. False at the timeout."""
        deadline = time.monotonic() + timeout_s
        ended = (telemetry_pb2.RUN_PHASE_STOPPING, telemetry_pb2.RUN_PHASE_FINISHED)
        before: tuple[int, int] | None = None
        while True:
            self.poll()
            learners = self.infos("learner")
            now = (self.updates, self.version)
            if all(x.run_phase in ended for x in learners) and now == before:
                return True
            if time.monotonic() >= deadline:
                return False
            before = now
            time.sleep(interval_s)

    @property
    def recent_return(self) -> float | None:
        """Mean training-episode return of the actors that have finished an episode
        (ActorServiceInfoResponse.recent_return); None before any has."""
        returns = [a.recent_return for a in self.infos("actor") if a.episodes > 0]
        return sum(returns) / len(returns) if returns else None

    def counters(self) -> dict[str, float]:
        """Every growing counter now: "<service>.<field>" (COUNTERS) and the fleet's
        "env_steps", "updates" and "version"."""
        out: dict[str, float] = {}
        for s in self.services.values():
            if s.info is not None:
                out.update({f"{s.name}.{f}": float(getattr(s.info, f)) for f in COUNTERS[s.role]})
        if self.infos("replay"):
            out["env_steps"] = self.env_steps
        if self.infos("learner"):
            out["updates"] = self.updates
        if self.infos("paramserver"):
            out["version"] = self.version
        return out

    def rates(self) -> dict[str, float]:
        """Per second, each counter's growth between the oldest and newest poll in the
        window; empty before two polls."""
        if len(self._window) < 2:
            return {}
        (t0, c0), (t1, c1) = self._window[0], self._window[-1]
        dt = max(t1 - t0, 1e-6)
        return {k: (c1[k] - c0[k]) / dt for k in c1 if k in c0}

    def line(self, elapsed: float) -> str:
        """The plain progress line, printed once per interval when stdout is not a terminal."""
        rates = self.rates()
        sps, ups = rates.get("env_steps", 0.0), rates.get("updates", 0.0)
        evals = self.evaluations
        last = evals[-1] if evals else None
        ev = f"{last.mean_return:7.1f} (v{last.param_version})" if last else "      -"
        return (f"[{elapsed:6.1f}s] env steps {self.env_steps:>9,d} ({sps:7,.0f}/s)  updates {self.updates:>7,d} "
                f"({ups:5.0f}/s)  Q {self.q_mean:7.2f}  replay {self.replay_size:>8,d}  version {self.version:>7,d}  "
                f"eval {ev}")

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def eta_seconds(env_steps: int, total_env_steps: int, steps_per_s: float,
                elapsed: float, max_wall_seconds: float = 0.0) -> float | None:
    """Seconds until the run stops at its step budget or wall limit, whichever comes first
    at the current rate; None when neither can be told (no rate yet and no wall limit)."""
    left = []
    if steps_per_s > 0:
        left.append(max(total_env_steps - env_steps, 0) / steps_per_s)
    if max_wall_seconds > 0:
        left.append(max(max_wall_seconds - elapsed, 0.0))
    return min(left) if left else None


def duration(seconds: float | None) -> str:
    """``75`` -> "1m15s", ``3725`` -> "1h02m", None -> "-"."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def render(progress: Progress, run: RunConfig, elapsed: float, title: str = "amprl run") -> Any:
    """The rich renderable of the live display: a bar of the step budget with % done,
    elapsed time and ETA, then the figures of ``Progress``."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    rates = progress.rates()
    sps, ups = rates.get("env_steps", 0.0), rates.get("updates", 0.0)
    steps, total = progress.env_steps, run.total_env_steps
    eta = eta_seconds(steps, total, sps, elapsed, run.max_wall_seconds)
    limit = f" (limit {duration(run.max_wall_seconds)})" if run.max_wall_seconds else ""
    head = Table.grid(padding=(0, 2))
    head.add_row(ProgressBar(total=total, completed=min(steps, total), width=30),
                 f"{min(steps / total, 1.0):.0%} of {total:,} env steps")
    evals = progress.evaluations
    last = evals[-1] if evals else None
    recent = progress.recent_return
    figures = Table.grid(padding=(0, 2))
    figures.add_column(style="bold")
    figures.add_column()
    for label, value in [
        ("time", f"{duration(elapsed)} elapsed{limit}, ETA {duration(eta)}"),
        ("env steps", f"{steps:,} ({sps:,.0f}/s)"),
        ("updates", f"{progress.updates:,} ({ups:,.0f}/s)   Q {progress.q_mean:.2f}"),
        ("replay", f"{progress.replay_size:,} transitions"),
        ("version", f"{progress.version:,}"),
        ("training return", "-" if recent is None else f"{recent:.1f} (actors' recent episodes)"),
        ("last eval", "-" if last is None else f"{last.mean_return:.1f} ± {last.std_return:.1f} at "
                                               f"v{last.param_version}, {last.env_steps:,} env steps"),
        ("target", f"{run.target_return:g}" + (" (the run stops there)" if run.stop_at_target else "")),
    ]:
        figures.add_row(label, value)
    return Panel(Group(head, figures), title=title, title_align="left")


class ProgressDisplay:
    """``amprl run``'s progress on ``file`` (stdout): with ``live`` (default: ``file`` is a
    terminal) rich's display redrawn in place on every ``update``; otherwise
    ``Progress.line`` once every ``interval_s`` seconds, as logs and CI want it."""

    def __init__(self, progress: Progress, run: RunConfig, *, interval_s: float = 1.0,
                 title: str = "amprl run", file: IO[str] | None = None, live: bool | None = None):
        self.progress, self.run, self.interval_s, self.title = progress, run, interval_s, title
        self.file = sys.stdout if file is None else file
        self.live = self.file.isatty() if live is None else live
        self._last = 0.0
        self._live: Any = None
        if self.live:
            from rich.console import Console
            from rich.live import Live
            self._live = Live(console=Console(file=self.file, force_terminal=True),
                              auto_refresh=False, transient=False)
            self._live.start()

    def update(self, elapsed: float) -> None:
        if self._live is not None:
            self._live.update(render(self.progress, self.run, elapsed, self.title), refresh=True)
        elif elapsed - self._last >= self.interval_s:
            print(self.progress.line(elapsed), file=self.file, flush=True)
            self._last = elapsed

    def close(self) -> None:
        """Leaves the last display on screen (idempotent)."""
        if self._live is not None:
            self._live.stop()
            self._live = None
