"""A run that ends on a cluster, with no launcher: the pods' processes (replay, parameter
server, learner, evaluator, two actors; each configured only by its environment and
holding its own role's certificate) train to the step budget. The evaluator decides the
run is over; the actors and the learner stop and idle without exiting (a Deployment would
restart an exited container); the evaluator writes the summary and keeps the best policy on
its volume. A restarted evaluator and a restarted actor take up the verdict at once;
`amprl status --wait` (the chart's done Job) returns; and the results come out over gRPC
with the operator's certificate: amprl fetch, then amprl plot and amprl export on what it
wrote, and amprl export --paramserver for the newest weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from amprl.cli import main as amprl
from amprl.evaluator.client import EvaluatorClient
from amprl.launch.procs import stop_together, wait_for_port
from amprl.v1 import telemetry_pb2

from .conftest import TINY_CONFIG, clean_env, running_system, spawn, wait_for
from .tls import make_role_dirs

BUDGET = 4000
CONFIG = TINY_CONFIG.replace("total_env_steps: 100000000", f"total_env_steps: {BUDGET}")
FINISHED = telemetry_pb2.RUN_PHASE_FINISHED


def actor_info(system, actor_id):
    from amprl.v1 import telemetry_pb2_grpc
    from amprl.common.channels import make_channel
    with make_channel(f"127.0.0.1:{system.ports[actor_id]}", server_role="actor") as ch:
        return telemetry_pb2_grpc.ActorServiceStub(ch).Info(telemetry_pb2.ActorServiceInfoRequest(),
                                                            timeout=10, wait_for_ready=True)


def learner_info(system):
    from amprl.v1 import telemetry_pb2_grpc
    from amprl.common.channels import make_channel
    with make_channel(f"127.0.0.1:{system.ports['learner']}", server_role="learner") as ch:
        return telemetry_pb2_grpc.LearnerServiceStub(ch).Info(telemetry_pb2.LearnerServiceInfoRequest(),
                                                              timeout=10, wait_for_ready=True)


@pytest.mark.slow
def test_a_run_without_a_launcher_ends_idles_survives_restarts_and_hands_out_its_results(tmp_path, monkeypatch):
    roles = make_role_dirs(tmp_path / "tls")
    # this test process is a person with the operator's certificate (read-only calls)
    monkeypatch.setenv("AMPRL_TLS_CERT_DIR", str(roles["operator"]))
    monkeypatch.setenv("AMPRL_TLS_SERVER_NAME", "amprl.test")
    root = tmp_path / "system"
    root.mkdir()
    with running_system(root, CONFIG, tls=roles) as system:
        evaluator_address = system.env["AMPRL_EVALUATOR_ADDRESS"]
        for actor_id in ("actor-0", "actor-1"):
            system.start_actor(actor_id)
        evaluator = EvaluatorClient(evaluator_address)
        wait_for(lambda: evaluator.run_state().phase == FINISHED, 240, "the run to finish", interval_s=1.0)
        system.check_alive()  # nobody exited: workers idle
        for actor in system.actors.values():
            assert actor.alive(), actor.log()[-2000:]

        # what the evaluator left on its volume
        record = root / "eval"
        summary = json.loads((record / "summary.json").read_text())
        assert summary["stop_reason"] == "step budget reached" and summary["env_steps"] >= BUDGET, summary
        assert summary["evaluations"] >= 1 and summary["best"]["weights"].startswith("best/weights-v")
        assert json.loads((record / "end.json").read_text())["phase"] == "RUN_PHASE_FINISHED"

        # the workers know and stay idle
        wait_for(lambda: all(actor_info(system, a).run_phase == FINISHED for a in system.actors), 30,
                 "the actors to report the end")
        steps = {a: actor_info(system, a).env_steps for a in system.actors}
        updates, fleet = learner_info(system).updates, system.replay_info().env_steps_total
        time.sleep(3.0)
        assert {a: actor_info(system, a).env_steps for a in system.actors} == steps
        assert learner_info(system).updates == updates and system.replay_info().env_steps_total == fleet
        assert learner_info(system).run_phase == FINISHED

        # the done Job's command: returns at once, saying so
        job = subprocess.run([sys.executable, "-m", "amprl.cli", "status", "--evaluator", evaluator_address,
                              "--wait", "--interval", "1", "--timeout", "10"],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert job.returncode == 0, job.stdout + job.stderr
        assert "the run is finished (step budget reached)" in job.stdout
        assert "the run has finished (step budget reached" in job.stdout

        # a restarted evaluator pod: the same verdict, its whole history, no new evaluations
        history = [e.param_version for e in evaluator.info().evaluations]
        stop_together([system.services["evaluator"]])
        system.services["evaluator"] = spawn("evaluator-again", "evaluator", clean_env(
            AMPRL_CONFIG=str(root / "experiment.yaml"), AMPRL_HOST="127.0.0.1", **system.role_env["evaluator"],
            AMPRL_PARAMSERVER_ADDRESS=system.paramserver_pull_address, AMPRL_REPLAY_ADDRESS=system.replay_address,
            AMPRL_ID="evaluator-0", AMPRL_PORT=str(system.ports["evaluator"]), AMPRL_RUN_DIR=str(record)),
            root / "logs", port_file=root / "logs" / "evaluator-again.port")
        wait_for_port(system.services["evaluator"], 90)
        assert evaluator.run_state().phase == FINISHED  # its first answer
        time.sleep(2.0)
        info = evaluator.info()
        assert [e.param_version for e in info.evaluations] == history
        assert json.loads(info.summary_json) == summary

        # a restarted actor pod asks first and never steps
        stop_together([system.actors.pop("actor-0")])
        system.start_actor("actor-0")
        wait_for(lambda: actor_info(system, "actor-0").run_phase == FINISHED, 90, "the new actor to idle")
        time.sleep(1.0)
        assert actor_info(system, "actor-0").env_steps == 0

        # the results, over gRPC with the operator's certificate
        out = tmp_path / "results"
        assert amprl(["fetch", "--evaluator", evaluator_address, "--certs", str(tmp_path / "tls"), str(out)]) == 0
        rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
        assert [r["param_version"] for r in rows] == history
        assert json.loads((out / "summary.json").read_text()) == summary
        best = json.loads((out / "best" / "best.json").read_text())
        assert f"best/{best['weights']}" == summary["best"]["weights"]
        assert torch.load(out / "best" / best["weights"], weights_only=True).keys() == \
            torch.load(record / summary["best"]["weights"], weights_only=True).keys()
        assert amprl(["plot", str(out), "-o", str(tmp_path / "curves.png")]) == 0
        assert (tmp_path / "curves.png").stat().st_size > 10_000
        assert amprl(["export", str(out), "-o", str(tmp_path / "best.pt"), "--format", "state_dict"]) == 0
        exported = torch.load(tmp_path / "best.pt", weights_only=True)
        fetched = torch.load(out / "best" / best["weights"], weights_only=True)
        assert all(torch.equal(exported[k], fetched[k]) for k in fetched)
        monkeypatch.delenv("AMPRL_TLS_CERT_DIR")  # --certs alone
        assert amprl(["export", "--paramserver", system.paramserver_pull_address, "--config",
                      str(out / "config.yaml"), "--certs", str(tmp_path / "tls"), "-o", str(tmp_path / "final.pt"),
                      "--format", "state_dict"]) == 0
        assert torch.load(tmp_path / "final.pt", weights_only=True).keys() == exported.keys()
