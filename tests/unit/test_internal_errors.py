"""A bug in a servicer is INTERNAL with an incident id and no internals; the exception
and its traceback go to the server's log under the same id. Sync and asyncio servers."""

from __future__ import annotations

import logging
import re
from concurrent import futures

import grpc
import pytest

from amprl import errors
from amprl.common import grpcutil
from amprl.common.aioserver import AioServer

SECRET = "/srv/secret/path line 42"


class Buggy:
    @grpcutil.map_errors
    def Unary(self, request, context):
        if request == b"bad":
            raise errors.InvalidArgument("the request is bad: say so")
        raise KeyError(SECRET)

    @grpcutil.map_errors
    def Stream(self, request, context):
        yield b"first"
        raise ValueError(SECRET)


class AsyncBuggy:
    @grpcutil.map_errors_async
    async def Unary(self, request, context):
        raise KeyError(SECRET)


def _handlers(servicer) -> grpc.GenericRpcHandler:
    methods = {"Unary": grpc.unary_unary_rpc_method_handler(servicer.Unary)}
    if hasattr(servicer, "Stream"):
        methods["Stream"] = grpc.unary_stream_rpc_method_handler(servicer.Stream)
    return grpc.method_handlers_generic_handler("test.Buggy", methods)


def _check_internal(exc: grpc.RpcError, caplog) -> None:
    assert exc.code() == grpc.StatusCode.INTERNAL
    assert SECRET not in exc.details() and "Error" not in exc.details()
    incident = re.search(r"internal error ([0-9a-f]{8}) in ", exc.details())
    assert incident, exc.details()
    logged = [r for r in caplog.records if incident.group(1) in r.getMessage()]
    assert logged and logged[0].exc_info and SECRET in str(logged[0].exc_info[1])


def test_a_sync_servicer_bug_is_internal_with_an_incident_id_only(caplog):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([_handlers(Buggy())])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.ERROR, logger="amprl.common.grpcutil"):
            with pytest.raises(grpc.RpcError) as unary:
                channel.unary_unary("/test.Buggy/Unary")(b"x", timeout=10)
            _check_internal(unary.value, caplog)
            stream = channel.unary_stream("/test.Buggy/Stream")(b"x", timeout=10)
            assert next(stream) == b"first"
            with pytest.raises(grpc.RpcError) as streamed:
                next(stream)
            _check_internal(streamed.value, caplog)
        with pytest.raises(grpc.RpcError) as refused:  # the client's fault keeps its message
            channel.unary_unary("/test.Buggy/Unary")(b"bad", timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "the request is bad: say so"
    finally:
        channel.close()
        server.stop(0).wait(10)


def test_an_asyncio_servicer_bug_is_internal_with_an_incident_id_only(caplog):
    def add(servicer, server):
        server.add_generic_rpc_handlers([_handlers(servicer)])
    server = AioServer.start([(add, AsyncBuggy(), "test.Buggy")], host="127.0.0.1", port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        with caplog.at_level(logging.ERROR, logger="amprl.common.grpcutil"):
            with pytest.raises(grpc.RpcError) as unary:
                channel.unary_unary("/test.Buggy/Unary")(b"x", timeout=10)
            _check_internal(unary.value, caplog)
    finally:
        channel.close()
        server.stop(0).wait(10)
