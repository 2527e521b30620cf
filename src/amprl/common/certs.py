"""Certificates of mutual TLS: which role a certificate names, and a development CA that
issues one certificate per role (``amprl certs DIR``).

A role certificate says who its holder is in two places, either of which servers accept:
the URI SAN ``spiffe://amprl/<release>/<role>`` (what cert-manager's ``uris`` or a SPIFFE
issuer writes) and, failing that, the subject's CN. It also carries the DNS SAN
``<role>.<server name>``: a client that dials a parameter server expects
``paramserver.<server name>`` in the server's certificate, so an actor's certificate,
which names only ``actor.<server name>``, cannot stand in for the parameter server.

The files of one role are what a Kubernetes TLS Secret holds (``tls.crt``, ``tls.key``,
``ca.crt``), in one folder per role, so a pod mounts its own role's key and no other.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from amprl import errors

ROLES = ("learner", "actor", "evaluator", "replay", "paramserver", "operator")
"""Who may hold a certificate: the five services, and ``operator`` (a person with grpcurl,
``amprl status`` or ``amprl export``: reads only)."""

SPIFFE_PREFIX = "spiffe://amprl/"

DEFAULT_SERVER_NAME = "amprl"
"""The server name of ``amprl certs`` and ``amprl run --tls`` (AMPRL_TLS_SERVER_NAME)."""


def server_name_of(role: str, server_name: str) -> str:
    """The DNS name a server of ``role`` carries and its clients expect."""
    return f"{role}.{server_name}"


def identity_of_certificate(cert: x509.Certificate) -> tuple[str | None, str | None]:
    """(release, role) a certificate names: both from the URI SAN
    ``spiffe://amprl/<release>/<role>``, else (None, the CN); None for a role that is not
    one of ``ROLES``."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    for uri in uris:
        identity = identity_of_uri(uri)
        if identity is not None:
            return identity
    for attr in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME):
        value = attr.value if isinstance(attr.value, str) else attr.value.decode()
        if value in ROLES:
            return None, value
    return None, None


def identity_of_uri(uri: str) -> tuple[str, str] | None:
    """(release, role) of ``spiffe://amprl/<release>/<role>``; None for any other URI."""
    if not uri.startswith(SPIFFE_PREFIX):
        return None
    release, _, role = uri[len(SPIFFE_PREFIX):].rstrip("/").rpartition("/")
    return (release, role) if release and role in ROLES else None


def role_of_certificate(cert: x509.Certificate) -> str | None:
    """The role a certificate names (``identity_of_certificate``), or None."""
    return identity_of_certificate(cert)[1]


def role_of_pem(pem: bytes) -> str | None:
    """``role_of_certificate`` of the first certificate in a PEM (a chain's leaf)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    return role_of_certificate(cert)


def role_of_file(path: Path) -> str:
    """The role of the certificate in ``path``; ConfigError when it names none."""
    return identity_of_file(path)[1]


def identity_of_file(path: Path) -> tuple[str | None, str]:
    """(release, role) of the certificate in ``path`` (release None for a CN-only one);
    ConfigError when it names no role."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise errors.ConfigError(f"{path}: cannot read the certificate ({exc.strerror})") from None
    except ValueError as exc:
        raise errors.ConfigError(f"{path}: not a PEM certificate ({exc})") from None
    release, role = identity_of_certificate(cert)
    if role is None:
        raise errors.ConfigError(
            f"{path}: the certificate names no AMP-RL role; it needs a URI SAN "
            f"{SPIFFE_PREFIX}<release>/<role> or CN=<role>, role one of {', '.join(ROLES)} "
            f"(`amprl certs DIR` makes such certificates)")
    return release, role


def server_name_in(path: Path) -> str:
    """The deployment server name S of a role certificate (its DNS SAN "<role>.S")."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise errors.ConfigError(f"{path}: not a readable certificate ({exc})") from None
    role = role_of_certificate(cert)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = x509.SubjectAlternativeName([])
    for name in names.get_values_for_type(x509.DNSName):
        if role is not None and name.startswith(f"{role}."):
            return name[len(role) + 1:]
    raise errors.ConfigError(f"{path}: no DNS SAN <role>.<server name> for role {role}")


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, mode: int) -> None:
    path.write_bytes(data)
    path.chmod(mode)


def make_ca(folder: Path, *, days: int = 365, name: str = "amprl development CA"
            ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA in ``folder`` (ca.crt, ca.key); returns it and its key."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write(folder / "ca.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(folder / "ca.key", _pem_key(key), 0o600)
    return cert, key


def load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA ``make_ca`` wrote to ``folder``."""
    try:
        cert = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
        key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise errors.ConfigError(f"{folder}: no usable ca.crt and ca.key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise errors.ConfigError(f"{folder}/ca.key: expected an EC key from `amprl certs`")
    return cert, key


def issue(ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], folder: Path, role: str, *,
          release: str = "local", server_name: str = DEFAULT_SERVER_NAME, days: int = 90,
          extra_dns: tuple[str, ...] = ()) -> Path:
    """Writes ``folder``/tls.crt, tls.key and ca.crt: a certificate for ``role`` signed by
    ``ca`` (client and server use), naming the role by URI SAN and CN and carrying the DNS
    SAN ``<role>.<server_name>`` (plus ``extra_dns``). Returns ``folder``."""
    if role not in ROLES:
        raise errors.ConfigError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    ca_cert, ca_key = ca
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(f"{SPIFFE_PREFIX}{release}/{role}"),
                                     x509.DNSName(server_name_of(role, server_name))]
    names += [x509.DNSName(d) for d in extra_dns]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(folder / "tls.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(folder / "tls.key", _pem_key(key), 0o600)
    _write(folder / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return folder


def make_role_certs(folder: Path, *, roles: tuple[str, ...] = ROLES, release: str = "local",
                    server_name: str = DEFAULT_SERVER_NAME, days: int = 90) -> dict[str, Path]:
    """A development CA in ``folder``/ca (kept, or made when missing) and one folder per
    role beside it (``folder``/<role>/tls.crt, tls.key, ca.crt): what AMPRL_TLS_CERT_DIR of
    each process points at. Returns {role: folder}."""
    ca_dir = folder / "ca"
    ca = load_ca(ca_dir) if (ca_dir / "ca.key").exists() else make_ca(ca_dir)
    return {role: issue(ca, folder / role, role, release=release, server_name=server_name, days=days)
            for role in roles}


def main(argv: list[str] | None = None) -> int:
    """``amprl certs DIR``: a development CA and one certificate per role."""
    import argparse
    import sys
    p = argparse.ArgumentParser(
        prog="amprl certs",
        description="Make a development CA (DIR/ca, kept when it exists) and one certificate "
                    "per role (DIR/<role>/tls.crt, tls.key, ca.crt): what each process's "
                    "AMPRL_TLS_CERT_DIR, or each role's Kubernetes Secret, holds.")
    p.add_argument("dir", type=Path)
    p.add_argument("--release", default="local",
                   help="release name in the URI SAN spiffe://amprl/<release>/<role> (default: local)")
    p.add_argument("--server-name", default=DEFAULT_SERVER_NAME,
                   help="the deployment's server name S (AMPRL_TLS_SERVER_NAME, the chart's "
                        "tls.serverName); role R's certificate carries the DNS SAN R.S "
                        f"(default: {DEFAULT_SERVER_NAME})")
    p.add_argument("--roles", default=",".join(ROLES), help="comma-separated roles (default: all)")
    p.add_argument("--days", type=int, default=90, help="validity of the role certificates")
    args = p.parse_args(argv)
    roles = tuple(r for r in args.roles.split(",") if r)
    try:
        made = make_role_certs(args.dir, roles=roles, release=args.release,
                               server_name=args.server_name, days=args.days)
    except errors.ConfigError as exc:
        print(f"amprl certs: {exc}", file=sys.stderr)
        return 2
    for role, folder in made.items():
        print(f"{role:12s} {folder}  (DNS {server_name_of(role, args.server_name)}, "
              f"URI {SPIFFE_PREFIX}{args.release}/{role})")
    print(f"CA key: {args.dir / 'ca' / 'ca.key'} (keep it off the cluster)")
    return 0
