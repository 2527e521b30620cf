"""A cluster run that ends: the evaluator keeps the run's record on a claim of its own and
reads replay's env-step count, actors and learners know where to ask whether the run goes
on, and a Job completes when it has finished, which `kubectl wait` observes."""

from __future__ import annotations

import re

import pytest

from chartkit import CHART, NAMESPACE, RELEASE, render_docs

from amprl.launch.status import parse_args as status_args

COMPONENT = "app.kubernetes.io/component"
WAIT = (f"kubectl -n {NAMESPACE} wait --for=condition=complete job -l "
        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=done --timeout=24h")


def by_component(docs, kind):
    return {d["metadata"]["labels"].get(COMPONENT): d for d in docs if d["kind"] == kind}


def container_env(doc) -> dict:
    return {e["name"]: e.get("value") for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]}


def done_job(docs):
    (job,) = [d for d in docs if d["kind"] == "Job"]
    return job


def test_the_evaluators_record_lives_on_its_own_claim_and_it_counts_the_fleets_env_steps(rendered):
    docs, notes = rendered["defaults"]
    evaluator = by_component(docs, "Deployment")["evaluator"]
    spec = evaluator["spec"]["template"]["spec"]
    assert evaluator["spec"]["strategy"]["type"] == "Recreate"  # one writer of the claim
    env = container_env(evaluator)
    run = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}["run"]
    assert run == env["AMPRL_RUN_DIR"] == "/var/lib/amprl"
    volume = {v["name"]: v for v in spec["volumes"]}["run"]
    assert volume == {"name": "run", "persistentVolumeClaim": {"claimName": f"{RELEASE}-amprl-evaluator"}}
    claim = by_component(docs, "PersistentVolumeClaim")["evaluator"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert env["AMPRL_REPLAY_ADDRESS"] == container_env(by_component(docs, "Deployment")["actor"])["AMPRL_REPLAY_ADDRESS"]
    assert f"persistentvolumeclaim/{RELEASE}-amprl-evaluator (kept after `helm uninstall`)" in notes


def test_an_existing_claim_is_used_as_is():
    docs, _ = render_docs({"evaluator": {"persistence": {"existingClaim": "last-run", "keep": False}}})
    assert "evaluator" not in by_component(docs, "PersistentVolumeClaim")
    spec = by_component(docs, "Deployment")["evaluator"]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in spec["volumes"]}["run"]["persistentVolumeClaim"]["claimName"] == "last-run"


def test_workers_ask_the_evaluator_and_without_one_nothing_ends():
    docs, _ = render_docs({})
    address = f"{RELEASE}-amprl-evaluator.{NAMESPACE}.svc.cluster.local:50055"
    for component in ("actor", "learner"):
        assert container_env(by_component(docs, "Deployment")[component])["AMPRL_EVALUATOR_ADDRESS"] == address
    assert container_env(done_job(docs))["AMPRL_EVALUATOR_ADDRESS"] == address
    off, notes = render_docs({"evaluator": {"enabled": False}})
    for component in ("actor", "learner"):
        assert "AMPRL_EVALUATOR_ADDRESS" not in container_env(by_component(off, "Deployment")[component])
    assert not [d for d in off if d["kind"] == "Job" or d["metadata"]["labels"].get(COMPONENT) == "done"]
    assert "evaluator" not in by_component(off, "PersistentVolumeClaim") and "wait --for" not in notes


def test_the_done_job_runs_amprl_status_wait_on_the_evaluator_in_a_restricted_pod(rendered):
    docs, notes = rendered["defaults"]
    job = done_job(docs)
    assert re.fullmatch(rf"{RELEASE}-amprl-done-[0-9a-f]{{8}}", job["metadata"]["name"])
    assert job["metadata"]["labels"][COMPONENT] == "done"
    assert job["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE  # what WAIT selects
    assert WAIT in notes
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure" and pod["automountServiceAccountToken"] is False
    c = pod["containers"][0]
    env = container_env(job)
    args = [env["AMPRL_EVALUATOR_ADDRESS"] if a == "$(AMPRL_EVALUATOR_ADDRESS)" else a for a in c["args"]]
    assert args[0] == "status"
    parsed = status_args(args[1:])  # the image's entry point is `amprl`
    assert parsed.wait and parsed.evaluator == [env["AMPRL_EVALUATOR_ADDRESS"]] and parsed.interval == 10
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsUser"] >= 10000
    assert {"cpu", "memory"} <= set(c["resources"]["limits"]) and {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}
    assert c["image"] == by_component(docs, "Deployment")["evaluator"]["spec"]["template"]["spec"]["containers"][0]["image"]


def test_with_tls_the_done_job_holds_the_operators_certificate(rendered):
    docs, _ = rendered["tls"]
    job = done_job(docs)
    pod = job["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]["secretName"] == f"{RELEASE}-amprl-tls-operator"
    env = container_env(job)
    assert env["AMPRL_TLS_CERT_DIR"] == "/etc/amprl/tls" and env["AMPRL_TLS_SERVER_NAME"] == "amprl.rl.svc"


def test_the_jobs_name_changes_with_what_its_pod_is_made_of_and_only_then():
    """A Job's pod template cannot change: an upgrade that would change it gets a new Job
    (Helm removes the old name), e.g. a raised step budget, which the new one waits for."""
    def name(values):
        return done_job(render_docs(values)[0])["metadata"]["name"]
    base = name({})
    assert name({"actor": {"replicas": 16}}) == base  # kubectl scale's value: the same Job
    assert name({"image": {"cpu": {"tag": "0.1.1"}}}) != base
    assert name({"experiment": {"run": {"total_env_steps": 200000000}}}) != base
    assert name({"tls": {"enabled": True}}) != base


def test_done_can_be_turned_off():
    docs, notes = render_docs({"done": {"enabled": False}})
    assert not [d for d in docs if d["kind"] == "Job" or d["metadata"]["labels"].get(COMPONENT) == "done"]
    assert "wait --for" not in notes and "amprl fetch --evaluator" in notes


def test_values_document_the_wait_command():
    text = (CHART / "values.yaml").read_text()
    assert ("kubectl wait --for=condition=complete job -l app.kubernetes.io/instance=<release>,"
            "app.kubernetes.io/component=done --timeout=24h") in text


@pytest.mark.parametrize("values", [{}, {"tls": {"enabled": True}}], ids=["plaintext", "tls"])
def test_the_done_job_is_a_valid_batch_v1_job(values):
    import kubernetes_validate

    from chartkit import strip_source
    job = done_job(render_docs(values)[0])
    kubernetes_validate.validate(strip_source(job), "1.28.0", strict=True)


def test_with_cert_manager_the_done_jobs_certificate_is_issued_without_being_asked_for():
    values = {"tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}}}
    docs, notes = render_docs(values)
    operator = [d for d in docs if d["kind"] == "Certificate" and d["spec"]["commonName"] == "operator"]
    assert operator and operator[0]["spec"]["secretName"] == f"{RELEASE}-amprl-tls-operator"
    assert "--from-file=DIR/operator/" not in notes  # no need to make it by hand
    off, _ = render_docs({**values, "done": {"enabled": False}})
    assert not [d for d in off if d["kind"] == "Certificate" and d["spec"]["commonName"] == "operator"]
