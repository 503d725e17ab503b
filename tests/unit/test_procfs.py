"""hami_bpf.procfs: parsing from fake /proc trees, and cgroup grouping on a
real cgroup-v1 hierarchy."""
from __future__ import annotations

import os
import secrets
import subprocess
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hami_bpf import containers, procfs
from hami_bpf.classify import group_of

UID = "1f2e3d4c-5b6a-4978-8a9b-0c1d2e3f4a5b"
CID = "a" * 64
CID2 = "b" * 64


def write(proc, pid, name, data):
    path = os.path.join(str(proc), str(pid), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def cg(proc, pid, text):
    write(proc, pid, "cgroup", text)
    return procfs.cgroup_path(pid, str(proc))


# Typical v1 lines of a process in a container; the container's path is on
# every controller the runtime knows.
def v1_lines(path, unified="/"):
    return (f"12:pids:{path}\n11:memory:{path}\n10:cpu,cpuacct:{path}\n"
            f"9:devices:{path}\n1:name=systemd:{path}\n0::{unified}\n")


# --- cgroup v2 -------------------------------------------------------------------

@pytest.mark.parametrize("path", [
    "/",
    "/init.scope",
    "/user.slice/user-0.slice/session-3.scope",
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice"
    f"/cri-containerd-{CID}.scope",
    f"/../../kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope",
    "/a:b/with:colons",
])
def test_v2_is_the_unified_path_as_is(tmp_path, path):
    assert cg(tmp_path, 1, f"0::{path}\n") == path


def test_v2_empty_path_is_root_and_gone_is_none(tmp_path):
    assert cg(tmp_path, 1, "0::\n") == "/"
    assert cg(tmp_path, 2, "") == "/"
    assert procfs.cgroup_path(3, str(tmp_path)) is None


# --- cgroup v1 -------------------------------------------------------------------

@pytest.mark.parametrize("path", [
    f"/kubepods/burstable/pod{UID}/{CID}",                                   # cgroupfs
    f"/kubepods/pod{UID}/crio-{CID}",                                        # cgroupfs CRI-O
    f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}"
    f".slice/cri-containerd-{CID}.scope",                                    # systemd containerd
    f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope",
    f"/system.slice/docker-{CID}.scope",                                     # docker, systemd
    f"/docker/{CID}",                                                        # docker, cgroupfs
])
def test_v1_container_shapes(tmp_path, path):
    assert cg(tmp_path, 1, v1_lines(path)) == path          # with the "0::/" line
    assert cg(tmp_path, 2, v1_lines(path).replace("0::/\n", "")) == path   # without


def test_v1_kubernetes_path_gives_the_pod(tmp_path):
    path = f"/kubepods/burstable/pod{UID}/{CID}"
    cg(tmp_path, 5, v1_lines(path))
    write(tmp_path, 5, "status", "Name:\tpython\nNSpid:\t5\t1\n")
    v = containers.describe(5, str(tmp_path))
    assert v.cgroup == path == procfs.cgroup_path(5, str(tmp_path))
    assert (v.pod.pod_uid, v.pod.container_id, v.pod.qos) == (UID, CID, "burstable")


def test_v1_controller_order(tmp_path):
    """memory, then pids, then cpu/cpuacct, then name=systemd, then any other
    hierarchy; root paths never count.  No path here names a container."""
    lines = {
        "memory": "4:memory:/m\n",
        "pids": "8:pids:/p\n",
        "cpu": "2:cpu,cpuacct:/c\n",
        "systemd": "1:name=systemd:/s\n",
        "other": "13:name=hamitest:/o\n",
    }
    want = {"memory": "/m", "pids": "/p", "cpu": "/c", "systemd": "/s", "other": "/o"}
    order = ["memory", "pids", "cpu", "systemd", "other"]
    for n, first in enumerate(order):
        # the lines in reverse order of preference; the preferred ones made root
        text = "".join(lines[k] if k in order[n:] else lines[k].replace(want[k], "/")
                       for k in reversed(order)) + "0::/\n"
        assert cg(tmp_path, 10 + n, text) == want[first], text
    assert cg(tmp_path, 20, "5:cpu:/only-cpu\n0::/\n") == "/only-cpu"
    assert cg(tmp_path, 21, "3:cpuacct:/only-cpuacct\n7:blkio:/b\n0::/\n") == "/only-cpuacct"
    assert cg(tmp_path, 22, "7:blkio:/b\n6:freezer:/f\n0::/\n") == "/b"     # file order
    assert cg(tmp_path, 23, "4:memory:/\n8:pids:/\n0::/\n") == "/"


def test_v1_a_path_that_names_a_container_wins_over_controller_order(tmp_path):
    text = f"4:memory:/sandbox\n13:name=hamitest:/docker-{CID}.scope\n0::/\n"
    assert cg(tmp_path, 1, text) == f"/docker-{CID}.scope"


# --- hybrid ----------------------------------------------------------------------

def test_hybrid_root_or_init_unified_line_gives_way_to_v1(tmp_path):
    path = f"/kubepods/pod{UID}/{CID}"
    assert cg(tmp_path, 1, v1_lines(path, unified="/")) == path
    assert cg(tmp_path, 2, v1_lines(path, unified="/init.scope")) == path
    # a v1 path that is not a container still beats a root unified line
    assert cg(tmp_path, 3, "4:memory:/user.slice\n0::/\n") == "/user.slice"


def test_hybrid_unified_line_of_the_runtime_gives_way_to_the_container(tmp_path):
    # runc that does not join the unified hierarchy leaves containers in the
    # runtime's service there: one name for all of them
    path = f"/system.slice/docker-{CID}.scope"
    assert cg(tmp_path, 1, v1_lines(path, unified="/system.slice/docker.service")) == path


def test_hybrid_unified_line_wins_when_it_is_as_good(tmp_path):
    assert cg(tmp_path, 1, "4:memory:/user.slice\n0::/user.slice/user-0.slice/session-3.scope\n") \
        == "/user.slice/user-0.slice/session-3.scope"
    unified = f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope"
    other = f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID2}.scope"
    assert cg(tmp_path, 2, v1_lines(other, unified=unified)) == unified


def test_group_and_pod_come_from_one_path(tmp_path):
    path = f"/kubepods/pod{UID}/{CID}"
    cg(tmp_path, 7, v1_lines(path, unified="/system.slice/containerd.service"))
    write(tmp_path, 7, "status", "NSpid:\t7\t1\n")
    got = procfs.cgroup_path(7, str(tmp_path))
    assert group_of(7, "cgroup", None, got) == got == path
    assert containers.describe(7, str(tmp_path), cgroup=got).pod.container_id == CID


def test_cgroup_ignores_malformed_and_overlong_lines(tmp_path):
    long = "/" + "x" * (procfs.CGROUP_PATH_MAX + 1)
    text = f"garbage\n4:memory\n3:pids:{long}\n2:cpu:/c\n0::/\n"
    assert cg(tmp_path, 1, text) == "/c"
    assert cg(tmp_path, 2, b"4:memory:/\xff\xfe\n0::/\n") == "/\ufffd\ufffd"


@given(st.binary(max_size=4096))
def test_parse_cgroup_never_raises_on_bytes(raw):
    got = procfs.parse_cgroup(raw)
    assert isinstance(got, str) and 0 < len(got) <= procfs.CGROUP_PATH_MAX


_line = st.tuples(st.sampled_from(["0", "1", "4", "12", "x", ""]),
                  st.sampled_from(["", "memory", "pids", "cpu,cpuacct", "name=systemd", "a:b"]),
                  st.text(st.characters(blacklist_categories=("Cs",)), max_size=300))


@given(st.lists(_line, max_size=20))
def test_parse_cgroup_picks_a_listed_path(lines):
    text = "\n".join(f"{h}:{c}:{p}" for h, c, p in lines)
    got = procfs.parse_cgroup(text.encode())
    assert len(got) <= procfs.CGROUP_PATH_MAX
    assert got == "/" or any(got in line for line in text.splitlines())


# --- stat, status, comm, environ, maps --------------------------------------------

def stat_line(pid, comm, state="S", start=123456):
    rest = [state, "1"] + ["0"] * 17 + [str(start)] + ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(rest) + "\n"


@pytest.mark.parametrize("comm", ["python", "a b", "x) S 9 (y", "((", ")", "é\udcff"])
def test_stat_name_with_spaces_and_parens(tmp_path, comm):
    write(tmp_path, 9, "stat", stat_line(9, comm, "T", 777).encode(errors="surrogateescape"))
    f = procfs.stat_fields(9, proc=str(tmp_path))
    assert f[0] == "9" and f[2] == "T" and len(f) == 52
    assert procfs.state(9, proc=str(tmp_path)) == "T"
    assert procfs.start_time(9, proc=str(tmp_path)) == 777


def test_stat_of_a_thread_gone_or_garbage(tmp_path):
    write(tmp_path, 9, "task/10/stat", stat_line(10, "worker", "t"))
    assert procfs.state(9, 10, str(tmp_path)) == "t"
    assert procfs.state(9, 11, str(tmp_path)) is None
    assert procfs.start_time(8, str(tmp_path)) is None
    write(tmp_path, 7, "stat", "no parens at all")
    assert procfs.state(7, proc=str(tmp_path)) is None
    write(tmp_path, 6, "stat", "6 (short) R\n")
    assert procfs.state(6, proc=str(tmp_path)) == "R"
    assert procfs.start_time(6, str(tmp_path)) is None


def test_tasks_and_user_pc(tmp_path):
    write(tmp_path, 9, "task/9/syscall", "-1 0x7ffc0000 0x7f0000001235\n")
    write(tmp_path, 9, "task/10/syscall", "202 0x1 0x2 0x3 0x4 0x5 0x6 0x7ffc 0x7f00\n")
    write(tmp_path, 9, "task/11/syscall", "running\n")
    assert sorted(procfs.tasks(9, str(tmp_path))) == [9, 10, 11]
    assert procfs.user_pc(9, 9, str(tmp_path)) == 0x7F0000001235
    assert procfs.user_pc(9, 10, str(tmp_path)) is None
    assert procfs.user_pc(9, 11, str(tmp_path)) is None
    assert procfs.tasks(8, str(tmp_path)) == []
    assert procfs.task_exists(9, 10, str(tmp_path)) and not procfs.task_exists(9, 12, str(tmp_path))


def test_comm_is_bounded(tmp_path):
    write(tmp_path, 3, "comm", b"a b\xff\n")
    assert procfs.comm(3, str(tmp_path)) == "a b\ufffd"
    write(tmp_path, 4, "comm", b"x" * 10_000)
    assert procfs.comm(4, str(tmp_path)) == "x" * procfs.COMM_MAX
    assert procfs.comm(5, str(tmp_path)) == ""


def test_status_fields_and_ns_pids(tmp_path):
    write(tmp_path, 4242, "status", "Name:\tpython\nGroups:\t" + "1 " * 50_000
          + "\nNSpid:\t4242\t17\t1\n")
    assert procfs.ns_pids(4242, str(tmp_path)) == (4242, 1)
    assert procfs.status_field(4242, "Name", proc=str(tmp_path)) == "python"
    assert procfs.status_field(4242, "Nope", proc=str(tmp_path)) is None
    write(tmp_path, 9, "task/10/status", "x86_Thread_features:\tshstk wrss\n")
    assert procfs.status_field(9, "x86_Thread_features", 10, str(tmp_path)) == "shstk wrss"
    write(tmp_path, 11, "status", "Name:\told kernel\n")
    assert procfs.ns_pids(11, str(tmp_path)) == (11, 11)
    assert procfs.ns_pids(12, str(tmp_path)) is None


def test_environ_non_utf8(tmp_path):
    write(tmp_path, 1, "environ", b"A=1\0\xff\xfe=\x80\0novalue\0B=x=y\0")
    env, cut = procfs.environ(1, str(tmp_path))
    assert not cut and env == {"A": "1", "\ufffd\ufffd": "\ufffd", "B": "x=y"}
    assert procfs.environ(2, str(tmp_path)) == ({}, False)


def test_environ_oversized_is_cut_and_its_last_item_dropped(tmp_path):
    big = b"A=1\0" + b"PAD=" + b"p" * procfs.ENVIRON_MAX + b"\0LATE=1\0"
    write(tmp_path, 1, "environ", big)
    env, cut = procfs.environ(1, str(tmp_path))
    assert cut and env == {"A": "1"}
    env, cut = procfs.environ(1, str(tmp_path), limit=6)   # "A=1\0PA"
    assert cut and env == {"A": "1"}


def test_maps_entries_and_cut_at_a_line(tmp_path, monkeypatch):
    text = ("7f0000000000-7f0000001000 r-xp 00002000 fd:01 42 /usr/lib/libcuda.so.1\n"
            "7f0000001000-7f0000002000 rw-p 00000000 00:00 0 \n"
            "7f0000002000-7f0000003000 r--p 00000000 00:2a 7 /tmp/a b (deleted)\n"
            "7ffc00000000-7ffc00001000 r-xp 00000000 00:00 0 [vdso]\n"
            "garbage line here and there ok\n")
    write(tmp_path, 5, "maps", text)
    es = procfs.maps_entries(procfs.maps(5, str(tmp_path)).decode())
    assert [(e.path, e.deleted, e.offset, e.inode) for e in es] == [
        ("/usr/lib/libcuda.so.1", False, 0x2000, 42), ("/tmp/a b", True, 0, 7), ("[vdso]", False, 0, 0)]
    assert es[0].dev == os.makedev(0xFD, 1) and es[0].perms == "r-xp"
    assert [m[5] for m in procfs.parse_maps(text)] == ["/usr/lib/libcuda.so.1", "/tmp/a b"]
    monkeypatch.setattr(procfs, "MAPS_MAX", 100)
    assert procfs.maps(5, str(tmp_path)) == text.split("\n")[0].encode() + b"\n"
    assert procfs.maps(6, str(tmp_path)) is None


def test_pids_fds_and_mounts():
    assert os.getpid() in procfs.pids()
    assert 0 in procfs.fds() or 1 in procfs.fds() or 2 in procfs.fds()
    r, w = os.pipe()
    try:
        assert procfs.fd_target(r).startswith("pipe:")
        assert procfs.fd_path(r) == f"/proc/{os.getpid()}/fd/{r}"
    finally:
        os.close(r)
        os.close(w)
    assert ("/proc", "proc") in procfs.mounts()


# --- a real cgroup-v1 hierarchy -----------------------------------------------------

@pytest.fixture
def v1_hierarchy(tmp_path):
    """A named cgroup-v1 hierarchy mounted for this test (no controllers, so
    it limits nothing), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a cgroup hierarchy needs root")
    mnt = tmp_path / "cgv1"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "cgroup", "-o", "none,name=hamitest", "cgroup", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"the kernel did not mount a cgroup-v1 hierarchy: {r.stderr.strip()}")
    made = []
    procs = []
    try:
        yield mnt, made, procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for d in reversed(made):
            for _ in range(50):     # a killed task leaves its cgroup shortly after it is reaped
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_cgroup_grouping_on_a_real_v1_hierarchy(v1_hierarchy):
    mnt, made, procs = v1_hierarchy
    own = procfs.cgroup_path(os.getpid())
    if own is not None and procfs.names_container(own):
        pytest.skip(f"this test runs in a container's cgroup ({own}), which outranks a "
                    "name= hierarchy: both processes would rightly share it")
    names = [f"docker-{secrets.token_hex(32)}.scope" for _ in range(2)]
    groups = []
    for name in names:
        d = mnt / name
        d.mkdir()
        made.append(d)
        p = subprocess.Popen(["sleep", "60"])
        procs.append(p)
        (d / "cgroup.procs").write_text(str(p.pid))
        with open(f"/proc/{p.pid}/cgroup") as f:
            assert f":name=hamitest:/{name}\n" in f.read()
        groups.append(group_of(p.pid, "cgroup", None))
        assert containers.describe(p.pid).cgroup == groups[-1]
    assert groups == [f"/{n}" for n in names]
    assert groups[0] != groups[1]
