"""A throwaway CA and server certificate for TLS tests (openssl CLI)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def make_cert_dir(folder: Path, server_name: str = "amprl.test") -> Path:
    """Writes ca.crt, tls.crt and tls.key (what the chart mounts from its TLS Secret) for
    a certificate naming ``server_name``; returns ``folder``."""
    if not shutil.which("openssl"):
        pytest.skip("openssl not installed")
    folder.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "1", "-subj", "/CN=amprl-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
            "-subj", f"/CN={server_name}")
    (folder / "san.ext").write_text(f"subjectAltName=DNS:{server_name}\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "tls.crt", "-days", "1", "-extfile", "san.ext")
    for f in folder.iterdir():
        f.chmod(0o644)  # readable by the service processes
    return folder
