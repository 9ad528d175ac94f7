"""A kubeconfig `exec` user for tests: a small credential plugin script, written to a folder, that
prints a client.authentication.k8s.io ExecCredential with a bearer token, as the plugins of
managed clusters do (`aws eks get-token`, `gke-gcloud-auth-plugin`, `kubelogin`)."""

from __future__ import annotations

import datetime
import stat
import sys
from pathlib import Path
from typing import Any

API_VERSION = "client.authentication.k8s.io/v1beta1"


def exec_user(
    folder: Path, token: str, expires_in: float | None = None, numbered: bool = False
) -> dict[str, Any]:
    """The kubeconfig `user` entry. The plugin prints `token` (`numbered`: followed by how often
    it has run, so a test sees when it runs again) and counts its runs in `folder/plugin-runs`;
    with `expires_in`, the credential expires that many seconds from now."""
    script = folder / "credential-plugin"
    counter = folder / "plugin-runs"
    expiry = ""
    if expires_in is not None:
        when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=expires_in)
        expiry = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, pathlib\n"
        f"counter = pathlib.Path({str(counter)!r})\n"
        "runs = int(counter.read_text()) + 1 if counter.exists() else 1\n"
        "counter.write_text(str(runs))\n"
        f"status = {{'token': {token!r} + (str(runs) if {numbered!r} else '')}}\n"
        f"if {expiry!r}:\n"
        f"    status['expirationTimestamp'] = {expiry!r}\n"
        f"credential = {{'apiVersion': {API_VERSION!r}, 'kind': 'ExecCredential'}}\n"
        "print(json.dumps(credential | {'status': status}))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {"exec": {"apiVersion": API_VERSION, "command": str(script), "interactiveMode": "Never"}}


def runs(folder: Path) -> int:
    """How often the plugin in `folder` has run."""
    counter = folder / "plugin-runs"
    return int(counter.read_text()) if counter.exists() else 0
