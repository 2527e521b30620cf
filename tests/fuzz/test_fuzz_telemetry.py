"""LearnerService, ActorService and EvaluatorService fuzzed on live servers, each serving a
real (unstarted) learner, actor or evaluator as their processes do: Info gets random
messages (unknown fields included) and undecodable bytes, answers OK or INVALID_ARGUMENT,
changes nothing and leaves the server SERVING; so do the evaluator's GetRunState and
GetBestPolicy (NOT_FOUND: this evaluator keeps no run folder). Health itself gets the same."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from amprl.actor.actor import Actor
from amprl.actor.service import register as actor_services
from amprl.common import grpcutil
from amprl.config import ExperimentConfig
from amprl.envs.factory import env_spec
from amprl.evaluator.evaluator import Evaluator
from amprl.evaluator.service import register as evaluator_services
from amprl.learner.learner import Learner
from amprl.learner.service import register as learner_services
from amprl.v1 import telemetry_pb2
from grpc_health.v1 import health_pb2

from .harness import MAX_MESSAGE_BYTES, Code, assert_serving, call, check, fuzz, rpcs
from .protofuzz import messages, mutated, raw_bytes

EXAMPLES = 25
"""Examples per service (an Info request has no fields: few are distinct)."""

HEALTH_EXAMPLES = 12
"""Examples per health method (a watch of a known service waits out its deadline)."""

SERVICES = {"LearnerService": learner_services, "ActorService": actor_services,
            "EvaluatorService": evaluator_services}
INFO = {name: rpcs(telemetry_pb2.DESCRIPTOR.services_by_name[name])["Info"] for name in SERVICES}
EVALUATOR = rpcs(telemetry_pb2.DESCRIPTOR.services_by_name["EvaluatorService"])
HEALTH = rpcs(health_pb2.DESCRIPTOR.services_by_name["Health"])


@pytest.fixture(scope="module")
def servers():
    """Service name -> (what it serves, a channel to its server)."""
    cfg = ExperimentConfig()
    cfg.learner.device = "cpu"
    spec = env_spec(cfg.env)
    evaluator = Evaluator(cfg, spec, None)
    evaluator.evaluations += [telemetry_pb2.Evaluation(param_version=v, mean_return=9.5, episodes=2)
                              for v in (1, 2)]
    served = {"LearnerService": Learner(cfg, spec, None, None),
              "ActorService": Actor(cfg, spec, "actor-0", None, None),
              "EvaluatorService": evaluator}
    started = []
    try:
        for name, obj in served.items():
            server, port = grpcutil.create_server(SERVICES[name](obj), host="127.0.0.1", port=0,
                                                  max_workers=4, max_message_bytes=MAX_MESSAGE_BYTES)
            started.append((server, grpc.insecure_channel(f"127.0.0.1:{port}")))
        yield {name: (served[name], channel) for name, (_, channel) in zip(served, started)}
    finally:
        for server, channel in started:
            channel.close()
            server.stop(0).wait()


@pytest.mark.parametrize("service", sorted(SERVICES))
@fuzz(EXAMPLES)
@given(data=st.data())
def test_info_answers_or_refuses_and_the_server_serves_on(servers, service, data):
    obj, channel = servers[service]
    rpc = INFO[service]
    strategy = data.draw(st.sampled_from(["random", "raw bytes"]), label="strategy")
    valid = rpc.request()
    request = data.draw(messages(rpc.request) if strategy == "random" else raw_bytes(valid), label="request")
    first = call(channel, rpc, [valid]).replies[0]
    out = call(channel, rpc, [request])
    check(out, rpc, strategy)
    assert out.code in (Code.OK, Code.INVALID_ARGUMENT), out.details
    if out.code == Code.OK:
        assert out.replies[0] == first  # nothing ran in between: the same state
    assert_serving(channel, f"amprl.v1.{service}")


@pytest.mark.parametrize("method", ["GetRunState", "GetBestPolicy"])
@fuzz(EXAMPLES)
@given(data=st.data())
def test_the_run_state_and_the_best_policy_answer_or_refuse(servers, method, data):
    _, channel = servers["EvaluatorService"]
    rpc = EVALUATOR[method]
    strategy = data.draw(st.sampled_from(["random", "raw bytes"]), label="strategy")
    request = data.draw(messages(rpc.request) if strategy == "random" else raw_bytes(rpc.request()),
                        label="request")
    out = call(channel, rpc, [request])
    check(out, rpc, strategy, also={Code.NOT_FOUND})
    if method == "GetRunState":
        assert out.code in (Code.OK, Code.INVALID_ARGUMENT), out.details
        if out.code == Code.OK:
            assert out.replies[0].run_state.phase == telemetry_pb2.RUN_PHASE_RUNNING
    else:
        assert out.code in (Code.NOT_FOUND, Code.INVALID_ARGUMENT), out.details
    assert_serving(channel, "amprl.v1.EvaluatorService")


@pytest.mark.parametrize("method", ["Check", "Watch"])
@fuzz(HEALTH_EXAMPLES)
@given(data=st.data())
def test_health_answers_or_refuses_bad_requests(servers, method, data):
    _, channel = servers["LearnerService"]
    rpc = HEALTH[method]
    valid = health_pb2.HealthCheckRequest(service="amprl.v1.LearnerService")
    strategy = data.draw(st.sampled_from(["random", "mutated", "raw bytes"]), label="strategy")
    request = data.draw({"random": messages(rpc.request), "mutated": mutated(valid),
                         "raw bytes": raw_bytes(valid)}[strategy], label="request")
    out = call(channel, rpc, [request], timeout=0.1 if method == "Watch" else 10.0)
    # Check answers a service name it does not know with NOT_FOUND (Watch: SERVICE_UNKNOWN)
    check(out, rpc, strategy, may_wait=method == "Watch", also={Code.NOT_FOUND})
    assert_serving(channel, "amprl.v1.LearnerService")
