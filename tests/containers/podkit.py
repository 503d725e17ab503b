"""The shipped DaemonSet, run under podman: what the container tests start.

:func:`daemon_args` reads ``deploy/daemonset.yaml`` and turns the agent's pod
spec into ``podman run`` arguments, so that the tests grant exactly what the
DaemonSet grants (hostPID, capabilities, seccomp, read-only root, user,
volumes, environment, memory limit, arguments) and nothing else.  What
differs from a kubelet is said where it happens:

* hostPath volumes may be redirected to other host paths (``remap``): the
  tests keep the control socket, the HAMi region files and the driver library
  (the stand-in's) in private directories; the mount points in the container
  are the DaemonSet's.
* hostPath volumes of type "" whose host path does not exist are left out
  (the kubelet would bind an empty directory; there is nothing to see).
* emptyDir volumes are tmpfs mounts; the ConfigMap is a host directory
  holding its files with the ConfigMap's defaultMode, mounted read-only.
* ``appArmorProfile: Unconfined`` becomes ``--security-opt apparmor=unconfined``
  only where AppArmor is enabled (podman refuses the option otherwise).
* No image pull, no readiness probe (the tests poll the socket themselves),
  no network policy: the container is on podman's default network.
"""
from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

import yaml

REPO = Path(__file__).resolve().parents[2]
DAEMONSET = REPO / "deploy" / "daemonset.yaml"
CONFIGMAP = REPO / "deploy" / "policy-configmap.yaml"


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """``podman ARGS``; an AssertionError with its stderr if it fails and ``check``."""
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r


def ulimit_args() -> list[str]:
    """deploy/podman-ulimits.sh's flags (empty where podman's defaults work)."""
    out = subprocess.run(["bash", str(REPO / "deploy" / "podman-ulimits.sh")],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def _docs(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def daemonset() -> dict:
    return next(d for d in _docs(DAEMONSET) if d["kind"] == "DaemonSet")


def policy_configmap() -> dict:
    return next(d for d in _docs(CONFIGMAP) if d["kind"] == "ConfigMap")


def pod_spec() -> dict:
    return daemonset()["spec"]["template"]["spec"]


def agent_container() -> dict:
    return next(c for c in pod_spec()["containers"] if c["name"] == "hami-bpf")


def _apparmor_enabled() -> bool:
    try:
        return Path("/sys/module/apparmor/parameters/enabled").read_text().strip() == "Y"
    except OSError:
        return False


def _memory(q: str) -> str:
    for suf, mult in (("Gi", "g"), ("Mi", "m"), ("Ki", "k")):
        if q.endswith(suf):
            return q[: -len(suf)] + mult
    return q


def daemon_args(*, name: str, image: str, remap: Mapping[str, str],
                configmap_dir: Path, extra_args: Sequence[str] = ()) -> list[str]:
    """``podman run`` arguments (without ``podman run``) for the agent."""
    spec = pod_spec()
    c = agent_container()
    sc = c.get("securityContext", {})
    args: list[str] = ["--detach", "--name", name, *ulimit_args()]
    if spec.get("hostPID"):
        args.append("--pid=host")
    if spec.get("hostNetwork"):
        args.append("--network=host")
    if sc.get("privileged"):
        args.append("--privileged")
    if "runAsUser" in sc:
        args += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if sc.get("readOnlyRootFilesystem"):
        # a kubelet mounts no tmpfs of its own on /run, /tmp, /var/tmp
        args += ["--read-only", "--read-only-tmpfs=false"]
    if sc.get("seccompProfile", {}).get("type") == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    if sc.get("appArmorProfile", {}).get("type") == "Unconfined" and _apparmor_enabled():
        args += ["--security-opt", "apparmor=unconfined"]
    caps = sc.get("capabilities", {})
    for cap in caps.get("drop", []):
        args.append(f"--cap-drop={cap}")
    for cap in caps.get("add", []):
        args.append(f"--cap-add={cap}")
    mem = c.get("resources", {}).get("limits", {}).get("memory")
    if mem:
        args += ["--memory", _memory(mem)]
    for e in c.get("env", []):
        if "value" in e:
            args += ["--env", f"{e['name']}={e['value']}"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            args += ["--env", f"{e['name']}={socket.gethostname()}"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        v = volumes[m["name"]]
        ro = m.get("readOnly", False)
        if "hostPath" in v:
            hp = v["hostPath"]
            host = remap.get(hp["path"], hp["path"])
            kind = hp.get("type", "")
            if kind == "DirectoryOrCreate":
                os.makedirs(host, mode=0o755, exist_ok=True)
            elif not os.path.exists(host):
                if kind in ("Directory", "File"):
                    raise FileNotFoundError(f"hostPath {host} ({m['name']}, type {kind}) is missing")
                continue
            args += ["--volume", f"{host}:{m['mountPath']}{':ro' if ro else ''}"]
        elif "emptyDir" in v:
            size = v["emptyDir"].get("sizeLimit")
            args += ["--mount", f"type=tmpfs,destination={m['mountPath']},tmpfs-mode=0755"
                     + (f",tmpfs-size={_memory(size)}" if size else "")]
        elif "configMap" in v:
            args += ["--volume", f"{configmap_dir}:{m['mountPath']}:ro"]
        else:
            raise ValueError(f"volume {m['name']}: kind not handled")
    args.append(image)
    args += [*c.get("args", []), *extra_args]
    return args


def write_configmap(dest: Path, text_overrides: Mapping[str, str] | None = None) -> Path:
    """The ConfigMap's files in ``dest`` (root-owned, its defaultMode)."""
    cm = policy_configmap()
    spec = pod_spec()
    mode = next(v["configMap"].get("defaultMode", 0o644) for v in spec["volumes"]
                if "configMap" in v)
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o755)
    data = dict(cm["data"])
    data.update(text_overrides or {})
    for fname, text in data.items():
        p = dest / fname
        if p.exists():
            os.chmod(p, 0o600)
        p.write_text(text)
        os.chown(p, 0, 0)
        os.chmod(p, mode)
    return dest
