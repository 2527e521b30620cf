"""Mutual TLS in the chart: each pod mounts its own role's key pair and no other, the
cert-manager Certificates issue exactly what the pods mount and what their clients
expect, and TLS off renders none of it."""

from __future__ import annotations

import re

import pytest

from chartkit import NAMESPACE, RELEASE, VALUE_SETS, helm_python, render_docs
from test_chart_semantics import client_addresses

TLS_SETS = sorted(k for k, v in VALUE_SETS.items() if v.get("tls", {}).get("enabled"))
CERT_MANAGER_SETS = sorted(k for k in TLS_SETS if VALUE_SETS[k]["tls"].get("certManager", {}).get("enabled"))
PLAIN_SETS = sorted(set(VALUE_SETS) - set(TLS_SETS))
SERVICE_ROLES = ("learner", "actor", "evaluator", "replay", "paramserver")
COMPONENT = "app.kubernetes.io/component"

# The spec fields and key usages of cert-manager.io/v1 Certificate (cert-manager's API
# reference). kubernetes-validate knows no CRDs, so this is the check of their shape.
CERTIFICATE_SPEC_FIELDS = {
    "secretName", "secretTemplate", "commonName", "dnsNames", "uris", "ipAddresses",
    "emailAddresses", "usages", "duration", "renewBefore", "privateKey", "issuerRef",
    "subject", "isCA", "keystores", "revisionHistoryLimit", "additionalOutputFormats",
    "encodeUsagesInRequest", "literalSubject", "nameConstraints", "otherNames",
    "renewBeforePercentage", "signatureAlgorithm",
}
KEY_USAGES = {
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime",
    "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc",
}
GO_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$")


def role_of(component: str) -> str:
    """The role whose certificate a component's pods hold (followers serve as paramserver;
    the done Job's pod, which only reads the run's state, holds the operator's)."""
    return {"paramserver-follower": "paramserver", "done": "operator"}.get(component, component)


def amprl_pods(docs, jobs: bool = False):
    """(component, pod spec, the AMP-RL container) of every workload except Redis (with
    ``jobs``, the done Job's pod too: a client that serves nothing)."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet") + (("Job",) if jobs else ()):
            pod = doc["spec"]["template"]["spec"]
            if pod["containers"][0]["name"] != "redis":
                yield doc["metadata"]["labels"][COMPONENT], pod, pod["containers"][0]


def secret_names(pod: dict) -> set[str]:
    """Every Secret a pod mounts, directly or projected."""
    names = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    for v in pod.get("volumes", []):
        for source in v.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    return names


def expected_secret(value_set: str, role: str) -> str:
    return (VALUE_SETS[value_set]["tls"].get("secrets", {}).get(role)
            or f"{RELEASE}-amprl-tls-{role}")


def server_name(value_set: str) -> str:
    return VALUE_SETS[value_set]["tls"].get("serverName") or f"{RELEASE}-amprl"


def certificates(docs) -> dict[str, dict]:
    """{role: Certificate} of a rendering, keyed by the role its CN names."""
    certs = [d for d in docs if d["kind"] == "Certificate"]
    by_role = {c["spec"]["commonName"]: c for c in certs}
    assert len(by_role) == len(certs), "two Certificates of one role"
    return by_role


# -- pods ------------------------------------------------------------------------------

@pytest.mark.parametrize("value_set", TLS_SETS)
def test_each_pod_mounts_only_its_own_roles_secret(rendered, value_set):
    docs, _ = rendered[value_set]
    tls_secrets = {expected_secret(value_set, r) for r in SERVICE_ROLES + ("operator",)}
    seen = set()
    for component, pod, c in amprl_pods(docs, jobs=True):
        role = role_of(component)
        own = expected_secret(value_set, role)
        assert secret_names(pod) & tls_secrets == {own}, (component, secret_names(pod))
        tls = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]
        assert tls["secretName"] == own
        assert {i["key"] for i in tls["items"]} == {"tls.crt", "tls.key", "ca.crt"}
        assert tls["defaultMode"] & 0o007 == 0, "the key must not be world-readable"
        mount = {m["name"]: m for m in c["volumeMounts"]}["tls"]
        assert mount["mountPath"] == "/etc/amprl/tls" and mount["readOnly"] is True
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["AMPRL_TLS_CERT_DIR"] == "/etc/amprl/tls"
        assert env["AMPRL_TLS_SERVER_NAME"] == server_name(value_set)
        seen.add(role)
    assert seen == set(SERVICE_ROLES) | {"operator"}  # the done Job's pod: the operator's
    # Redis holds no gRPC key pair.
    for doc in docs:
        if doc["kind"] == "StatefulSet" and doc["metadata"]["labels"][COMPONENT] == "redis":
            assert not secret_names(doc["spec"]["template"]["spec"]) & tls_secrets


@pytest.mark.parametrize("value_set", TLS_SETS)
def test_tls_probes_run_the_healthcheck_module_on_the_containers_own_port(rendered, value_set):
    docs, _ = rendered[value_set]
    for component, _, c in amprl_pods(docs):
        port = {e["name"]: e.get("value") for e in c["env"]}["AMPRL_PORT"]
        for probe, service in (("startupProbe", "liveness"), ("livenessProbe", "liveness"),
                               ("readinessProbe", "")):
            command = c[probe]["exec"]["command"]
            assert command[:3] == ["python", "-m", "amprl.common.healthcheck"], (component, probe)
            assert command[command.index("--port") + 1] == port, (component, probe)
            assert (command[command.index("--service") + 1] if "--service" in command else "") == service


@pytest.mark.parametrize("value_set", PLAIN_SETS)
def test_tls_off_renders_no_certificates_mounts_or_tls_env(rendered, value_set):
    docs, _ = rendered[value_set]
    assert not [d for d in docs if d["kind"] == "Certificate"]
    for component, pod, c in amprl_pods(docs):
        assert "tls" not in {v["name"] for v in pod["volumes"]}, component
        assert not [e for e in c["env"] if e["name"].startswith("AMPRL_TLS")], component
        assert "grpc" in c["readinessProbe"], component


def test_cert_manager_without_tls_renders_no_certificates():
    docs, _ = render_docs({"tls": {"certManager": {"enabled": True, "issuerRef": {"name": "ca"},
                                                   "operator": True}}})
    assert not [d for d in docs if d["kind"] == "Certificate"]


# -- cert-manager ----------------------------------------------------------------------

@pytest.mark.parametrize("value_set", CERT_MANAGER_SETS)
def test_certificates_name_each_role_as_the_servers_read_it(rendered, value_set):
    docs, _ = rendered[value_set]
    certs = certificates(docs)
    # the operator's certificate: for people (certManager.operator), and for the done Job
    values = VALUE_SETS[value_set]
    operator = (values["tls"]["certManager"].get("operator", False)
                or values.get("done", {}).get("enabled", True))
    assert set(certs) == set(SERVICE_ROLES) | ({"operator"} if operator else set())
    issuer = {"kind": "Issuer", "group": "cert-manager.io",
              **VALUE_SETS[value_set]["tls"]["certManager"]["issuerRef"]}
    for role, cert in certs.items():
        spec = cert["spec"]
        assert cert["metadata"]["name"] == f"{RELEASE}-amprl-tls-{role}"
        assert cert["metadata"]["labels"][COMPONENT] == role
        assert spec["uris"] == [f"spiffe://amprl/{RELEASE}/{role}"]
        assert spec["dnsNames"] == [f"{role}.{server_name(value_set)}"]
        assert spec["secretName"] == expected_secret(value_set, role)
        assert spec["issuerRef"] == issuer
        # Every service serves and dials with one key pair; a person only dials.
        usages = set(spec["usages"])
        assert {"digital signature", "client auth"} <= usages
        assert ("server auth" in usages) == (role != "operator"), role
        assert spec["privateKey"]["rotationPolicy"] == "Always"
        assert spec["secretTemplate"]["labels"]["app.kubernetes.io/instance"] == RELEASE


@pytest.mark.parametrize("value_set", CERT_MANAGER_SETS)
def test_certificates_issue_exactly_the_secrets_the_pods_mount(rendered, value_set):
    docs, _ = rendered[value_set]
    certs = certificates(docs)
    for component, pod, _ in amprl_pods(docs, jobs=True):
        mounted = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]["secretName"]
        assert certs[role_of(component)]["spec"]["secretName"] == mounted, component
    issued = [c["spec"]["secretName"] for c in certs.values()]
    assert len(issued) == len(set(issued)), "two roles share a Secret"


@pytest.mark.parametrize("value_set", CERT_MANAGER_SETS)
def test_every_client_finds_the_name_it_expects_in_its_servers_certificate(rendered, value_set):
    """A client dialing a server of role R expects R.<AMPRL_TLS_SERVER_NAME> (its own,
    from the env); the server's pod mounts the Secret of a Certificate that carries it. A
    probe dials its own pod with its own certificate, so the same holds for each pod."""
    docs, _ = rendered[value_set]
    certs = certificates(docs)
    pods = {component: (pod, c) for component, pod, c in amprl_pods(docs, jobs=True)}
    by_secret = {cert["spec"]["secretName"]: cert for cert in certs.values()}
    flows = {(client, server) for client, _, server, _ in client_addresses(value_set) if server != "redis"}
    flows |= {(component, component) for component in pods}  # the probes
    for client, server in flows:
        _, client_container = pods[client]
        name = {e["name"]: e.get("value") for e in client_container["env"]}["AMPRL_TLS_SERVER_NAME"]
        server_pod, _ = pods[server]
        mounted = {v["name"]: v for v in server_pod["volumes"]}["tls"]["secret"]["secretName"]
        assert f"{role_of(server)}.{name}" in by_secret[mounted]["spec"]["dnsNames"], (client, server)


@pytest.mark.parametrize("value_set", CERT_MANAGER_SETS)
def test_certificates_use_only_cert_manager_v1_fields(rendered, value_set):
    docs, _ = rendered[value_set]
    for cert in certificates(docs).values():
        assert cert["apiVersion"] == "cert-manager.io/v1"
        spec = cert["spec"]
        assert set(spec) <= CERTIFICATE_SPEC_FIELDS, set(spec) - CERTIFICATE_SPEC_FIELDS
        assert set(spec["usages"]) <= KEY_USAGES
        assert set(spec["privateKey"]) <= {"algorithm", "encoding", "rotationPolicy", "size"}
        assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")
        assert spec["privateKey"]["encoding"] in ("PKCS1", "PKCS8")
        assert set(spec["issuerRef"]) <= {"name", "kind", "group"} and spec["issuerRef"]["name"]
        assert GO_DURATION.match(spec["duration"]) and GO_DURATION.match(spec["renewBefore"])
        for name in spec["dnsNames"]:
            assert len(name) <= 253 and all(
                re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", label) for label in name.split(".")), name


def test_the_evaluator_gets_no_certificate_when_disabled():
    docs, _ = render_docs({"evaluator": {"enabled": False},
                           "tls": {"enabled": True, "certManager": {"enabled": True,
                                                                    "issuerRef": {"name": "ca"}}}})
    assert set(certificates(docs)) == {"learner", "actor", "replay", "paramserver"}


# -- refused settings ------------------------------------------------------------------

def test_render_refuses_the_removed_single_secret_with_the_way_forward():
    with pytest.raises(helm_python.HelmError) as info:
        render_docs({"tls": {"enabled": True, "secretName": "amprl-tls"}})
    assert "tls.secretName" in str(info.value) and "tls.secrets.<role>" in str(info.value)


def test_render_refuses_two_roles_sharing_a_secret():
    with pytest.raises(helm_python.HelmError, match="tls.secrets.learner and tls.secrets.actor"):
        render_docs({"tls": {"enabled": True, "secrets": {"learner": "keys", "actor": "keys"}}})
    # A renamed Secret may not collide with another role's default name either.
    with pytest.raises(helm_python.HelmError, match="own key pair"):
        render_docs({"tls": {"enabled": True, "secrets": {"actor": f"{RELEASE}-amprl-tls-paramserver"}}})


@pytest.mark.parametrize("values, where", [
    ({"tls": {"certManager": {"enabled": True}}}, "/tls/certManager/issuerRef/name"),
    ({"tls": {"certManager": {"duration": "90 days"}}}, "/tls/certManager/duration"),
    ({"tls": {"certManager": {"renewBefore": "1d"}}}, "/tls/certManager/renewBefore"),
    ({"tls": {"secrets": {"redis": "x"}}}, "redis"),
    ({"tls": {"secrets": {"actor": "Actor_Keys"}}}, "/tls/secrets/actor"),
    ({"tls": {"serverName": "Not A Name"}}, "/tls/serverName"),
])
def test_schema_rejects_bad_tls_values_naming_the_key(chart, values, where):
    with pytest.raises(helm_python.HelmValuesError) as info:
        chart.validate_schema(values)
    assert where in str(info.value)


def test_notes_show_grpcurl_with_the_operator_certificate_and_each_servers_name(rendered):
    _, notes = rendered["tls-cert-manager"]
    secret = f"{RELEASE}-amprl-tls-operator"
    assert f"kubectl -n {NAMESPACE} get secret {secret} -o jsonpath='{{.data.tls\\.key}}'" in notes
    assert 'G="grpcurl -cacert ca.crt -cert tls.crt -key tls.key"' in notes
    for role, port in (("replay", 50051), ("paramserver", 50052), ("learner", 50053),
                       ("actor", 50054), ("evaluator", 50055)):
        assert f"$G -servername {role}.{RELEASE}-amprl localhost:{port}" in notes, role
    _, notes = rendered["tls"]
    assert "$G -servername replay.amprl.rl.svc localhost:50051 list" in notes
    assert "--from-file=DIR/operator/" in notes  # no operator Certificate: how to make one
