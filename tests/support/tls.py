"""A throwaway certificate authority and a server certificate for 127.0.0.1 it signs, made
with the `openssl` command, for the TLS tests (skipped, saying why, where it is missing)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

# What a leaf needs for Python's strict verification: its address as a SAN, not a CA, and the
# key identifiers that chain it to its CA.
_LEAF_EXTENSIONS = """\
subjectAltName = IP:127.0.0.1, DNS:localhost
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


@dataclass(frozen=True)
class Certs:
    """PEM files: the CA's certificate (what clients trust), the server's and its key."""

    ca: Path
    cert: Path
    key: Path


def make_certs(folder: Path) -> Certs:
    """A fresh CA and a 127.0.0.1 certificate under `folder`; skips the test without openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed: cannot make test certificates")
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    cert, key, csr = folder / "cert.pem", folder / "key.pem", folder / "cert.csr"
    extensions = folder / "leaf.ext"
    extensions.write_text(_LEAF_EXTENSIONS)
    steps = [
        ["req", "-x509", *curve, "-keyout", ca_key, "-out", ca, "-days", "2",
         "-subj", "/CN=baton test CA"],
        ["req", *curve, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", extensions],
    ]  # fmt: skip
    for step in steps:
        subprocess.run([openssl, *map(str, step)], check=True, capture_output=True, timeout=30)
    return Certs(ca, cert, key)
