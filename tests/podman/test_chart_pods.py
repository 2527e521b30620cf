"""The chart's pods, started from its own render, under podman (issue 36).

The chart is rendered by the real Helm engine (one actor, one replay shard, the system
tests' tiny CartPole DQN); each Deployment's and StatefulSet's pod spec becomes one podman
container (``amprl_testing.podspec``: image, command and args, env with its valueFrom and
$(VAR) references, securityContext, volumes, resource limits, grace period, probes), all
created at once on one internal podman network where aardvark-dns answers the Services'
names (``<svc>.rl.svc.cluster.local``, and ``<pod>.<headless svc>...`` for StatefulSet
pods). A kubelet-like loop runs every pod's startup, liveness and readiness probes as
rendered (gRPC from the node to the pod's address, exec with ``podman exec``).

What differs from the real pods: the Redis pods run ``localhost/amprl-redis-standin:bookworm``
(Debian bookworm's Redis 7.0.15 with GNU coreutils and dash, tests/podman/Containerfile.redis)
instead of ``docker.io/library/redis:7.4.2-alpine`` (Redis 7.4, busybox), which cannot be
pulled here, with the rendered command, config, ACL file, mounts, user and probes. There is
no Kubernetes: no scheduler (requests and node selectors are ignored; limits become
``--cpus``/``--memory``), no kubelet (the probes' outcomes are recorded and asserted, never
acted on: nothing is restarted), no Service virtual IPs (a Service name resolves to the
addresses of every selected pod, ready or not), no NetworkPolicy enforcement (the network
is internal, every pod reaches every other), and a PersistentVolumeClaim is a folder on
the host that lives as long as the test. Secrets and ConfigMaps are plain files with the
rendered modes, not the kubelet's atomically swapped symlinks.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from .conftest import ACTOR, NAMESPACE, RELEASE, Release, wait_for

pytestmark = pytest.mark.timeout(600)

WORKLOADS = {f"{RELEASE}-amprl-{c}": 1 for c in ("redis", "replay", "paramserver", "learner", "evaluator", "actor")}

# Runs inside each pod (python3 is in every image used here): who it runs as, what it may
# do, and how its mounts look from inside.
SANDBOX = """
import json, os, stat, sys
status = dict(l.split(":", 1) for l in open("/proc/self/status"))
def write(path):
    try:
        with open(os.path.join(path, ".probe"), "w") as f: f.write("x")
        os.remove(os.path.join(path, ".probe")); return True
    except OSError as exc: return exc.strerror
mounts = {}
for path in sys.argv[1:]:
    st = os.stat(path)
    entry = {"mode": oct(stat.S_IMODE(st.st_mode)), "gid": st.st_gid}
    if stat.S_ISDIR(st.st_mode): entry["writable"] = write(path)
    else: entry["readable"] = os.access(path, os.R_OK)
    mounts[path] = entry
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
                  "cap_eff": status["CapEff"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
                  "root_writable": write("/"), "hostname": os.uname().nodename, "mounts": mounts}))
"""


def _logs_tail(release: Release, pod) -> str:
    return release.node.logs(pod)[-3000:]


def test_every_pod_of_the_render_starts_becomes_ready_and_runs_as_its_security_context_says(release: Release):
    assert {w: len(release.pods(w)) for w in WORKLOADS} == WORKLOADS
    # The kubelet would wait as long as the startup probes allow (15 min for replay's).
    def all_ready():
        try:  # replay's size from its first answer on, for the training test
            release.replay_seen.append(release.replay())
        except grpc.RpcError:
            pass
        for pod in release.node.pods.values():
            state = release.node.state(pod)
            assert state["Running"], f"{pod.plan.name} exited ({state['ExitCode']}):\n{_logs_tail(release, pod)}"
            assert not pod.record.restart, f"{pod.plan.name}: {pod.record.restart}\n{_logs_tail(release, pod)}"
        return all(p.record.ready_after_s is not None for p in release.node.pods.values())
    wait_for(all_ready, 240, "every pod ready by its probes")
    release.note("all pods ready")
    print({p.plan.name: (p.record.started_after_s, p.record.ready_after_s) for p in release.node.pods.values()})

    for pod in release.node.pods.values():
        plan = pod.plan
        # a ConfigMap or Secret mounted whole: each of its files
        paths = [f"{m.path}/{rel}" if plan.volumes[m.source].kind == "files" and not m.sub_path else m.path
                 for m in plan.mounts for rel in (plan.volumes[m.source].files or [""])]
        proc = release.node.exec(pod, ["python3", "-c", SANDBOX, *paths])
        assert proc.returncode == 0, f"{plan.name}: {proc.stderr}"
        seen = json.loads(proc.stdout)
        assert (seen["uid"], seen["gid"]) == (plan.uid, plan.gid) == (10001, 10001), seen
        assert plan.fs_group in seen["groups"], seen
        assert int(seen["cap_eff"], 16) == 0 and seen["no_new_privs"] == "1", seen
        assert seen["root_writable"] == "Read-only file system", seen
        assert seen["hostname"] == plan.name
        for m in plan.mounts:
            vol = plan.volumes[m.source]
            if vol.kind == "files":  # each file: its rendered mode, group fsGroup, readable
                for rel, (_, mode) in vol.files.items():
                    if m.sub_path and rel != m.sub_path:
                        continue
                    got = seen["mounts"][m.path if m.sub_path else f"{m.path}/{rel}"]
                    assert got == {"mode": oct(mode), "gid": plan.fs_group, "readable": True}, (plan.name, m, got)
            else:  # emptyDir and claims: the pod's group owns them and may write
                got = seen["mounts"][m.path]
                assert got["writable"] is True and got["gid"] == plan.fs_group, (plan.name, m, got)


def test_the_release_trains(release: Release):
    first, ps = release.replay(), release.paramserver().version
    wait_for(lambda: release.paramserver().version > ps + 100, 120, "the parameter version to grow")
    wait_for(lambda: release.replay().env_steps_total > first.env_steps_total + 500, 60, "actors' env steps to grow")
    # from replay's first answer (before or just after the actor's first insert) to now
    early, now = release.replay_seen[0], release.replay()
    assert early.size < now.size <= now.capacity and now.inserted_total > first.inserted_total, (early, now)
    wait_for(lambda: len(release.evaluator().evaluations) >= 3, 60, "three evaluations")
    evals = release.evaluator().evaluations
    versions = [e.param_version for e in evals]
    assert versions == sorted(versions) and versions[-1] > versions[0], versions
    assert all(e.episodes == 2 for e in evals)
    learner = release.learner()
    assert learner.updates > 0 and learner.device == "cpu"
    release.note(f"trained: version {release.paramserver().version}, {len(evals)} evaluations")


def test_actors_go_1_4_2_as_kubectl_scale_adds_and_removes_pods(release: Release):
    wait_for(lambda: release.replay().actors_live == 1, 60, "one live actor")
    release.scale(ACTOR, 4)
    wait_for(lambda: release.replay().insert_streams == 4 and release.replay().actors_live == 4, 120,
             "four actors inserting")
    wait_for(lambda: release.paramserver().actors_live == 4, 60, "four actors pulling weights")
    release.note("4 actors live")
    steps = release.replay().env_steps_total

    leaving = release.scale(ACTOR, 2)
    release.scaled_down_at = time.monotonic()
    release.note(f"2 actors removed (pod, exit code, seconds): {leaving}")
    # SIGTERM: each exits by itself, 0, before the grace period's SIGKILL (137)
    assert len(leaving) == 2 and all(code == 0 for _, code, _ in leaving), leaving
    wait_for(lambda: release.replay().insert_streams == 2, 15, "the leavers' insert streams closed")
    assert len(release.pods(ACTOR)) == 2
    wait_for(lambda: release.replay().env_steps_total > steps, 30, "two actors to go on inserting")


def test_grpcurl_lists_checks_health_and_calls_info_on_every_service(release: Release):
    """From a debug pod on the release's network, by the Services' DNS names: every gRPC
    port of every Service lists its services by reflection, answers health SERVING and
    answers ``Info`` of each AMP-RL service it serves."""
    called = []
    for svc in release.objects.of_kind("Service"):
        for port in svc["spec"]["ports"]:
            if not port["name"].startswith("grpc"):
                continue
            target = f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port['port']}"
            listed = release.grpcurl(target, "list")
            assert listed.returncode == 0, (target, listed.stderr)
            services = listed.stdout.split()
            assert "grpc.health.v1.Health" in services and "grpc.reflection.v1alpha.ServerReflection" in services, \
                (target, services)
            health = release.grpcurl("-d", "{}", target, "grpc.health.v1.Health/Check")
            assert health.returncode == 0 and json.loads(health.stdout) == {"status": "SERVING"}, \
                (target, health.stdout, health.stderr)
            ours = [s for s in services if s.startswith("amprl.v1.")]
            assert ours, (target, services)
            for service in ours:
                info = release.grpcurl("-d", "{}", target, f"{service}/Info")
                assert info.returncode == 0, (target, service, info.stderr)
                json.loads(info.stdout)
                called.append(f"{target} {service}/Info")
    assert {c.split()[1] for c in called} == {f"amprl.v1.{s}/Info" for s in (
        "ReplayService", "ParameterService", "LearnerService", "ActorService", "EvaluatorService")}, called
    print("\n".join(called))


def test_replays_live_count_follows_the_scale_down(release: Release):
    """Replay counts an actor live for ``live_window_seconds`` (60 s, the default the chart
    keeps) after its last insert: the grpcurl test above runs inside that window."""
    assert release.scaled_down_at is not None, "runs after the scaling test"
    window = release.replay().live_window_seconds
    deadline = release.scaled_down_at + window + 20 - time.monotonic()
    wait_for(lambda: release.replay().actors_live == 2, max(deadline, 1),
             f"the leavers to age out of replay's live count ({window:.0f} s window)")
    release.note("replay: 2 actors live")


def test_no_probe_failed_after_startup_and_no_pod_logged_an_error(release: Release):
    for pod in [*release.node.pods.values(), *release.node.gone.values()]:
        rec = pod.record
        assert not rec.restart and not rec.unready, (pod.plan.name, rec)
        assert not rec.failures.get("liveness") and not rec.failures.get("readiness"), (pod.plan.name, rec.failures)
        assert rec.runs.get("liveness", 0) >= 1 or pod.plan.name in release.node.gone, (pod.plan.name, rec.runs)
        log = release.node.logs(pod)
        assert "Traceback" not in log and '"level": "ERROR"' not in log, f"{pod.plan.name}:\n{log[-3000:]}"
    for pod in release.node.pods.values():
        state = release.node.state(pod)
        assert state["Running"] and not state.get("Restarting"), (pod.plan.name, state)
    print({p.plan.name: p.record.runs for p in release.node.pods.values()})
