"""Who may call what (amprl.common.authz) and what a certificate says of its holder
(amprl.common.certs), as plain functions."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from amprl import errors
from amprl.common import authz, certs
from amprl.v1 import paramserver_pb2, replay_pb2, telemetry_pb2


def every_rpc() -> list[str]:
    return [f"/{service.full_name}/{method.name}"
            for module in (paramserver_pb2, replay_pb2, telemetry_pb2)
            for service in module.DESCRIPTOR.services_by_name.values()
            for method in service.methods]


def test_every_rpc_in_the_protos_has_a_rule_and_no_rule_names_a_missing_rpc():
    assert set(every_rpc()) == set(authz.POLICY)
    for roles in authz.POLICY.values():
        assert roles and roles <= set(certs.ROLES)


@pytest.mark.parametrize("method,allowed", [
    ("/amprl.v1.ParameterService/PushGradients", {"learner"}),
    ("/amprl.v1.ReplayService/Sample", {"learner"}),
    ("/amprl.v1.ReplayService/UpdatePriorities", {"learner"}),
    ("/amprl.v1.ReplayService/Insert", {"actor"}),
    ("/amprl.v1.ParameterService/PullParameters", set(certs.ROLES)),
    ("/amprl.v1.ParameterService/WatchParameters", set(certs.ROLES)),
    ("/amprl.v1.ReplayService/Info", set(certs.ROLES)),
    ("/grpc.health.v1.Health/Check", set(certs.ROLES)),
])
def test_the_issue_s_table_of_who_may_call_what(method, allowed):
    assert {r for r in certs.ROLES if not authz.refusal(method, r)} == allowed


def test_a_refusal_names_the_role_needed_and_the_role_held():
    why = authz.refusal("/amprl.v1.ParameterService/PushGradients", "actor")
    assert why == ("/amprl.v1.ParameterService/PushGradients needs the learner role; "
                   "this call came with the actor role")
    assert "names no role" in authz.refusal("/amprl.v1.ReplayService/Info", None)
    assert "not open to any role" in authz.refusal("/amprl.v1.ReplayService/Drop", "learner")


def _cert(cn: str, uris: list[str]) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ca")]))
               .public_key(key.public_key()).serial_number(1)
               .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1)))
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]), False)
    return builder.sign(key, hashes.SHA256())


def test_the_role_comes_from_the_spiffe_uri_first_then_the_common_name():
    assert certs.role_of_certificate(_cert("learner", ["spiffe://amprl/prod/actor"])) == "actor"
    assert certs.role_of_certificate(_cert("evaluator", [])) == "evaluator"
    assert certs.role_of_certificate(_cert("evaluator", ["spiffe://other/prod/learner"])) == "evaluator"
    assert certs.role_of_certificate(_cert("someone", ["spiffe://amprl/prod/root"])) is None


def test_amprl_certs_writes_one_folder_per_role_and_keeps_its_ca(tmp_path, capsys):
    assert certs.main([str(tmp_path), "--release", "r1", "--server-name", "s.example"]) == 0
    ca_before = (tmp_path / "ca" / "ca.crt").read_bytes()
    for role in certs.ROLES:
        folder = tmp_path / role
        assert certs.role_of_file(folder / "tls.crt") == role
        assert certs.server_name_in(folder / "tls.crt") == "s.example"
        assert (folder / "ca.crt").read_bytes() == ca_before
        assert (folder / "tls.key").stat().st_mode & 0o077 == 0  # private to its owner
        cert = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"spiffe://amprl/r1/{role}"]
        assert san.get_values_for_type(x509.DNSName) == [f"{role}.s.example"]
    # Run again (to rotate the role certificates): the same CA signs the new ones.
    assert certs.main([str(tmp_path), "--roles", "actor"]) == 0
    assert (tmp_path / "ca" / "ca.crt").read_bytes() == ca_before
    assert "actor" in capsys.readouterr().out
    with pytest.raises(errors.ConfigError, match="names no AMP-RL role"):
        certs.role_of_file(tmp_path / "ca" / "ca.crt")


def test_a_server_admits_only_its_own_release_when_its_certificate_names_one():
    assert authz.release_refusal("prod", "prod") == ""
    assert "release 'prod'" in authz.release_refusal("prod", "staging")
    assert "CN-only" in authz.release_refusal("prod", None)
    assert authz.release_refusal(None, "anything") == ""  # a CN-only server has none to compare
    assert certs.identity_of_uri("spiffe://amprl/my-run/learner") == ("my-run", "learner")
    assert certs.identity_of_uri("spiffe://amprl/learner") is None  # no release
    assert certs.identity_of_uri("spiffe://amprl/x/admin") is None
