"""Role certificates for mutual-TLS tests, made as `amprl certs` makes them."""

from __future__ import annotations

from pathlib import Path

from amprl.common import certs


def make_role_dirs(folder: Path, server_name: str = "amprl.test", release: str = "test"
                   ) -> dict[str, Path]:
    """A CA in ``folder``/ca and ``folder``/<role>/{tls.crt,tls.key,ca.crt} for every role
    (what each pod mounts from its role's Secret); returns {role: folder}."""
    made = certs.make_role_certs(folder, release=release, server_name=server_name)
    for role_dir in made.values():
        (role_dir / "tls.key").chmod(0o644)  # readable by service processes in namespaces
    return made
