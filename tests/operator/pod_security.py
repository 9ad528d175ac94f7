"""A checker of Pod Security Standards "restricted" (baseline's rules and restricted's own), as
the Kubernetes documentation states them, for a pod spec; plus the read-only root that Baton
asks of every container on top of the standard."""

from __future__ import annotations

from typing import Any

# Baseline: capabilities a container may add (restricted narrows it to NET_BIND_SERVICE).
RESTRICTED_ADD = {"NET_BIND_SERVICE"}
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
NON_VOLUME_KEYS = {"name"}


def violations(pod: dict[str, Any], read_only_root: bool = True) -> list[str]:
    """What in `pod` (a pod spec) breaks the restricted profile; empty when it passes."""
    found: list[str] = []
    pod_ctx = pod.get("securityContext") or {}
    containers = [
        *(("containers", c) for c in pod.get("containers") or []),
        *(("initContainers", c) for c in pod.get("initContainers") or []),
        *(("ephemeralContainers", c) for c in pod.get("ephemeralContainers") or []),
    ]
    # Baseline.
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"{field} is set")
    if (pod_ctx.get("windowsOptions") or {}).get("hostProcess"):
        found.append("pod hostProcess")
    for sysctl in pod_ctx.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"unsafe sysctl {sysctl.get('name')}")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - NON_VOLUME_KEYS
        if "hostPath" in kinds:
            found.append(f"volume {volume['name']} is a hostPath")
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']} has a type restricted forbids: {kinds}")
    found += _selinux("pod", pod_ctx)
    found += _seccomp_not_unconfined("pod", pod_ctx)
    found += _apparmor("pod", pod_ctx)
    # Restricted: pod-level fields every container may inherit.
    pod_non_root = pod_ctx.get("runAsNonRoot") is True
    pod_seccomp = (pod_ctx.get("seccompProfile") or {}).get("type") in {
        "RuntimeDefault",
        "Localhost",
    }
    if pod_ctx.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    for where, container in containers:
        name = f"{where}[{container.get('name')}]"
        ctx = container.get("securityContext") or {}
        if ctx.get("privileged"):
            found.append(f"{name} is privileged")
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{name} hostProcess")
        if ctx.get("procMount", "Default") != "Default":
            found.append(f"{name} procMount {ctx['procMount']}")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"{name} uses hostPort {port['hostPort']}")
        found += _selinux(name, ctx)
        found += _seccomp_not_unconfined(name, ctx)
        found += _apparmor(name, ctx)
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name} does not set allowPrivilegeEscalation: false")
        if ctx.get("runAsNonRoot") is False or not (pod_non_root or ctx.get("runAsNonRoot")):
            found.append(f"{name} may run as root (runAsNonRoot)")
        if ctx.get("runAsUser") == 0:
            found.append(f"{name} runAsUser 0")
        seccomp = (ctx.get("seccompProfile") or {}).get("type")
        if not (pod_seccomp or seccomp in {"RuntimeDefault", "Localhost"}):
            found.append(f"{name} has no RuntimeDefault or Localhost seccomp profile")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            found.append(f"{name} does not drop ALL capabilities")
        if not set(caps.get("add") or []) <= RESTRICTED_ADD:
            found.append(f"{name} adds capabilities {caps.get('add')}")
        if read_only_root and ctx.get("readOnlyRootFilesystem") is not True:
            found.append(f"{name} has a writable root filesystem")
    return found


def _selinux(where: str, ctx: dict[str, Any]) -> list[str]:
    options = ctx.get("seLinuxOptions") or {}
    bad = options.get("type", "") not in SELINUX_TYPES or options.get("user") or options.get("role")
    return [f"{where} seLinuxOptions {options}"] if bad else []


def _seccomp_not_unconfined(where: str, ctx: dict[str, Any]) -> list[str]:
    kind = (ctx.get("seccompProfile") or {}).get("type")
    return [f"{where} seccomp Unconfined"] if kind == "Unconfined" else []


def _apparmor(where: str, ctx: dict[str, Any]) -> list[str]:
    kind = (ctx.get("appArmorProfile") or {}).get("type")
    return [f"{where} AppArmor Unconfined"] if kind == "Unconfined" else []


def annotation_violations(metadata: dict[str, Any]) -> list[str]:
    """Baseline's AppArmor rule on the older per-container annotations."""
    prefix = "container.apparmor.security.beta.kubernetes.io/"
    return [
        f"annotation {key}: {value}"
        for key, value in (metadata.get("annotations") or {}).items()
        if key.startswith(prefix)
        and value != "runtime/default"
        and not value.startswith("localhost/")
    ]
