"""Processes in containers, seen from the node: pods, namespaces, their libcuda.

Everything here reads files only (``/proc`` through :mod:`hami_bpf.procfs`),
through small functions that take a ``proc`` root (default ``/proc``) or a
``host`` root (default ``/``), so tests run on fake trees.  No bcc, no Kubernetes API, no network.

What a node agent can learn about a process without the API server
------------------------------------------------------------------
* **Pod UID, QoS class, container ID, runtime** -- from the process's cgroup
  path (``/proc/PID/cgroup``; on v1 and hybrid hosts the hierarchy
  :func:`hami_bpf.procfs.parse_cgroup` picks, the same path that names the
  process's group), which the kubelet and the runtime build from fixed
  patterns: :func:`parse_cgroup_path`.
* **Namespace, pod name, container name** -- not in the cgroup path.  Sources,
  in the order :class:`PodNames` tries them (each is optional, each a
  read-only host path the DaemonSet mounts):

  1. the runtime's OCI bundle of the container, ``config.json``, whose
     annotations the CRI plugin fills in: containerd under
     ``/run/containerd/io.containerd.runtime.v2.task/k8s.io/<id>/``
     (``io.kubernetes.cri.sandbox-namespace``, ``...sandbox-name``,
     ``...container-name``), CRI-O under
     ``/run/containers/storage/overlay-containers/<id>/userdata/``
     (``io.kubernetes.pod.namespace``, ``io.kubernetes.pod.name``,
     ``io.kubernetes.container.name``).  Authoritative; needs ``/run`` of
     the host (read-only) and root.
  2. the kubelet's log symlinks, ``/var/log/containers/
     <pod>_<namespace>_<container>-<container id>.log`` (a naming the kubelet
     has kept since the CRI log layout, Kubernetes 1.14).  Complete and cheap
     (one ``listdir``); needs ``/var/log`` of the host (read-only).
  3. the kubelet's pod log directories, ``/var/log/pods/<namespace>_<pod>_<uid>/``:
     namespace and pod name by pod UID (no container name unless the pod
     has one container).
  4. the process's own environment: ``POD_NAMESPACE``/``POD_NAME``/
     ``CONTAINER_NAME`` if the pod spec injects them through the downward API,
     and ``HOSTNAME`` (the pod name unless ``spec.hostname`` is set).  HAMi's
     device plugin injects ``POD_UID`` hints only in some versions; this is a
     last resort, the workload controls its environment.

  ``/var/lib/kubelet/pods/<uid>/`` holds volumes and an ``etc-hosts`` with
  the pod's hostname, but no namespace and no container IDs: not used.

* **Host pid and in-container pid** -- ``NSpid`` in ``/proc/PID/status``:
  :func:`ns_pids`.  Only correct when the agent's ``/proc`` is the host's
  PID namespace (``hostPID: true`` in the DaemonSet).

* **Which libcuda a process runs** -- ``/proc/PID/maps`` names the file as the
  container sees it and gives its identity (device, inode) as the kernel
  sees it.  A container image that ships its own driver library (CUDA
  forward-compatibility packages put ``libcuda.so.*`` in
  ``/usr/local/cuda/compat``) maps a different file from the host's:
  :func:`mapped_libcuda` returns one :class:`LibRef` per file, with a path the
  agent can open (``/proc/PID/root/<path>``).  :class:`LibTracker` counts
  users per file so probes are attached at the first user and detached after
  the last.

Cgroup paths read through a private cgroup namespace (a containerised agent
without the host's cgroup namespace) start with ``/..`` components; the
parser ignores everything before the ``kubepods`` component.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from . import procfs

__all__ = [
    "LibRef",
    "LibTracker",
    "PodNames",
    "PodRef",
    "ContainerView",
    "describe",
    "is_libcuda_name",
    "mapped_libcuda",
    "normalize_cgroup_path",
    "ns_pids",
    "parse_cgroup_path",
    "parse_maps",
    "proc_cgroup_path",
    "scan_libcuda",
]

QOS_CLASSES = ("guaranteed", "burstable", "besteffort")

# --------------------------------------------------------------------------
# cgroup paths -> pod


@dataclass(frozen=True)
class PodRef:
    """What a cgroup path says about a Kubernetes container.

    ``pod_uid`` is in the API's form (dashes).  ``container_id`` is None for
    a process in the pod's cgroup itself (rare).  ``runtime`` is
    ``"containerd"``, ``"cri-o"``, ``"docker"`` or None when the path does not
    say (the cgroupfs driver with containerd or docker uses the bare ID).
    ``driver`` is ``"systemd"`` or ``"cgroupfs"``.  ``namespace``,
    ``pod_name`` and ``container_name`` are filled in by :class:`PodNames`.
    """

    pod_uid: str
    qos: str | None
    container_id: str | None
    runtime: str | None
    driver: str
    cgroup: str
    namespace: str | None = None
    pod_name: str | None = None
    container_name: str | None = None

    def with_names(self, namespace: str | None, pod_name: str | None,
                   container_name: str | None) -> "PodRef":
        return PodRef(self.pod_uid, self.qos, self.container_id, self.runtime, self.driver,
                      self.cgroup, namespace or self.namespace, pod_name or self.pod_name,
                      container_name or self.container_name)

    @property
    def short_id(self) -> str | None:
        return self.container_id[:12] if self.container_id else None

    def group_name(self) -> str:
        """A readable, stable group name: ``ns/pod/container`` when the names
        are known, else ``pod:<uid>/<short id>``."""
        if self.namespace and self.pod_name:
            return f"{self.namespace}/{self.pod_name}/{self.container_name or self.short_id or '-'}"
        return f"pod:{self.pod_uid}/{self.short_id or '-'}"

    def labels(self) -> dict[str, str]:
        """Prometheus-style labels (empty string when unknown)."""
        return {"namespace": self.namespace or "", "pod": self.pod_name or "",
                "container": self.container_name or "", "pod_uid": self.pod_uid,
                "container_id": self.container_id or ""}


_HEX_ID = r"[0-9a-f]{32,128}"
_UID = r"[0-9a-fA-F][0-9a-fA-F_-]{15,63}"
# systemd slice names: kubepods-<qos>-pod<uid with _>.slice or kubepods-pod<uid>.slice
_SYSTEMD_POD = re.compile(rf"^kubepods(?:-(burstable|besteffort))?-pod({_UID})\.slice$")
_CGROUPFS_POD = re.compile(rf"^pod({_UID})$")
# container leaves: systemd scopes and cgroupfs names
_SCOPE = re.compile(rf"^(cri-containerd|crio|docker|containerd)-({_HEX_ID})\.scope$")
_CRIO_CGROUPFS = re.compile(rf"^crio-({_HEX_ID})$")
_BARE_ID = re.compile(rf"^({_HEX_ID})$")
_RUNTIME_OF_PREFIX = {"cri-containerd": "containerd", "containerd": "containerd",
                      "crio": "cri-o", "docker": "docker"}


def normalize_cgroup_path(path: str) -> str:
    """Drop the ``/..`` prefix a path gets when read from another cgroup
    namespace, and any trailing slash."""
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return "/" + "/".join(parts)


def _uid_from(raw: str) -> str:
    return raw.replace("_", "-").lower()


def parse_cgroup_path(path: str) -> PodRef | None:
    """A Kubernetes container's cgroup path -> :class:`PodRef`; anything else -> None.

    Layouts (``<uid>`` with dashes for cgroupfs, underscores for systemd):

    ==========  =========  ==============================================================
    driver      runtime    path
    ==========  =========  ==============================================================
    cgroupfs    any        ``/kubepods[/burstable|/besteffort]/pod<uid>/<id>``
    cgroupfs    CRI-O      ``.../pod<uid>/crio-<id>``
    systemd     containerd ``/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid>.slice/cri-containerd-<id>.scope``
    systemd     CRI-O      ``.../crio-<id>.scope`` (``crio-conmon-<id>.scope`` is the monitor: None)
    systemd     docker     ``.../docker-<id>.scope``
    ==========  =========  ==============================================================

    What lies above the ``kubepods`` component (a kubelet ``--cgroup-root``)
    and below the container component (a cgroup nested inside the
    container) is ignored.  A path read from inside a private cgroup
    namespace is relative to the reader's own cgroup and starts with ``/..``
    (e.g. ``/../../kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope``
    for an agent in another pod): the pod component alone identifies the pod
    then, and ``qos`` is None where the path no longer says it.
    """
    relative = any(p == ".." for p in path.split("/"))
    norm = normalize_cgroup_path(path)
    parts = norm.split("/")[1:]
    for i in range(len(parts) - 1, -1, -1):
        comp = parts[i]
        m = _SYSTEMD_POD.match(comp)
        if m:
            above = parts[:i]
            if not relative and "kubepods.slice" not in above:
                return None
            return _container(parts[i + 1:], _uid_from(m.group(2)), m.group(1) or "guaranteed",
                              "systemd", norm)
        m = _CGROUPFS_POD.match(comp)
        if m:
            prev = parts[i - 1] if i else None
            if prev in ("burstable", "besteffort"):
                qos = prev
                prev2 = parts[i - 2] if i >= 2 else None
                if prev2 != "kubepods" and not (relative and prev2 is None):
                    return None
            elif prev == "kubepods":
                qos = "guaranteed"
            elif prev is None and relative:
                qos = None
            else:
                return None
            return _container(parts[i + 1:], _uid_from(m.group(1)), qos, "cgroupfs", norm)
    return None


def _container(rest: list[str], uid: str, qos: str | None, driver: str, norm: str) -> PodRef | None:
    if not rest:
        return PodRef(uid, qos, None, None, driver, norm)
    leaf = rest[0]
    if leaf.startswith("crio-conmon-"):
        return None   # CRI-O's per-container monitor, not the workload
    m = _SCOPE.match(leaf)
    if m:
        return PodRef(uid, qos, m.group(2), _RUNTIME_OF_PREFIX[m.group(1)], driver, norm)
    m = _CRIO_CGROUPFS.match(leaf)
    if m:
        return PodRef(uid, qos, m.group(1), "cri-o", driver, norm)
    m = _BARE_ID.match(leaf)
    if m:
        return PodRef(uid, qos, m.group(1), None, driver, norm)
    return None


def proc_cgroup_path(pid: int, proc: str | None = None) -> str | None:
    """The cgroup path of ``pid`` by :func:`hami_bpf.procfs.cgroup_path` (the
    one ``--group-by cgroup`` names groups by); None if gone."""
    return procfs.cgroup_path(pid, proc)


# --------------------------------------------------------------------------
# names: namespace / pod / container


# OCI annotations (containerd CRI plugin, then CRI-O)
_ANN_NS = ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace")
_ANN_POD = ("io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name")
_ANN_CTR = ("io.kubernetes.cri.container-name", "io.kubernetes.container.name")
_ANN_UID = ("io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid")

OCI_BUNDLE_DIRS = (
    "run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
    "run/containers/storage/overlay-containers/{id}/userdata/config.json",
    "var/lib/containers/storage/overlay-containers/{id}/userdata/config.json",
    "run/docker/containerd/daemon/io.containerd.runtime.v2.task/moby/{id}/config.json",
)

# <pod>_<namespace>_<container>-<64 hex>.log ; pod and namespace are DNS names (no '_')
_LOG_LINK = re.compile(r"^([^_]+)_([^_]+)_(.+)-([0-9a-f]{64})\.log$")
# <namespace>_<pod>_<uid>
_POD_LOG_DIR = re.compile(r"^([^_]+)_([^_]+)_([0-9a-fA-F-]{16,64})$")


@dataclass(frozen=True)
class Names:
    namespace: str | None = None
    pod_name: str | None = None
    container_name: str | None = None
    source: str = ""

    def complete(self) -> bool:
        return bool(self.namespace and self.pod_name and self.container_name)


def names_from_oci(container_id: str, host: str = "/") -> Names | None:
    """Annotations of the runtime's OCI bundle for ``container_id``."""
    for pattern in OCI_BUNDLE_DIRS:
        p = os.path.join(host, pattern.format(id=container_id))
        try:
            with open(p, "rb") as f:
                spec = json.load(f)
        except (OSError, ValueError):
            continue
        ann = spec.get("annotations") or {}
        if not isinstance(ann, dict):
            continue
        pick = lambda keys: next((ann[k] for k in keys if ann.get(k)), None)  # noqa: E731
        n = Names(pick(_ANN_NS), pick(_ANN_POD), pick(_ANN_CTR), f"oci:{p}")
        if n.namespace or n.pod_name or n.container_name:
            return n
    return None


def parse_log_link(name: str) -> tuple[str, str, str, str] | None:
    """``<pod>_<ns>_<container>-<id>.log`` -> (pod, namespace, container, id)."""
    m = _LOG_LINK.match(name)
    return (m.group(1), m.group(2), m.group(3), m.group(4)) if m else None


def parse_pod_log_dir(name: str) -> tuple[str, str, str] | None:
    """``<ns>_<pod>_<uid>`` -> (namespace, pod, uid)."""
    m = _POD_LOG_DIR.match(name)
    return (m.group(1), m.group(2), m.group(3).lower()) if m else None


def names_from_env(env: Mapping[str, str]) -> Names | None:
    ns = env.get("POD_NAMESPACE") or env.get("KUBERNETES_POD_NAMESPACE")
    pod = env.get("POD_NAME") or env.get("HOSTNAME")
    ctr = env.get("CONTAINER_NAME")
    if ns or pod or ctr:
        return Names(ns, pod, ctr, "environ")
    return None


class PodNames:
    """Namespace, pod name and container name for a :class:`PodRef`.

    ``host`` is where the node's filesystem is visible (``/`` on the node,
    ``/host`` if the DaemonSet mounts it there).  Directory listings are
    cached and refreshed when a container ID is not found (at most every
    ``refresh_s`` seconds, ``clock`` injectable for tests).
    """

    def __init__(self, host: str = "/", *, use_oci: bool = True, use_logs: bool = True,
                 refresh_s: float = 2.0, clock: Callable[[], float] | None = None):
        import time
        self.host = host
        self.use_oci = use_oci
        self.use_logs = use_logs
        self.refresh_s = refresh_s
        self._clock = clock or time.monotonic
        self._by_cid: dict[str, Names] = {}
        self._by_uid: dict[str, Names] = {}
        self._listed_at: float | None = None

    def _relist(self) -> None:
        now = self._clock()
        if self._listed_at is not None and now - self._listed_at < self.refresh_s:
            return
        self._listed_at = now
        by_cid: dict[str, Names] = {}
        by_uid: dict[str, Names] = {}
        d = os.path.join(self.host, "var/log/containers")
        try:
            for name in os.listdir(d):
                parsed = parse_log_link(name)
                if parsed:
                    pod, ns, ctr, cid = parsed
                    by_cid[cid] = Names(ns, pod, ctr, f"log:{d}")
        except OSError:
            pass
        d = os.path.join(self.host, "var/log/pods")
        try:
            for name in os.listdir(d):
                parsed = parse_pod_log_dir(name)
                if parsed:
                    ns, pod, uid = parsed
                    ctr = None
                    try:
                        ctrs = [c for c in os.listdir(os.path.join(d, name))
                                if os.path.isdir(os.path.join(d, name, c))]
                        ctr = ctrs[0] if len(ctrs) == 1 else None
                    except OSError:
                        pass
                    by_uid[uid] = Names(ns, pod, ctr, f"podlog:{d}")
        except OSError:
            pass
        self._by_cid, self._by_uid = by_cid, by_uid

    def lookup(self, ref: PodRef, env: Mapping[str, str] | None = None) -> Names:
        """Best names for ``ref``; fields nobody knows are None."""
        found: list[Names] = []
        if ref.container_id and self.use_oci:
            n = names_from_oci(ref.container_id, self.host)
            if n:
                if n.complete():
                    return n
                found.append(n)
        if self.use_logs:
            if ref.container_id and ref.container_id not in self._by_cid:
                self._relist()
            elif ref.container_id is None and ref.pod_uid not in self._by_uid:
                self._relist()
            if ref.container_id and ref.container_id in self._by_cid:
                found.append(self._by_cid[ref.container_id])
            if ref.pod_uid in self._by_uid:
                found.append(self._by_uid[ref.pod_uid])
        if env:
            n = names_from_env(env)
            if n:
                found.append(n)
        return _merge(found)

    def resolve(self, ref: PodRef, env: Mapping[str, str] | None = None) -> PodRef:
        n = self.lookup(ref, env)
        return ref.with_names(n.namespace, n.pod_name, n.container_name)


def _merge(found: Iterable[Names]) -> Names:
    ns = pod = ctr = None
    src = []
    for n in found:
        if ns is None and n.namespace:
            ns = n.namespace
        if pod is None and n.pod_name:
            pod = n.pod_name
        if ctr is None and n.container_name:
            ctr = n.container_name
        src.append(n.source)
    return Names(ns, pod, ctr, ",".join(src))


# --------------------------------------------------------------------------
# pid namespaces


ns_pids = procfs.ns_pids


# --------------------------------------------------------------------------
# mapped libraries


_LIBCUDA = re.compile(r"^libcuda\.so(\.\d+)*$")


def is_libcuda_name(path: str) -> bool:
    """``libcuda.so``, ``libcuda.so.1``, ``libcuda.so.580.65.06`` (not
    ``libcudart``, not ``libcuda.so.1.bak``)."""
    return bool(_LIBCUDA.match(os.path.basename(path)))


@dataclass(frozen=True)
class LibRef:
    """One driver library file mapped by a process.

    ``key`` = (device, inode) as ``/proc/PID/maps`` shows them: the file the
    kernel's uprobes attach to (for overlayfs the underlying file, which is
    also what a uprobe on the overlay path resolves to).  ``path`` is the
    name inside the process's mount namespace; ``host_path`` the same file
    reached from the agent (``<proc>/PID/root/<path>``).  ``deleted`` when
    maps marks the file ``(deleted)``: it cannot be opened by name any more.
    """

    dev: int
    inode: int
    path: str
    host_path: str
    pid: int
    deleted: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.inode)

    def __str__(self) -> str:
        return f"{self.path} ({os.major(self.dev)}:{os.minor(self.dev)} inode {self.inode})"


parse_maps = procfs.parse_maps


def _mapped_key(fd: int) -> tuple[int, int] | None:
    """(device, inode) of the file open at ``fd`` as /proc/PID/maps shows it
    (for overlayfs the underlying file, which fstat does not give): map one
    page of it here and read our own maps."""
    import ctypes
    import mmap as mmap_
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = mmap_.PAGESIZE
    addr = libc.mmap(None, size, mmap_.PROT_READ, mmap_.MAP_PRIVATE, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        raw = procfs.maps(os.getpid())
        if raw is None:
            return None
        for start, _e, dev, inode, _perms, _path, _deleted in parse_maps(
                raw.decode(errors="replace")):
            if start == addr:
                return dev, inode
        return None
    finally:
        libc.munmap(addr, size)


def opened_lib(pid: int, fd: int, proc: str | None = None) -> LibRef | None:
    """The file ``pid`` holds open at ``fd`` (the open gate caught it opening
    a driver library), as a LibRef keyed like its mapping will be. Reached
    through /proc/PID/fd/N, so a file unlinked since, or one in another mount
    namespace, is still found. None if the process or the fd is gone."""
    link = procfs.fd_path(int(fd), pid, proc)
    try:
        name = os.readlink(link)
        ours = os.open(link, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        key = _mapped_key(ours)
    finally:
        os.close(ours)
    if key is None:
        return None
    deleted = name.endswith(" (deleted)")
    return LibRef(key[0], key[1], name.removesuffix(" (deleted)"), link, pid, deleted)


def mapped_libcuda(pid: int, proc: str | None = None) -> list[LibRef]:
    """The libcuda.so* files ``pid`` maps, one per file identity, in map order.
    Empty if none or if the process is gone."""
    raw = procfs.maps(pid, proc)
    if raw is None or b"libcuda.so" not in raw:
        return []
    seen: dict[tuple[int, int], LibRef] = {}
    for _s, _e, dev, inode, _perms, path, deleted in parse_maps(raw.decode(errors="replace")):
        if not is_libcuda_name(path) or (dev, inode) in seen:
            continue
        seen[(dev, inode)] = LibRef(dev, inode, path, procfs.root_path(pid, path, proc), pid, deleted)
    return list(seen.values())


def scan_libcuda(proc: str | None = None, skip: Iterable[int] = ()) -> dict[int, list[LibRef]]:
    """Every process that maps a libcuda: ``{pid: [LibRef]}``.  For start-up
    and a periodic fallback; cost is one read of each process's maps."""
    skip = set(skip)
    out: dict[int, list[LibRef]] = {}
    for pid in procfs.pids(proc):
        if pid in skip:
            continue
        libs = mapped_libcuda(pid, proc)
        if libs:
            out[pid] = libs
    return out


def same_file(path: str, ref: LibRef) -> bool:
    """Whether ``path`` (e.g. a configured ``--libcuda``) is the file of ``ref``."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == ref.key


# --------------------------------------------------------------------------
# attach/detach bookkeeping


@dataclass
class _Entry:
    lib: LibRef
    users: set[int] = field(default_factory=set)
    pinned: bool = False


class LibTracker:
    """Which library file (by :attr:`LibRef.key`) is used by which live pids.

    Pure bookkeeping; the caller attaches and detaches.  A *pinned* library
    (configured with ``--libcuda``, attached at start-up) is never reported
    for detaching.

    Example: ``add(10, lib)`` -> True (first user: attach); ``add(11, lib)``
    -> False; ``remove_pid(10)`` -> []; ``remove_pid(11)`` -> [lib] (last
    user gone: detach).
    """

    def __init__(self) -> None:
        self._libs: dict[tuple[int, int], _Entry] = {}
        self._by_pid: dict[int, set[tuple[int, int]]] = {}

    def pin(self, lib: LibRef) -> bool:
        """Track ``lib`` as attached for the daemon's lifetime.  True if new."""
        e = self._libs.get(lib.key)
        if e is None:
            self._libs[lib.key] = _Entry(lib, pinned=True)
            return True
        e.pinned = True
        return False

    def add(self, pid: int, lib: LibRef) -> bool:
        """Record that ``pid`` maps ``lib``.  True if no one used this file
        before (the caller should attach to it now)."""
        e = self._libs.get(lib.key)
        first = e is None
        if first:
            e = self._libs[lib.key] = _Entry(lib)
        e.users.add(pid)
        self._by_pid.setdefault(pid, set()).add(lib.key)
        return first

    def remove_pid(self, pid: int) -> list[LibRef]:
        """Forget ``pid``.  Returns the libraries it was the last user of
        (not pinned): the caller detaches them."""
        out = []
        for key in self._by_pid.pop(pid, ()):
            e = self._libs.get(key)
            if e is None:
                continue
            e.users.discard(pid)
            if not e.users and not e.pinned:
                del self._libs[key]
                out.append(e.lib)
        return out

    def remove_user(self, pid: int, key: tuple[int, int]) -> LibRef | None:
        """``pid`` turned out not to map ``key`` (it only opened the file):
        returns the library if it was the last user (not pinned)."""
        keys = self._by_pid.get(pid)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_pid[pid]
        e = self._libs.get(key)
        if e is None or pid not in e.users:
            return None
        e.users.discard(pid)
        if not e.users and not e.pinned:
            del self._libs[key]
            return e.lib
        return None

    def forget(self, key: tuple[int, int]) -> list[int]:
        """Drop a library (e.g. its attach failed); returns its users."""
        e = self._libs.pop(key, None)
        if e is None:
            return []
        for pid in e.users:
            s = self._by_pid.get(pid)
            if s is not None:
                s.discard(key)
                if not s:
                    del self._by_pid[pid]
        return sorted(e.users)

    def keys_of(self, pid: int) -> set[tuple[int, int]]:
        return set(self._by_pid.get(pid, ()))

    def tracked(self, key: tuple[int, int]) -> bool:
        return key in self._libs

    def users(self, key: tuple[int, int]) -> set[int]:
        e = self._libs.get(key)
        return set(e.users) if e else set()

    def libs(self) -> list[LibRef]:
        return [e.lib for e in self._libs.values()]

    def pids(self) -> set[int]:
        return set(self._by_pid)

    def __len__(self) -> int:
        return len(self._libs)


# --------------------------------------------------------------------------
# one call for registration


@dataclass(frozen=True)
class ContainerView:
    """What registration learns about a process's container."""

    host_pid: int
    ns_pid: int | None
    cgroup: str | None
    pod: PodRef | None

    @property
    def in_container(self) -> bool:
        return self.pod is not None or (self.ns_pid is not None and self.ns_pid != self.host_pid)


def describe(pid: int, proc: str | None = None, names: PodNames | None = None,
             env: Mapping[str, str] | None = None, cgroup: str | None = None) -> ContainerView:
    """Host pid, in-namespace pid, cgroup path and pod of ``pid``.  ``cgroup``,
    when given, is the path already read for the process's group, so the pod
    and the group come from one reading."""
    pids = ns_pids(pid, proc)
    cg = cgroup if cgroup is not None else proc_cgroup_path(pid, proc)
    pod = parse_cgroup_path(cg) if cg else None
    if pod is not None and names is not None:
        pod = names.resolve(pod, env)
    return ContainerView(pids[0] if pids else pid, pids[1] if pids else None, cg, pod)
