"""EvaluatorService on a real gRPC server (plaintext and mutual TLS): the run's state that
workers follow, the history and the best weights that people fetch, and how an actor's or
a learner's loop stops, idles and stays down at the run's end (``work_until_run_ends``)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import yaml

from amprl import errors
from amprl.algos import build_model
from amprl.common import grpcutil, runend
from amprl.common.certs import make_role_certs
from amprl.config import config_from_dict, load_config
from amprl.core import Pulled
from amprl.envs.factory import env_spec
from amprl.evaluator import evaluator as evaluator_mod
from amprl.evaluator.client import EvaluatorClient, RunEndWatch, work_until_run_ends
from amprl.evaluator.evaluator import Evaluator
from amprl.evaluator.service import register
from amprl.v1 import replay_pb2, telemetry_pb2


class PS:
    def __init__(self, weights):
        self.weights, self.version = weights, 1

    def pull_versioned(self, have_version=0, have_incarnation=0, *, encoding="fp32", timeout=None):
        if have_version == self.version:
            return Pulled(self.version, 1, None)
        return Pulled(self.version, 1, {k: v.clone() for k, v in self.weights.items()})


class Replay:
    env_steps = 0

    def info(self, timeout=None):
        return replay_pb2.ReplayServiceInfoResponse(env_steps_total=self.env_steps)


def wait_for(predicate, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture(params=["plaintext", "tls"])
def served(request, tmp_path, monkeypatch):
    """An evaluator (fake weights and replay) on a real server; ``as_role(role)`` makes this
    process's clients present that role's certificate (with TLS)."""
    tls = request.param == "tls"
    roles = make_role_certs(tmp_path / "tls", release="t", server_name="amprl.test") if tls else {}

    def as_role(role):
        if tls:
            monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(roles[role]))
            monkeypatch.setenv("AMPRL_TLS_SERVER_NAME", "amprl.test")

    monkeypatch.setattr(evaluator_mod, "JUDGE_INTERVAL_S", 0.05)
    monkeypatch.setattr(evaluator_mod, "SETTLE_S", 0.2)
    monkeypatch.setattr(evaluator_mod, "STILL_S", 0.1)
    monkeypatch.setattr(evaluator_mod, "run_episodes", lambda *a, **k: [4.0, 6.0])
    cfg = load_config(None, ["network.hidden_sizes=[8]", "evaluator.episodes=2", "evaluator.interval_s=0.1",
                             "run.total_env_steps=1000"])
    spec = env_spec(cfg.env)
    torch.manual_seed(1)
    weights = {n: p.detach().clone() for n, p in build_model(cfg, spec).named_parameters()}
    (tmp_path / "run").mkdir()
    ev = Evaluator(cfg, spec, PS(weights), Replay(), run_dir=str(tmp_path / "run"))
    as_role("evaluator")
    server, port = grpcutil.create_server(register(ev), host="127.0.0.1", port=0)
    stop = threading.Event()
    try:
        yield ev, f"127.0.0.1:{port}", weights, stop, as_role
    finally:
        stop.set()
        server.stop(0)


def test_the_best_policy_comes_with_the_config_that_rebuilds_its_network(served):
    ev, address, weights, stop, as_role = served
    as_role("operator")  # a person with grpcutil's operator certificate
    with EvaluatorClient(address) as client:
        with pytest.raises(errors.NotFound, match="no best weights yet"):
            client.best_policy()
        assert client.run_state().phase == telemetry_pb2.RUN_PHASE_RUNNING
        ev.evaluate_once()
        best = client.best_policy()
        info = client.info()
    assert best.evaluation.param_version == 1 and best.evaluation.mean_return == 5.0
    cfg = config_from_dict(yaml.safe_load(best.config_yaml))
    model = build_model(cfg, env_spec(cfg.env))
    model.load_state_dict(best.weights)  # the weights fit the network the config makes
    assert all(torch.equal(best.weights[n], w) for n, w in weights.items())
    assert [e.mean_return for e in info.evaluations] == [5.0] and info.summary_json == ""


def test_workers_stop_at_the_end_idle_and_a_restarted_one_never_starts(served):
    ev, address, _, stop, as_role = served
    as_role("actor")
    worked = threading.Event()
    ended = threading.Event()

    def work(halt):  # an actor's loop: steps until told to stop
        worked.set()
        halt.wait()

    worker_stop = threading.Event()
    watch = RunEndWatch(address, poll_s=0.1)
    worker = threading.Thread(target=work_until_run_ends, args=(work, worker_stop, watch, ended.set),
                              daemon=True)
    worker.start()
    threading.Thread(target=ev.run, args=(stop,), daemon=True).start()
    wait_for(worked.is_set, "the worker working")
    assert not ended.is_set()
    ev.replay.env_steps = 1000  # the budget
    wait_for(ended.is_set, "the worker told the run ended")
    assert watch.phase in (telemetry_pb2.RUN_PHASE_STOPPING, telemetry_pb2.RUN_PHASE_FINISHED)
    assert watch.reason == telemetry_pb2.STOP_REASON_STEP_BUDGET
    time.sleep(0.3)
    assert worker.is_alive()  # idle, not exited: a Deployment would restart it
    wait_for(lambda: ev.verdict.phase == runend.FINISHED, "the run finished")

    worked.clear()
    again = RunEndWatch(address, poll_s=0.1)  # a restarted pod asks first
    restarted_ended = threading.Event()
    restarted = threading.Thread(target=work_until_run_ends,
                                 args=(work, worker_stop, again, restarted_ended.set), daemon=True)
    restarted.start()
    wait_for(restarted_ended.is_set, "the restarted worker idling")
    assert not worked.is_set() and again.phase == telemetry_pb2.RUN_PHASE_FINISHED
    worker_stop.set()  # SIGTERM
    worker.join(5)
    restarted.join(5)
    assert not worker.is_alive() and not restarted.is_alive()


def test_a_worker_whose_evaluator_does_not_answer_goes_on_working(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    watch = RunEndWatch(f"127.0.0.1:{closed}", poll_s=0.05)
    stop, steps = threading.Event(), []

    def work(halt):
        while not halt.is_set() and len(steps) < 20:
            steps.append(1)
            time.sleep(0.01)
        stop.set()

    work_until_run_ends(work, stop, watch, on_end=lambda: pytest.fail("the run did not end"))
    assert len(steps) == 20 and watch.phase == telemetry_pb2.RUN_PHASE_UNSPECIFIED
