"""hami_bpf.containers on fake /proc and host trees (no root, no BPF)."""
from __future__ import annotations

import json
import os

import pytest

from hami_bpf import containers as C

UID = "1b4c2f7e-3a9d-4f0e-9c11-6d2a8b7e5f30"
UIDU = UID.replace("-", "_")
CID = "a" * 48 + "0123456789abcdef"
CID2 = "f" * 64


# --------------------------------------------------------------- cgroup paths

@pytest.mark.parametrize("path, qos, cid, runtime, driver", [
    # cgroupfs driver (containerd, docker: bare id; CRI-O: crio-<id>)
    (f"/kubepods/burstable/pod{UID}/{CID}", "burstable", CID, None, "cgroupfs"),
    (f"/kubepods/besteffort/pod{UID}/{CID}", "besteffort", CID, None, "cgroupfs"),
    (f"/kubepods/pod{UID}/{CID}", "guaranteed", CID, None, "cgroupfs"),
    (f"/kubepods/burstable/pod{UID}/crio-{CID}", "burstable", CID, "cri-o", "cgroupfs"),
    # systemd driver
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UIDU}.slice/"
     f"cri-containerd-{CID}.scope", "burstable", CID, "containerd", "systemd"),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UIDU}.slice/"
     f"crio-{CID}.scope", "besteffort", CID, "cri-o", "systemd"),
    (f"/kubepods.slice/kubepods-pod{UIDU}.slice/docker-{CID}.scope", "guaranteed", CID,
     "docker", "systemd"),
    # read through a private cgroup namespace: leading /.. components
    (f"/../../kubepods-burstable-pod{UIDU}.slice/cri-containerd-{CID}.scope", "burstable", CID,
     "containerd", "systemd"),
    (f"/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{UIDU}.slice/"
     f"cri-containerd-{CID}.scope", "besteffort", CID, "containerd", "systemd"),
    (f"/../../burstable/pod{UID}/{CID}", "burstable", CID, None, "cgroupfs"),
    (f"/../../pod{UID}/{CID}", "unknown", CID, None, "cgroupfs"),
    (f"/../../../kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UIDU}.slice/"
     f"cri-containerd-{CID}.scope", "burstable", CID, "containerd", "systemd"),
    # a kubelet --cgroup-root and a nested cgroup inside the container
    (f"/system.slice/kubelet-root/kubepods/burstable/pod{UID}/{CID}/init.scope", "burstable",
     CID, None, "cgroupfs"),
    (f"/kubepods/kubepods/besteffort/pod{UID}/{CID}", "besteffort", CID, None, "cgroupfs"),
])
def test_parse_cgroup_layouts(path, qos, cid, runtime, driver):
    ref = C.parse_cgroup_path(path)
    assert ref is not None, path
    assert ref.pod_uid == UID
    assert ref.qos == (None if qos == "unknown" else qos)
    assert ref.container_id == cid
    assert ref.runtime == runtime
    assert ref.driver == driver
    assert ref.cgroup.startswith("/") and ".." not in ref.cgroup.split("/")


@pytest.mark.parametrize("path", [
    "/", "/user.slice/user-1000.slice/session-3.scope", "/system.slice/containerd.service",
    "/kubepods", "/kubepods/burstable", f"/kubepods.slice/kubepods-pod{UIDU}.slice/"
    f"crio-conmon-{CID}.scope", "/kubepods/burstable/notapod/xyz", "/docker/" + CID,
    f"/kubepods/burstable/pod{UID}/not-a-container-id",
    # a pod-looking component outside kubepods (absolute paths)
    f"/system.slice/pod{UID}/{CID}", f"/kubepods-burstable-pod{UIDU}.slice/crio-{CID}.scope",
    f"/other/burstable/pod{UID}/{CID}",
])
def test_parse_cgroup_not_a_container(path):
    assert C.parse_cgroup_path(path) is None


def test_pod_cgroup_itself_has_no_container():
    ref = C.parse_cgroup_path(f"/kubepods/burstable/pod{UID}")
    assert ref is not None and ref.container_id is None and ref.pod_uid == UID


def test_static_pod_uid_without_dashes():
    uid = "3d1b1b0a5b1f2e9c8b7a6f5e4d3c2b1a"
    ref = C.parse_cgroup_path(f"/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{CID}.scope")
    assert ref is not None and ref.pod_uid == uid


def test_group_name_and_labels():
    ref = C.parse_cgroup_path(f"/kubepods/pod{UID}/{CID}")
    assert ref.group_name() == f"pod:{UID}/{CID[:12]}"
    named = ref.with_names("ml", "trainer-0", "main")
    assert named.group_name() == "ml/trainer-0/main"
    assert named.labels() == {"namespace": "ml", "pod": "trainer-0", "container": "main",
                              "pod_uid": UID, "container_id": CID}


def test_normalize():
    assert C.normalize_cgroup_path("/../../a/b/") == "/a/b"
    assert C.normalize_cgroup_path("/") == "/"


# --------------------------------------------------------------- fake /proc

def write(path, text, mode="w"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


def test_proc_cgroup_path_v2_and_v1(tmp_path):
    proc = str(tmp_path)
    write(f"{proc}/5/cgroup", f"0::/kubepods/pod{UID}/{CID}\n")
    assert C.proc_cgroup_path(5, proc) == f"/kubepods/pod{UID}/{CID}"
    write(f"{proc}/6/cgroup", "12:cpuset:/\n4:memory:/kubepods/burstable/pod"
          f"{UID}/{CID}\n1:name=systemd:/x\n")
    assert C.proc_cgroup_path(6, proc) == f"/kubepods/burstable/pod{UID}/{CID}"
    assert C.proc_cgroup_path(7, proc) is None


def test_ns_pids(tmp_path):
    proc = str(tmp_path)
    write(f"{proc}/4242/status", "Name:\tpython\nPid:\t4242\nNSpid:\t4242\t17\t1\n")
    assert C.ns_pids(4242, proc) == (4242, 1)
    write(f"{proc}/10/status", "Name:\tsh\nNSpid:\t10\n")
    assert C.ns_pids(10, proc) == (10, 10)
    write(f"{proc}/11/status", "Name:\told kernel\nPid:\t11\n")
    assert C.ns_pids(11, proc) == (11, 11)
    assert C.ns_pids(12, proc) is None


MAPS = """\
55d0c0000000-55d0c0001000 r--p 00000000 00:2a 101 /usr/bin/python3.11
7f0000000000-7f0000100000 r--p 00000000 fd:01 5001 /usr/local/cuda/compat/libcuda.so.550.54.15
7f0000100000-7f0000900000 r-xp 00100000 fd:01 5001 /usr/local/cuda/compat/libcuda.so.550.54.15
7f0000a00000-7f0000a10000 r-xp 00000000 fd:01 6001 /usr/lib/x86_64-linux-gnu/libcudart.so.12
7f0000b00000-7f0000b10000 r-xp 00000000 103:02 7001 /usr/lib/x86_64-linux-gnu/libcuda.so.1 (deleted)
7f0000c00000-7f0000c10000 rw-p 00000000 00:00 0 
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
"""


def test_mapped_libcuda_identity_and_paths(tmp_path):
    proc = str(tmp_path)
    write(f"{proc}/300/maps", MAPS)
    libs = C.mapped_libcuda(300, proc)
    assert [(os.major(l.dev), os.minor(l.dev), l.inode) for l in libs] == [(0xfd, 1, 5001),
                                                                          (0x103, 2, 7001)]
    a, b = libs
    assert a.path == "/usr/local/cuda/compat/libcuda.so.550.54.15"
    assert a.host_path == f"{proc}/300/root/usr/local/cuda/compat/libcuda.so.550.54.15"
    assert not a.deleted and b.deleted
    assert b.path == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert a.pid == 300
    assert "inode 5001" in str(a)


def test_mapped_libcuda_none_or_gone(tmp_path):
    proc = str(tmp_path)
    write(f"{proc}/1/maps", "55d0c0000000-55d0c0001000 r--p 00000000 00:2a 101 /usr/bin/x\n")
    assert C.mapped_libcuda(1, proc) == []
    assert C.mapped_libcuda(2, proc) == []


@pytest.mark.parametrize("name, ok", [
    ("libcuda.so", True), ("libcuda.so.1", True), ("libcuda.so.580.65.06", True),
    ("libcudart.so.12", False), ("libcuda.so.1.bak", False), ("libcuda.so.", False),
    ("xlibcuda.so.1", False),
])
def test_is_libcuda_name(name, ok):
    assert C.is_libcuda_name("/usr/lib/" + name) is ok


def test_scan_libcuda(tmp_path):
    proc = str(tmp_path)
    write(f"{proc}/300/maps", MAPS)
    write(f"{proc}/301/maps", "")
    write(f"{proc}/self/maps", MAPS)     # not a pid
    os.makedirs(f"{proc}/302")           # no maps (exited)
    found = C.scan_libcuda(proc)
    assert list(found) == [300]
    assert C.scan_libcuda(proc, skip=[300]) == {}


def test_describe(tmp_path):
    proc = str(tmp_path)
    write(f"{proc}/77/status", "NSpid:\t77\t1\n")
    write(f"{proc}/77/cgroup", f"0::/kubepods/besteffort/pod{UID}/{CID}\n")
    v = C.describe(77, proc)
    assert (v.host_pid, v.ns_pid, v.in_container) == (77, 1, True)
    assert v.pod.container_id == CID and v.pod.qos == "besteffort"
    write(f"{proc}/78/status", "NSpid:\t78\n")
    write(f"{proc}/78/cgroup", "0::/user.slice\n")
    v = C.describe(78, proc)
    assert v.pod is None and not v.in_container and v.cgroup == "/user.slice"


# --------------------------------------------------------------- names

def test_names_from_containerd_oci_bundle(tmp_path):
    host = str(tmp_path)
    spec = {"annotations": {"io.kubernetes.cri.container-type": "container",
                            "io.kubernetes.cri.sandbox-namespace": "ml",
                            "io.kubernetes.cri.sandbox-name": "trainer-0",
                            "io.kubernetes.cri.sandbox-uid": UID,
                            "io.kubernetes.cri.container-name": "main"}}
    write(f"{host}/run/containerd/io.containerd.runtime.v2.task/k8s.io/{CID}/config.json",
          json.dumps(spec))
    names = C.PodNames(host)
    ref = C.parse_cgroup_path(f"/kubepods/pod{UID}/{CID}")
    r = names.resolve(ref)
    assert (r.namespace, r.pod_name, r.container_name) == ("ml", "trainer-0", "main")
    assert names.lookup(ref).source.startswith("oci:")


def test_names_from_crio_oci_bundle(tmp_path):
    host = str(tmp_path)
    spec = {"annotations": {"io.kubernetes.pod.namespace": "infer",
                            "io.kubernetes.pod.name": "api-7d9f",
                            "io.kubernetes.container.name": "server"}}
    write(f"{host}/run/containers/storage/overlay-containers/{CID}/userdata/config.json",
          json.dumps(spec))
    ref = C.parse_cgroup_path(f"/kubepods.slice/kubepods-pod{UIDU}.slice/crio-{CID}.scope")
    r = C.PodNames(host).resolve(ref)
    assert (r.namespace, r.pod_name, r.container_name) == ("infer", "api-7d9f", "server")


def test_names_from_kubelet_logs(tmp_path):
    host = str(tmp_path)
    os.makedirs(f"{host}/var/log/containers")
    os.symlink("/nowhere", f"{host}/var/log/containers/trainer-0_ml_main-{CID}.log")
    os.symlink("/nowhere", f"{host}/var/log/containers/other_ml_side-car-{CID2}.log")
    os.makedirs(f"{host}/var/log/pods/ml_trainer-0_{UID}/main")
    now = [0.0]
    names = C.PodNames(host, clock=lambda: now[0])
    ref = C.parse_cgroup_path(f"/kubepods/pod{UID}/{CID}")
    r = names.resolve(ref)
    assert (r.namespace, r.pod_name, r.container_name) == ("ml", "trainer-0", "main")
    r2 = names.resolve(C.parse_cgroup_path(f"/kubepods/pod{UID}/{CID2}"))
    assert r2.container_name == "side-car"
    # a container started later is found after the refresh interval
    cid3 = "b" * 64
    os.symlink("/nowhere", f"{host}/var/log/containers/trainer-0_ml_late-{cid3}.log")
    ref3 = C.parse_cgroup_path(f"/kubepods/pod{UID}/{cid3}")
    assert names.resolve(ref3).container_name == "main"   # pod-level fallback only
    now[0] = 5.0
    assert names.resolve(ref3).container_name == "late"


def test_names_from_environment_last(tmp_path):
    ref = C.parse_cgroup_path(f"/kubepods/pod{UID}/{CID}")
    env = {"HOSTNAME": "trainer-0", "POD_NAMESPACE": "ml"}
    r = C.PodNames(str(tmp_path)).resolve(ref, env)
    assert (r.namespace, r.pod_name, r.container_name) == ("ml", "trainer-0", None)
    assert C.PodNames(str(tmp_path)).resolve(ref).namespace is None


@pytest.mark.parametrize("name, parsed", [
    (f"web-0_default_nginx-{CID2}.log", ("web-0", "default", "nginx", CID2)),
    (f"a-b_kube-system_c-d-e-{CID2}.log", ("a-b", "kube-system", "c-d-e", CID2)),
    ("junk.log", None),
])
def test_parse_log_link(name, parsed):
    assert C.parse_log_link(name) == parsed


# --------------------------------------------------------------- LibTracker

def lib(inode, pid=1, dev=os.makedev(8, 1)):
    return C.LibRef(dev, inode, "/usr/lib/libcuda.so.1", f"/proc/{pid}/root/usr/lib/libcuda.so.1",
                    pid)


def test_tracker_first_and_last_user():
    t = C.LibTracker()
    assert t.add(10, lib(1, 10)) is True
    assert t.add(11, lib(1, 11)) is False
    assert t.add(11, lib(2, 11)) is True
    assert t.users((os.makedev(8, 1), 1)) == {10, 11}
    assert t.remove_pid(10) == []
    gone = t.remove_pid(11)
    assert sorted(l.inode for l in gone) == [1, 2]
    assert len(t) == 0 and t.pids() == set()
    assert t.remove_pid(11) == []


def test_tracker_same_inode_other_device_is_other_file():
    t = C.LibTracker()
    assert t.add(1, lib(5, dev=os.makedev(8, 1)))
    assert t.add(2, lib(5, dev=os.makedev(8, 2)))
    assert len(t) == 2


def test_tracker_pinned_never_detached():
    t = C.LibTracker()
    host = lib(9)
    assert t.pin(host) is True
    assert t.add(5, host) is False
    assert t.remove_pid(5) == []
    assert t.tracked(host.key)


def test_tracker_forget_after_failed_attach():
    t = C.LibTracker()
    t.add(1, lib(3))
    t.add(2, lib(3))
    assert t.forget(lib(3).key) == [1, 2]
    assert not t.tracked(lib(3).key)
    assert t.add(3, lib(3)) is True   # the next user retries
    assert t.remove_pid(1) == [] and t.remove_pid(3) != []


def test_tracker_property():
    """Random add/remove sequences: a lib is reported for detach exactly when
    its user set becomes empty, and exactly once."""
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.given(st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(1, 3)),
                        max_size=60))
    def run(ops):
        t = C.LibTracker()
        model: dict[int, set[int]] = {}
        for is_add, pid, ino in ops:
            if is_add:
                first = t.add(pid, lib(ino, pid))
                assert first == (ino not in model)
                model.setdefault(ino, set()).add(pid)
            else:
                gone = {l.inode for l in t.remove_pid(pid)}
                expect = set()
                for i, users in list(model.items()):
                    if pid in users:
                        users.discard(pid)
                        if not users:
                            del model[i]
                            expect.add(i)
                assert gone == expect
        assert {l.inode for l in t.libs()} == set(model)

    run()


def test_opened_lib_keys_a_file_as_its_mapping_will_be(tmp_path):
    import os
    from hami_bpf import containers
    f = tmp_path / "libcuda.so.1"
    f.write_bytes(b"\0" * 8192)
    fd = os.open(f, os.O_RDONLY)
    try:
        ref = containers.opened_lib(os.getpid(), fd)
        st = os.fstat(fd)
        assert ref is not None and ref.key == (st.st_dev, st.st_ino)
        assert ref.path == str(f) and ref.host_path == f"/proc/{os.getpid()}/fd/{fd}"
        f.unlink()                        # still found through the descriptor
        gone = containers.opened_lib(os.getpid(), fd)
        assert gone is not None and gone.deleted and gone.key == ref.key
    finally:
        os.close(fd)
    assert containers.opened_lib(os.getpid(), fd) is None


def test_tracker_an_opener_that_never_maps_is_no_user():
    from hami_bpf.containers import LibRef, LibTracker
    t = LibTracker()
    lib = LibRef(1, 2, "/x/libcuda.so.1", "/proc/9/fd/3", 9)
    assert t.add(9, lib) and t.add(10, lib) is False
    assert t.keys_of(9) == {lib.key}
    assert t.remove_user(9, lib.key) is None          # 10 still maps it
    assert t.keys_of(9) == set()
    assert t.remove_user(10, lib.key) == lib          # the last user: detach it
    assert not t.tracked(lib.key)
    assert t.remove_user(10, lib.key) is None
    p = LibTracker()
    p.pin(lib)
    p.add(9, lib)
    assert p.remove_user(9, lib.key) is None and p.tracked(lib.key)   # pinned stays
