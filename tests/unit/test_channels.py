"""Client channels (amprl.common.channels): gRPC's retry policy repeats exactly the methods
named as safe, within the deadline; the interceptor maps every failure to amprl.errors, at
the call, at a future's result and in a stream, and leaves a call this client cancelled
as gRPC's CANCELLED. Against a real gRPC server on loopback."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from amprl import errors
from amprl.common.channels import make_channel


class Flaky:
    """Methods of a test service, each failing its first ``fail`` calls with ``code``."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.fail: dict[str, tuple[int, grpc.StatusCode]] = {}
        self.release = threading.Event()

    def unary(self, name):
        def handle(request, context):
            n = self.calls[name] = self.calls.get(name, 0) + 1
            failures, code = self.fail.get(name, (0, grpc.StatusCode.OK))
            if n <= failures:
                context.set_trailing_metadata((("amprl-current-version", "7"),))
                context.abort(code, f"{name} attempt {n}")
            if name == "Slow":
                self.release.wait(10)
            return request
        return grpc.unary_unary_rpc_method_handler(handle)

    def stream(self, request, context):
        yield b"one"
        context.abort(grpc.StatusCode.UNAVAILABLE, "cut mid-stream")


@pytest.fixture
def server():
    flaky = Flaky()
    handlers = {name: flaky.unary(name) for name in ("Retried", "NotRetried", "Slow")}
    handlers["Stream"] = grpc.unary_stream_rpc_method_handler(flaky.stream)
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Flaky", handlers)])
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = make_channel(f"127.0.0.1:{port}", retry=["test.Flaky/Retried"])
    try:
        yield flaky, channel
    finally:
        flaky.release.set()
        channel.close()
        srv.stop(0)


def call(channel, name):
    return channel.unary_unary(f"/test.Flaky/{name}")


def test_a_method_named_safe_is_retried_on_unavailable_and_succeeds(server):
    flaky, channel = server
    flaky.fail["Retried"] = (3, grpc.StatusCode.UNAVAILABLE)
    assert call(channel, "Retried")(b"x", timeout=10, wait_for_ready=True) == b"x"
    assert flaky.calls["Retried"] == 4


def test_a_method_not_named_is_tried_once_and_its_failure_mapped(server):
    flaky, channel = server
    flaky.fail["NotRetried"] = (1, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(errors.Unavailable, match="NotRetried attempt 1"):
        call(channel, "NotRetried")(b"x", timeout=10)
    assert flaky.calls["NotRetried"] == 1


def test_retries_stop_at_five_attempts_and_report_the_last_answer(server):
    flaky, channel = server
    flaky.fail["Retried"] = (100, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(errors.Unavailable, match="attempt 5"):
        call(channel, "Retried")(b"x", timeout=30)
    assert flaky.calls["Retried"] == 5


def test_other_codes_are_not_retried_and_keep_their_trailers(server):
    flaky, channel = server
    flaky.fail["Retried"] = (1, grpc.StatusCode.FAILED_PRECONDITION)
    with pytest.raises(errors.FailedPrecondition) as stale:
        call(channel, "Retried")(b"x", timeout=10)
    assert stale.value.current_version == 7 and flaky.calls["Retried"] == 1
    flaky.fail["NotRetried"] = (1, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(errors.InvalidArgument):
        call(channel, "NotRetried")(b"x", timeout=10)


def test_a_code_with_no_amprl_error_comes_as_grpc_raised_it(server):
    flaky, channel = server
    flaky.fail["NotRetried"] = (1, grpc.StatusCode.PERMISSION_DENIED)
    with pytest.raises(grpc.RpcError) as denied:
        call(channel, "NotRetried")(b"x", timeout=10)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_future_maps_at_result_and_a_callback_gets_the_mapped_future(server):
    flaky, channel = server
    flaky.fail["NotRetried"] = (1, grpc.StatusCode.RESOURCE_EXHAUSTED)
    fut = call(channel, "NotRetried").future(b"x", timeout=10)
    seen = []
    fut.add_done_callback(lambda f: seen.append(f.exception()))
    with pytest.raises(errors.ResourceExhausted):
        fut.result()
    assert isinstance(fut.exception(), errors.ResourceExhausted)
    assert len(seen) == 1 and isinstance(seen[0], errors.ResourceExhausted)


def test_a_call_cancelled_here_stays_cancelled_not_unavailable(server):
    flaky, channel = server
    fut = call(channel, "Slow").future(b"x", timeout=10)
    with pytest.raises(grpc.FutureTimeoutError):
        fut.result(timeout=0.2)  # still running: the timeout passes through unmapped
    fut.cancel()
    with pytest.raises(grpc.FutureCancelledError):
        fut.result()


def test_a_stream_maps_its_error_where_it_surfaces(server):
    _, channel = server
    stream = channel.unary_stream("/test.Flaky/Stream")(b"", timeout=10)
    assert next(stream) == b"one"
    with pytest.raises(errors.Unavailable, match="cut mid-stream"):
        next(stream)
