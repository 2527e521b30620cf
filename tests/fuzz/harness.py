"""Any bytes to any RPC of a live server, and what every fuzz example asserts of the answer.

Calls go over a plain channel with no serializers (the bytes travel as they are) and no
retries or error mapping, so the status is the server's own. An example passes when the
status is allowed, a refusal says why, every reply parses as the RPC's response type and
the server still answers health SERVING; each test module adds that nothing it stores
changed when the request was refused.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf import descriptor as pbd
from google.protobuf import message as pbm
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings

Code = grpc.StatusCode

ALLOWED = frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION,
                     Code.RESOURCE_EXHAUSTED, Code.PERMISSION_DENIED, Code.UNAUTHENTICATED})
"""What a server may answer to any input; DEADLINE_EXCEEDED only where the RPC waits on
purpose (``check(may_wait=True)``)."""

FUZZ = settings(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.filter_too_much])
"""Every fuzz test's settings: the same examples on every run (derandomized, no example
database), no per-example deadline (a server call may take a while on a busy machine)."""


def fuzz(examples: int) -> settings:
    """``FUZZ`` with ``examples`` examples (per parametrization of the test)."""
    return settings(FUZZ, max_examples=examples)

MAX_MESSAGE_BYTES = 1 << 20
"""Message limit of the fuzz servers: a strategy's megabyte strings and bytes cross it."""

CALL_TIMEOUT_S = 10.0
"""Deadline of a call that must not wait: past it, the server hangs (DEADLINE_EXCEEDED is
then a failure)."""


@dataclass(frozen=True)
class Rpc:
    """One method of a service, as its descriptor has it."""

    path: str
    """"/amprl.v1.ReplayService/Insert"."""
    request: type[pbm.Message]
    response: type[pbm.Message]
    request_streaming: bool
    response_streaming: bool

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[1]


def rpcs(service: pbd.ServiceDescriptor) -> dict[str, Rpc]:
    """Every method of ``service`` by name."""
    return {m.name: Rpc(f"/{service.full_name}/{m.name}", GetMessageClass(m.input_type),
                        GetMessageClass(m.output_type), m.client_streaming, m.server_streaming)
            for m in service.methods}


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    replies: list[pbm.Message]
    seconds: float


def wire(request: pbm.Message | bytes) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


def call(channel: grpc.Channel, rpc: Rpc, requests: list[pbm.Message | bytes],
         timeout: float = CALL_TIMEOUT_S) -> Outcome:
    """Sends ``requests`` (one unless the RPC streams requests) as they are; every reply
    must parse as the RPC's response."""
    data = [wire(r) for r in requests]
    raw: list[bytes] = []
    start = time.monotonic()
    kind = ("stream" if rpc.request_streaming else "unary") + "_" + (
        "stream" if rpc.response_streaming else "unary")
    multicallable = getattr(channel, kind)(rpc.path)  # no serializers: bytes as they are
    if rpc.request_streaming:
        arg = iter(data)
    else:
        assert len(data) == 1, f"{rpc.name} takes one request"
        arg = data[0]
    try:
        if rpc.response_streaming:
            replies = multicallable(arg, timeout=timeout)
            for reply in replies:
                raw.append(reply)
            code, details = replies.code(), replies.details()
        else:
            reply, done = multicallable.with_call(arg, timeout=timeout)
            raw.append(reply)
            code, details = done.code(), done.details()
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    parsed = [rpc.response.FromString(r) for r in raw]  # DecodeError: the server sent junk
    return Outcome(code, details or "", parsed, time.monotonic() - start)


TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
"""(service/method, strategy) -> Counter of status names: the outcomes a run saw, printed at
the end of the session (``conftest.py``)."""


def check(outcome: Outcome, rpc: Rpc, strategy: str, *, may_wait: bool = False,
          also: frozenset[grpc.StatusCode] | set[grpc.StatusCode] = frozenset()) -> None:
    """The status is allowed (DEADLINE_EXCEEDED too with ``may_wait``, and ``also``, the
    codes a service documents for this RPC) and a refusal says why; counted in ``TALLY``."""
    TALLY[f"{rpc.path.lstrip('/').removeprefix('amprl.v1.')}  {strategy}"][outcome.code.name] += 1
    allowed = ALLOWED | ({Code.DEADLINE_EXCEEDED} if may_wait else set()) | set(also)
    assert outcome.code in allowed, (f"{rpc.path} answered {outcome.code.name} after "
                                     f"{outcome.seconds:.2f}s: {outcome.details}")
    if outcome.code != Code.OK and outcome.code not in also:  # (grpc's health: NOT_FOUND, no message)
        assert outcome.details.strip(), f"{rpc.path}: {outcome.code.name} without a message"


def assert_serving(channel: grpc.Channel, *services: str) -> None:
    """Health SERVING for the whole server ("") and each of ``services``."""
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", *services):
        status = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=CALL_TIMEOUT_S).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"health of {name!r}: {status}"


def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Polls ``condition`` until it holds (True) or ``timeout_s`` passed (False): for what a
    server releases just after the caller saw the status."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True
