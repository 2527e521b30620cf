"""Client of the evaluator, and how actors and learners follow the run's end.

    client = EvaluatorClient("evaluator:50055")
    client.info()          # every evaluation, the run's state, the summary once finished
    client.run_state()     # RunState: phase (RUNNING, STOPPING, FINISHED) and stop reason
    client.best_policy()   # BestPolicy: the best-scoring weights with their config

The evaluator decides when the run ends (``amprl.evaluator.verdict``). A worker follows
it with ``RunEndWatch`` and ``work_until_run_ends``: it asks once before it starts working
(a worker restarted after the end idles at once), then every ``WORKER_POLL_S`` while it
works; from STOPPING on it stops its loop and its threads and idles, its process still
serving its Info (with the phase) and health, until it is stopped. It does not exit: a
Deployment restarts a container that exits, whatever its status, and would do so in a
loop. An evaluator that cannot be reached (restarting, or none configured) changes
nothing: the worker goes on working.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, NamedTuple

import torch

from amprl import errors
from amprl.common.channels import make_channel
from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc
from amprl.wire.compressed import decode

log = logging.getLogger(__name__)

WORKER_POLL_S = 2.0
"""How often a working actor or learner asks for the run's state."""

_SERVICE = "amprl.v1.EvaluatorService"
RETRIED = [f"{_SERVICE}/Info", f"{_SERVICE}/GetRunState", f"{_SERVICE}/GetBestPolicy"]
"""Every RPC only reads: each is safe to repeat."""

START_CHECK_TIMEOUT_S = 1.0
"""How long a worker's first question may hold up its start: an evaluator not serving yet
(pods start together) must not delay the work."""

ENDED = (telemetry_pb2.RUN_PHASE_STOPPING, telemetry_pb2.RUN_PHASE_FINISHED)


class BestPolicy(NamedTuple):
    """The best-scoring weights so far (GetBestPolicy)."""
    evaluation: telemetry_pb2.Evaluation
    config_yaml: str
    """The experiment config that rebuilds their network (``amprl.algos.build_model``)."""
    weights: dict[str, torch.Tensor]
    """fp32 CPU tensors in state-dict order."""


class EvaluatorClient:
    """Client of one evaluator; thread-safe."""

    def __init__(self, address: str, *, timeout_s: float = 10.0, retry: bool = True):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = make_channel(address, server_role="evaluator", retry=RETRIED if retry else ())
        self.stub = telemetry_pb2_grpc.EvaluatorServiceStub(self.channel)

    def info(self, timeout: float | None = None) -> telemetry_pb2.EvaluatorServiceInfoResponse:
        return self.stub.Info(telemetry_pb2.EvaluatorServiceInfoRequest(),
                              timeout=timeout or self.timeout_s, wait_for_ready=True)

    def run_state(self, timeout: float | None = None, *,
                  wait_for_ready: bool = True) -> telemetry_pb2.RunState:
        return self.stub.GetRunState(telemetry_pb2.GetRunStateRequest(), timeout=timeout or self.timeout_s,
                                     wait_for_ready=wait_for_ready).run_state

    def best_policy(self, timeout: float | None = None) -> BestPolicy:
        """The best weights; NotFound before the evaluator's first evaluation."""
        first = None
        weights: dict[str, torch.Tensor] = {}
        last = False
        for reply in self.stub.GetBestPolicy(telemetry_pb2.GetBestPolicyRequest(),
                                             timeout=timeout or 4 * self.timeout_s, wait_for_ready=True):
            first = first or reply
            for message in reply.parameters:
                weights[message.name] = decode(message, device="cpu")
            last = reply.last
        if first is None or not last:
            raise errors.Unavailable("the best-policy stream ended before its last message")
        return BestPolicy(first.evaluation, first.config_yaml, weights)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "EvaluatorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RunEndWatch:
    """The run's phase as a worker last heard it from the evaluator at ``address``."""

    def __init__(self, address: str, *, poll_s: float = WORKER_POLL_S):
        # no retries: the next poll is the retry, and a first question must fail fast
        self.client = EvaluatorClient(address, timeout_s=min(5.0, max(poll_s, 1.0)), retry=False)
        self.poll_s = poll_s
        self.phase: telemetry_pb2.RunPhase.ValueType = telemetry_pb2.RUN_PHASE_UNSPECIFIED
        self.reason: telemetry_pb2.StopReason.ValueType = telemetry_pb2.STOP_REASON_UNSPECIFIED
        self._warned = False

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    def check(self, *, starting: bool = False) -> bool:
        """Asks once; True when the run has ended. An evaluator that does not answer leaves
        the phase as it was: logged once (at start, where it may not serve yet, as INFO)."""
        try:
            state = self.client.run_state(timeout=START_CHECK_TIMEOUT_S if starting else None,
                                          wait_for_ready=False)
        except errors.AmprlError as exc:
            if not self._warned:
                log.log(logging.INFO if starting else logging.WARNING,
                        "the evaluator at %s does not answer%s (%s): working until it tells the run "
                        "has ended", self.client.address, " yet" if starting else "", exc)
                self._warned = not starting
            return self.ended
        self.phase, self.reason = state.phase, state.stop_reason
        return self.ended

    def guard(self, stop: threading.Event) -> threading.Event:
        """An event set once ``stop`` is set or the run has ended, polled every ``poll_s``
        by a thread of its own: what a worker's loop runs under."""
        halt = threading.Event()

        def poll() -> None:
            while not stop.wait(self.poll_s):
                if self.check():
                    break
            halt.set()

        threading.Thread(target=poll, name="run-end-watch", daemon=True).start()
        return halt

    def close(self) -> None:
        self.client.close()


def work_until_run_ends(work: Callable[[threading.Event], None], stop: threading.Event,
                        watch: RunEndWatch | None, on_end: Callable[[], None]) -> None:
    """Runs ``work(event)`` (a worker's loop, which returns once the event is set) until
    ``stop`` or the run's end; at the end, ``on_end()`` (the worker stops its threads) and
    an idle wait for ``stop``, still asking every ``poll_s`` so that the phase its Info
    reports follows the evaluator's. Without a watch: ``work(stop)``."""
    if watch is None:
        work(stop)
        return
    if not watch.check(starting=True):  # a worker restarted after the end does not start again
        work(watch.guard(stop))
    if stop.is_set():
        return
    name = telemetry_pb2.StopReason.Name(watch.reason)
    log.info("the run has ended (%s): stopping work; idle until this process is stopped", name)
    on_end()
    while not stop.wait(watch.poll_s):
        watch.check()  # keeps the phase in Info current (STOPPING -> FINISHED)
