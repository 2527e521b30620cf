"""Multi-host: every service in its own network namespace (its own IP, no shared
loopback), addresses passed in the environment as the chart does, mutual TLS with the
settings the chart renders for ``tls.enabled`` (each host holding only the certificate of
the Secret its pod mounts), Redis behind a password read from a file (the mounted Secret), and two
replay shards (``replay.shards: 2``: a comma-separated AMPRL_REPLAY_ADDRESS, one Redis per
shard). Training must progress, which proves no service depends on localhost."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from amprl.common.redis_server import redis_server_binary
from amprl.replay.client import shard_for

from .conftest import TINY_CONFIG
from .tls import make_role_dirs

PORTS = {"redis-0": 6379, "redis-1": 6380, "replay": 7000, "ps": 50051, "ps_pull": 50052,
         "learner": 50061, "evaluator": 50071, "actor": 50081}

# Runs inside a namespace (traffic to namespace addresses never leaves them): waits until
# training has visibly progressed, then prints what it saw as JSON.
PROBE = textwrap.dedent("""
    import json, os, sys, time
    from amprl.common.channels import make_channel
    from amprl.v1 import paramserver_pb2, paramserver_pb2_grpc, replay_pb2, replay_pb2_grpc
    from amprl.v1 import telemetry_pb2, telemetry_pb2_grpc
    shards = [replay_pb2_grpc.ReplayServiceStub(make_channel(a, server_role="replay"))
              for a in os.environ["PROBE_REPLAY"].split(",")]
    ps = paramserver_pb2_grpc.ParameterServiceStub(
        make_channel(os.environ["PROBE_PS"], server_role="paramserver"))
    ev = telemetry_pb2_grpc.EvaluatorServiceStub(
        make_channel(os.environ["PROBE_EVAL"], server_role="evaluator"))
    deadline = time.monotonic() + float(os.environ["PROBE_TIMEOUT_S"])
    seen = {}
    while time.monotonic() < deadline:
        try:
            rs = [r.Info(replay_pb2.ReplayServiceInfoRequest(), timeout=5, wait_for_ready=True)
                  for r in shards]
            p = ps.Info(paramserver_pb2.ParameterServiceInfoRequest(), timeout=5, wait_for_ready=True)
            e = ev.Info(telemetry_pb2.EvaluatorServiceInfoRequest(), timeout=5, wait_for_ready=True)
        except Exception as exc:
            seen["error"] = repr(exc)
            time.sleep(0.5)
            continue
        seen = {"shard_env_steps": [r.env_steps_total for r in rs],
                "shard_sampled": [r.sampled_total for r in rs],
                "shard_actors_live": [r.actors_live for r in rs],
                "version": p.version, "ps_actors_live": p.actors_live,
                "learners_live": p.learners_live, "evaluations": len(e.evaluations),
                "evaluated_version": max([x.param_version for x in e.evaluations] or [0])}
        if (seen["version"] >= 20 and min(seen["shard_env_steps"]) >= 1000
                and min(seen["shard_sampled"]) > 0 and seen["evaluated_version"] > 0
                and seen["shard_actors_live"] == [1, 1] and seen["ps_actors_live"] == 2):
            break
        time.sleep(0.5)
    print(json.dumps(seen))
""")

def rendered_tls(release: str = "myrun") -> dict[str, dict]:
    """What the chart renders with ``tls.enabled`` for each workload: its TLS variables and
    the Secret mounted at AMPRL_TLS_CERT_DIR, by component."""
    import helm_python

    chart = helm_python.Chart.load(Path(__file__).resolve().parents[3] / "charts" / "amprl")
    out = chart.render(values={"tls": {"enabled": True}}, name=release, namespace="rl",
                       is_install=True)
    found = {}
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if not doc or doc.get("kind") not in ("Deployment", "StatefulSet"):
                continue
            pod = doc["spec"]["template"]["spec"]
            container = pod["containers"][0]
            env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            if "AMPRL_TLS_CERT_DIR" not in env:
                continue  # Redis
            mount = next(m["name"] for m in container["volumeMounts"]
                         if m["mountPath"] == env["AMPRL_TLS_CERT_DIR"])
            volume = next(v for v in pod["volumes"] if v["name"] == mount)
            component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
            found[component] = {"server_name": env["AMPRL_TLS_SERVER_NAME"],
                                "secret": volume["secret"]["secretName"]}
    return found


# Runs in an actor's namespace with that actor's certificate: what it may not do.
INTRUDER = textwrap.dedent("""
    import json, os, grpc, torch
    from amprl.paramserver.client import ParameterClient
    from amprl.wire.compressed import encode
    result = {}
    with ParameterClient(os.environ["PROBE_PS"], "actor:intruder", timeout_s=10) as client:
        version, weights = client.pull()
        try:
            client.push(version, [encode(n, torch.full_like(w, 1e3), "fp32") for n, w in weights.items()])
            result["push"] = "OK"
        except grpc.RpcError as exc:
            result["push"] = exc.code().name
            result["push_details"] = exc.details()
    with grpc.insecure_channel(os.environ["PROBE_PS"]) as plain:
        try:
            grpc.channel_ready_future(plain).result(timeout=3)
            result["plaintext"] = "connected"
        except grpc.FutureTimeoutError:
            result["plaintext"] = "refused"
    print(json.dumps(result))
""")


@pytest.mark.slow
@pytest.mark.netns
def test_training_progresses_with_every_service_on_its_own_host(netns_topology, tmp_path):
    topo = netns_topology(["redis", "replay-0", "replay-1", "ps", "learner", "actor-0", "actor-1",
                           "evaluator"])
    # TLS as the chart renders it: each component's Secret (<release>-amprl-tls-<role>)
    # becomes a folder of the certificates `amprl certs` makes for that role
    tls = rendered_tls()
    server_name = tls["replay"]["server_name"]
    role_dirs = make_role_dirs(tmp_path / "tls", server_name=server_name, release="myrun")
    certs = {component: role_dirs[t["secret"].rsplit("-tls-", 1)[1]] for component, t in tls.items()}
    assert {c: d.name for c, d in certs.items()} == {
        "replay": "replay", "paramserver": "paramserver", "learner": "learner", "actor": "actor",
        "evaluator": "evaluator"}, certs
    (tmp_path / "redis-password").write_text("s3cret:/@pw\n")  # URL-hostile on purpose
    config = tmp_path / "experiment.yaml"
    config.write_text(TINY_CONFIG)
    addr = {name: host.address for name, host in topo.hosts.items()}
    # Shard i is listed i-th; actor-0 hashes to shard 0 and actor-1 to shard 1 (shard_for).
    replay_address = ",".join(f"{addr[f'replay-{i}']}:{PORTS['replay']}" for i in range(2))
    ps_push = f"{addr['ps']}:{PORTS['ps']}"
    ps_pull = f"{addr['ps']}:{PORTS['ps_pull']}"

    def env(host: str, port: int, **extra: str) -> dict[str, str]:
        component = {"ps": "paramserver"}.get(host.split("-")[0], host.split("-")[0])
        return {"AMPRL_CONFIG": str(config), "AMPRL_HOST": addr[host], "AMPRL_PORT": str(port),
                "AMPRL_TLS_CERT_DIR": str(certs[component]),
                "AMPRL_TLS_SERVER_NAME": tls[component]["server_name"],
                "AMPRL_ID": host, "AMPRL_LIVE_WINDOW_S": "5", "PYTHONUNBUFFERED": "1", **extra}

    py = sys.executable
    procs = {}
    for i in range(2):
        port = PORTS[f"redis-{i}"]
        procs[f"redis-{i}"] = topo["redis"].exec([
            redis_server_binary(), "--bind", addr["redis"], "--port", str(port), "--requirepass",
            "s3cret:/@pw", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)])
        topo["redis"].wait_port(port, proc=procs[f"redis-{i}"])
        procs[f"replay-{i}"] = topo[f"replay-{i}"].exec([py, "-m", "amprl.cli", "replay"], env=env(
            f"replay-{i}", PORTS["replay"], AMPRL_REDIS_URL=f"redis://{addr['redis']}:{port}/0",
            AMPRL_REDIS_PASSWORD_FILE=str(tmp_path / "redis-password")))
    procs["ps"] = topo["ps"].exec([py, "-m", "amprl.cli", "paramserver"],
                                  env=env("ps", PORTS["ps"], AMPRL_PULL_PORT=str(PORTS["ps_pull"])))
    procs["learner"] = topo["learner"].exec([py, "-m", "amprl.cli", "learner"], env=env(
        "learner", PORTS["learner"], AMPRL_REPLAY_ADDRESS=replay_address,
        AMPRL_PARAMSERVER_ADDRESS=ps_push))
    for a in ("actor-0", "actor-1"):
        procs[a] = topo[a].exec([py, "-m", "amprl.cli", "actor"], env=env(
            a, PORTS["actor"], AMPRL_REPLAY_ADDRESS=replay_address, AMPRL_PARAMSERVER_ADDRESS=ps_pull))
    procs["evaluator"] = topo["evaluator"].exec([py, "-m", "amprl.cli", "evaluator"], env=env(
        "evaluator", PORTS["evaluator"], AMPRL_PARAMSERVER_ADDRESS=ps_pull,
        AMPRL_RUN_DIR=str(tmp_path / "eval")))

    # Asked from the evaluator's namespace, over TLS, like any other pod of the release.
    probe_env = {"AMPRL_TLS_CERT_DIR": str(role_dirs["operator"]), "AMPRL_TLS_SERVER_NAME": server_name,
                 "PROBE_REPLAY": replay_address, "PROBE_PS": ps_pull,
                 "PROBE_EVAL": f"{addr['evaluator']}:{PORTS['evaluator']}", "PROBE_TIMEOUT_S": "100"}
    out = topo["evaluator"].run([py, "-c", PROBE], env=probe_env, timeout=150)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # Each actor fills its own shard (and so its own Redis).
    assert shard_for("actor-0", 2) == 0 and shard_for("actor-1", 2) == 1

    dead = {name: topo.read_log(p) for name, p in procs.items() if p.poll() is not None}
    assert not dead, f"exited: {dead}"
    assert seen.get("version", 0) >= 20, seen
    assert min(seen["shard_env_steps"]) >= 1000, seen  # each actor fills its own shard
    assert min(seen["shard_sampled"]) > 0, seen  # the learner samples from both
    assert seen["evaluated_version"] > 0, seen
    assert seen["shard_actors_live"] == [1, 1] and seen["ps_actors_live"] == 2, seen
    assert seen["learners_live"] == 1, seen
    for name in ("replay-0", "replay-1", "ps", "learner", "evaluator"):
        assert "Traceback" not in topo.read_log(procs[name], max_bytes=100_000), name

    # An actor's certificate gets the weights but cannot write them, even on the push
    # port that the learner uses; a client without a certificate never connects.
    intruder = topo["actor-0"].run([py, "-c", INTRUDER], env={
        "AMPRL_TLS_CERT_DIR": str(certs["actor"]), "AMPRL_TLS_SERVER_NAME": server_name,
        "PROBE_PS": ps_push}, timeout=60)
    tried = json.loads(intruder.stdout.strip().splitlines()[-1])
    assert tried["push"] == "PERMISSION_DENIED" and "learner role" in tried["push_details"], tried
    assert tried["plaintext"] == "refused", tried
