"""Stop-and-rewrite enforcement on real processes with real uprobes.

A tiny C shared library stands in for libcuda (``cuMemAlloc_v2``,
``cuMemGetInfo_v2``, each counting how often its body ran); a C program
linked against it runs one call per line of stdin and prints the result.  A
small bcc program (written here, for the test only) stops the process on a
large allocation / at the return of cuMemGetInfo_v2 and reports the thread;
``hami_bpf.enforce`` finishes the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import time

import pytest

from hami_bpf import enforce, ptrace

pytestmark = pytest.mark.bpf

THRESHOLD = 64 << 20  # allocations above this are denied by the test probe
BIG = 256 << 20
SMALL = 4096

LIB_C = r"""
#include <stddef.h>
volatile unsigned long alloc_body_runs = 0;
volatile unsigned long meminfo_body_runs = 0;
volatile size_t fakecu_last;

/* A call makes the functions non-leaf, so gcc gives them a frame (push %rbp
   first) like libcuda's; a leaf gets none even with -fno-omit-frame-pointer. */
void __attribute__((noinline)) fakecu_note(size_t v) { fakecu_last = v; }

int cuMemAlloc_v2(unsigned long long *dptr, size_t size)
{
    alloc_body_runs++;
    fakecu_note(size);
    *dptr = 0x7f0000000000ULL + size;
    return 0;
}

int cuMemGetInfo_v2(size_t *free, size_t *total)
{
    meminfo_body_runs++;
    fakecu_note(0);
    *free = 1000;
    *total = 2000;
    return 0;
}
"""

PROG_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

int cuMemAlloc_v2(unsigned long long *dptr, size_t size);
int cuMemGetInfo_v2(size_t *free, size_t *total);
extern volatile unsigned long alloc_body_runs, meminfo_body_runs;

struct job { size_t size; int rc; unsigned long long p; };

static void *run_alloc(void *arg)
{
    struct job *j = arg;
    j->rc = cuMemAlloc_v2(&j->p, j->size);
    return NULL;
}

int main(void)
{
    char line[256];
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready %p\n", (void *)&cuMemAlloc_v2);
    while (fgets(line, sizeof line, stdin)) {
        char cmd = 0;
        unsigned long long arg = 0;
        if (sscanf(line, " %c %llu", &cmd, &arg) < 1)
            continue;
        if (cmd == 'a' || cmd == 't') {          /* alloc here / in a new thread */
            struct job j = { arg, -1, 0 };
            if (cmd == 'a') {
                run_alloc(&j);
            } else {
                pthread_t t;
                pthread_create(&t, NULL, run_alloc, &j);
                pthread_join(t, NULL);
            }
            printf("alloc rc=%d ptr=%#llx body=%lu\n", j.rc, j.p, alloc_body_runs);
        } else if (cmd == 'm') {
            size_t f = 1, t = 1;
            int rc = cuMemGetInfo_v2(&f, &t);
            printf("meminfo rc=%d free=%zu total=%zu body=%lu\n", rc, f, t, meminfo_body_runs);
        } else if (cmd == 'q') {
            break;
        }
    }
    return 0;
}
"""

BPF_TEXT = r"""
#include <uapi/linux/ptrace.h>

struct ev { u32 kind; u32 pid; u32 tid; u32 pad; u64 a; u64 b; };
struct miargs { u64 free; u64 total; };

BPF_RINGBUF_OUTPUT(rb, 8);
BPF_HASH(mi, u32, struct miargs);

int on_alloc(struct pt_regs *ctx)
{
    u64 size = PT_REGS_PARM2(ctx);
    if (size <= THRESHOLD)
        return 0;
    bpf_send_signal(19);                       /* SIGSTOP, then report */
    u64 id = bpf_get_current_pid_tgid();
    struct ev e = {};
    e.kind = 1; e.pid = id >> 32; e.tid = (u32)id; e.a = size;
    rb.ringbuf_output(&e, sizeof(e), 0);
    return 0;
}

BPF_HASH(alloc_rcs, u64, u64);

int on_alloc_ret(struct pt_regs *ctx)          /* counts return codes seen */
{
    u64 rc = PT_REGS_RC(ctx) & 0xffffffff;
    alloc_rcs.increment(rc);
    return 0;
}

int on_meminfo(struct pt_regs *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct miargs a = {};
    a.free = PT_REGS_PARM1(ctx);
    a.total = PT_REGS_PARM2(ctx);
    mi.update(&tid, &a);
    return 0;
}

int on_meminfo_ret(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct miargs *a = mi.lookup(&tid);
    if (!a)
        return 0;
    struct ev e = {};
    e.kind = 2; e.pid = id >> 32; e.tid = tid; e.a = a->free; e.b = a->total;
    mi.delete(&tid);
    bpf_send_signal(19);
    rb.ringbuf_output(&e, sizeof(e), 0);
    return 0;
}
"""


class Ev(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("tid", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("a", ctypes.c_uint64),
        ("b", ctypes.c_uint64),
    ]


# --------------------------------------------------------------------------
# helpers


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def sym_file_offset(lib: str, sym: str) -> int:
    """File offset of dynamic symbol ``sym`` (st_value mapped through the PT_LOADs)."""
    value = None
    for line in _sh("readelf", "-W", "--dyn-syms", lib).splitlines():
        f = line.split()
        if len(f) >= 8 and f[7] == sym and f[6] != "UND":
            value = int(f[1], 16)
    assert value is not None, f"{sym} not in {lib}"
    for line in _sh("readelf", "-W", "-l", lib).splitlines():
        f = line.split()
        if f and f[0] == "LOAD":
            off, vaddr, filesz = int(f[1], 16), int(f[2], 16), int(f[4], 16)
            if vaddr <= value < vaddr + filesz:
                return value - vaddr + off
    raise AssertionError(f"{sym} at {value:#x} in no PT_LOAD of {lib}")


def compile_lib(d: str, name: str, cf: str) -> str:
    src = os.path.join(d, "fakecu.c")
    with open(src, "w") as f:
        f.write(LIB_C)
    out = os.path.join(d, f"lib{name}.so")
    _sh("gcc", "-O2", "-fno-omit-frame-pointer", f"-fcf-protection={cf}", "-fPIC", "-shared",
        "-o", out, src)
    return out


class Child:
    """The test program, one command per line, with timeouts on reads."""

    def __init__(self, prog: str):
        self.p = subprocess.Popen([prog], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.p.pid
        self._buf = b""
        m = re.match(r"ready (0x[0-9a-f]+)", self.readline())
        assert m
        self.alloc_addr = int(m.group(1), 16)

    def send(self, line: str) -> None:
        self.p.stdin.write(line.encode() + b"\n")
        self.p.stdin.flush()

    def readline(self, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        fd = self.p.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no output from pid {self.pid} (state {enforce.proc_state(self.pid)})"
                )
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise EOFError(f"pid {self.pid} exited ({self.p.poll()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        if self.p.poll() is None:
            enforce.resume(self.pid)
            try:
                self.send("q")
                self.p.wait(2)
            except Exception:
                self.p.kill()
                self.p.wait()


def parse(line: str) -> dict[str, int]:
    return {k: int(v, 0) for k, v in re.findall(r"(\w+)=(\S+)", line)}


# --------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    d = str(tmp_path_factory.mktemp("fakecu"))
    lib = compile_lib(d, "fakecu", "none")
    prog_src = os.path.join(d, "prog.c")
    with open(prog_src, "w") as f:
        f.write(PROG_C)
    prog = os.path.join(d, "prog")
    _sh("gcc", "-O2", "-o", prog, prog_src, f"-L{d}", "-lfakecu", f"-Wl,-rpath,{d}", "-lpthread")
    return {
        "dir": d,
        "lib": lib,
        "prog": prog,
        "alloc_off": sym_file_offset(lib, "cuMemAlloc_v2"),
        "meminfo_off": sym_file_offset(lib, "cuMemGetInfo_v2"),
    }


@pytest.fixture(scope="module")
def probes(build):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    try:
        from bcc import BPF
    except ImportError:
        pytest.skip("bcc (python3-bpfcc) not importable")
    if not os.path.ismount("/sys/kernel/tracing"):
        subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], check=False)
    b = BPF(text=BPF_TEXT.encode(), cflags=[f"-DTHRESHOLD={THRESHOLD}ULL"])
    lib = build["lib"].encode()
    b.attach_uprobe(name=lib, sym=b"cuMemAlloc_v2", fn_name=b"on_alloc")
    b.attach_uprobe(name=lib, sym=b"cuMemGetInfo_v2", fn_name=b"on_meminfo")
    b.attach_uretprobe(name=lib, sym=b"cuMemGetInfo_v2", fn_name=b"on_meminfo_ret")
    events: list[Ev] = []

    def on_event(_ctx, data, _size):
        events.append(Ev.from_buffer_copy(ctypes.string_at(data, ctypes.sizeof(Ev))))

    b[b"rb"].open_ring_buffer(on_event)

    def next_event(timeout: float = 5.0) -> Ev:
        deadline = time.monotonic() + timeout
        while not events:
            assert time.monotonic() < deadline, "no ring buffer event"
            b.ring_buffer_poll(50)
        return events.pop(0)

    yield {"bpf": b, "events": events, "next_event": next_event}
    b.cleanup()


@pytest.fixture
def child(build):
    c = Child(build["prog"])
    yield c
    c.close()


# --------------------------------------------------------------------------
# tests without probes


def test_test_lib_starts_with_push_rbp(build):
    ok, why = enforce.prologue_ok(build["lib"], build["alloc_off"], "cuMemAlloc_v2")
    assert ok, why
    with open(build["lib"], "rb") as f:
        f.seek(build["alloc_off"])
        assert f.read(1) == b"\x55"
    dis = _sh("objdump", "-d", "--no-show-raw-insn", build["lib"])
    m = re.search(r"<cuMemAlloc_v2>:\n\s*[0-9a-f]+:\s*(.*)\n", dis)
    assert m and re.match(r"push\s+%rbp", m.group(1)), m and m.group(1)


def test_prologue_refuses_endbr64(tmp_path):
    lib = compile_lib(str(tmp_path), "cet", "full")
    off = sym_file_offset(lib, "cuMemAlloc_v2")
    ok, why = enforce.prologue_ok(lib, off, "cuMemAlloc_v2")
    assert not ok
    assert "f3 0f 1e fa (endbr64), cannot undo safely" in why
    assert f"cuMemAlloc_v2 at {off:#x} in {lib}" in why


def test_entry_address_matches_process(build, child):
    entry = enforce.entry_address(child.pid, build["lib"], build["alloc_off"])
    assert entry == child.alloc_addr
    # Same file under another path: through the process's root
    other = f"/proc/{child.pid}/root{build['lib']}"
    assert enforce.entry_address(child.pid, other, build["alloc_off"]) == entry
    # Not mapped: a different file
    assert enforce.entry_address(child.pid, "/bin/sh", build["alloc_off"]) is None
    assert enforce.entry_address(2**22 + 12345, build["lib"], build["alloc_off"]) is None


def test_ptrace_error_names_operation_and_tid():
    with pytest.raises(ptrace.PtraceError) as ei:
        ptrace.seize(2**22 + 4321)
    assert str(ei.value) == f"PTRACE_SEIZE tid {2**22 + 4321}: No such process"
    assert ei.value.errno == errno.ESRCH
    assert isinstance(ei.value, OSError)


def test_read_write_mem_roundtrip():
    p = subprocess.Popen(["sleep", "30"])
    try:
        # the [stack] of sleep: read, write, read back
        with open(f"/proc/{p.pid}/maps") as f:
            line = next(line for line in f if line.rstrip().endswith("[stack]"))
        end = int(line.split()[0].split("-")[1], 16)
        addr = end - 64
        old = ptrace.read_mem(p.pid, addr, 8)
        ptrace.write_mem(p.pid, addr, b"hamibpf!")
        assert ptrace.read_mem(p.pid, addr, 8) == b"hamibpf!"
        ptrace.write_mem(p.pid, addr, old)
        with pytest.raises(ptrace.PtraceError, match=rf"pid {p.pid}"):
            ptrace.read_mem(p.pid, 8, 8)  # unmapped page
    finally:
        p.kill()
        p.wait()


def test_fail_call_on_missing_thread_raises_enforce_error():
    with pytest.raises(enforce.EnforceError) as ei:
        enforce.fail_call(2**22 + 777, 2**22 + 777, 0x1000)
    assert isinstance(ei.value.__cause__, ptrace.PtraceError)
    assert "PTRACE_SEIZE" in str(ei.value)


# --------------------------------------------------------------------------
# tests with real uprobes


def _deny(probes, child, build, cmd: str, size: int, stopped=None):
    child.send(f"{cmd} {size}")
    ev = probes["next_event"]()
    assert ev.kind == 1 and ev.pid == child.pid and ev.a == size
    entry = enforce.entry_address(ev.pid, build["lib"], build["alloc_off"])
    took = enforce.fail_call(ev.pid, ev.tid, entry, 2, stopped=stopped)
    assert stopped is None or len(stopped) == 0
    return ev, took, parse(child.readline())


def test_denied_alloc_returns_oom_without_running_body(probes, build, child, tmp_path):
    stopped = enforce.StoppedSet(str(tmp_path))
    child.send(f"a {SMALL}")
    r = parse(child.readline())
    assert r["rc"] == 0 and r["body"] == 1 and r["ptr"] != 0

    ev, took, r = _deny(probes, child, build, "a", BIG)
    assert ev.tid == child.pid
    assert r["rc"] == 2, r
    assert r["ptr"] == 0 and r["body"] == 1, "the denied call must not run the body"
    assert enforce.proc_state(child.pid) in ("S", "R")

    child.send(f"a {SMALL}")
    r = parse(child.readline())
    assert r["rc"] == 0 and r["body"] == 2

    # many denials in a row: the stack stays balanced, the process healthy
    # (with and without recording in a StoppedSet, whose file is rewritten
    # twice per denial)
    for label, rec in (("", None), (f" + StoppedSet in {tmp_path}", stopped)):
        times, e2e = [], []
        for i in range(30):
            t0 = time.perf_counter()
            _, took, r = _deny(probes, child, build, "a", BIG + i, rec)
            e2e.append(time.perf_counter() - t0)
            times.append(took)
            assert r["rc"] == 2 and r["body"] == 2
        print(
            f"\nfail_call{label} per denial: median {statistics.median(times) * 1e3:.3f} ms, "
            f"max {max(times) * 1e3:.3f} ms; end to end (request -> rc line) median "
            f"{statistics.median(e2e) * 1e3:.3f} ms over {len(times)} denials"
        )
    child.send(f"a {SMALL}")
    r = parse(child.readline())
    assert r["rc"] == 0 and r["body"] == 3


def test_denied_alloc_in_other_thread(probes, build, child):
    ev, _, r = _deny(probes, child, build, "t", BIG)
    assert ev.tid != child.pid
    assert r["rc"] == 2 and r["body"] == 0 and r["ptr"] == 0
    child.send(f"t {SMALL}")
    r = parse(child.readline())
    assert r["rc"] == 0 and r["body"] == 1


def test_denial_with_uretprobe_on_same_function(probes, build, child):
    """A uretprobe on the failed function sees rc 2 and returns to the caller.

    The uretprobe replaced the return address with the kernel's trampoline at
    entry; fail_call "returns" to that trampoline, which runs the return probe
    and goes back to the real caller.
    """
    b = probes["bpf"]
    lib = build["lib"].encode()
    b.attach_uretprobe(name=lib, sym=b"cuMemAlloc_v2", fn_name=b"on_alloc_ret")
    try:
        b[b"alloc_rcs"].clear()
        for _ in range(3):
            _, _, r = _deny(probes, child, build, "a", BIG)
            assert r["rc"] == 2 and r["body"] == 0
        child.send(f"a {SMALL}")
        r = parse(child.readline())
        assert r["rc"] == 0 and r["body"] == 1
        rcs = {k.value: v.value for k, v in b[b"alloc_rcs"].items()}
        assert rcs == {2: 3, 0: 1}
    finally:
        b.detach_uretprobe(name=lib, sym=b"cuMemAlloc_v2")


def test_wrong_entry_is_refused_and_call_proceeds(probes, build, child, tmp_path):
    child.send(f"a {BIG}")
    ev = probes["next_event"]()
    entry = enforce.entry_address(ev.pid, build["lib"], build["alloc_off"])
    stopped = enforce.StoppedSet(str(tmp_path))
    with pytest.raises(enforce.EnforceRefused, match="not entry\\+1"):
        enforce.fail_call(ev.pid, ev.tid, entry + 16, 2, stopped=stopped)
    r = parse(child.readline())  # resumed untouched: the call ran normally
    assert r["rc"] == 0 and r["body"] == 1
    assert len(stopped) == 0


def test_meminfo_rewritten(probes, build, child):
    free, total = 7 << 30, 8 << 30
    times = []
    for i in range(10):
        child.send("m")
        ev = probes["next_event"]()
        assert ev.kind == 2 and ev.pid == child.pid
        times.append(enforce.write_meminfo(ev.pid, ev.a, ev.b, free - i, total))
        r = parse(child.readline())
        assert r == {"rc": 0, "free": free - i, "total": total, "body": i + 1}
    print(
        f"\nwrite_meminfo per call: median {statistics.median(times) * 1e3:.3f} ms, "
        f"max {max(times) * 1e3:.3f} ms"
    )


# --------------------------------------------------------------------------
# StoppedSet


def _wait_state(pid: int, want: str, timeout: float = 2.0) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = enforce.proc_state(pid)
        if s == want:
            return s
        time.sleep(0.01)
    return enforce.proc_state(pid)


def test_stopped_set_file(tmp_path):
    s = enforce.StoppedSet(str(tmp_path / "state"))
    s.add(111, 42, "test")
    s.add(222, None, "other")
    doc = json.loads((tmp_path / "state" / "stopped.json").read_text())
    assert doc["stopped"]["111"]["start_time"] == 42
    assert doc["stopped"]["111"]["reason"] == "test"
    s.remove(222)
    doc = json.loads((tmp_path / "state" / "stopped.json").read_text())
    assert list(doc["stopped"]) == ["111"]
    assert os.listdir(tmp_path / "state") == ["stopped.json"]  # no temp files left


def test_recover_resumes_only_matching_stopped(tmp_path):
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        ours, reused, running = (p.pid for p in procs)
        for pid in (ours, reused):
            os.kill(pid, signal.SIGSTOP)
            assert _wait_state(pid, "T") == "T"
        s = enforce.StoppedSet(str(tmp_path))
        s.add(ours, enforce.proc_start_time(ours), "fail_call")
        s.add(reused, enforce.proc_start_time(reused) + 1, "fail_call")  # "another process"
        s.add(running, enforce.proc_start_time(running), "fail_call")  # not stopped
        s.add(2**22 + 99, 1, "gone")
        del s  # the controller "crashed"

        out = enforce.StoppedSet.recover(str(tmp_path))
        assert out[ours] == "resumed"
        assert out[reused].startswith("skipped: start_time")
        assert out[running].startswith("skipped: state")
        assert out[2**22 + 99] == "skipped: gone"
        assert _wait_state(ours, "S") == "S"
        time.sleep(0.05)
        assert enforce.proc_state(reused) == "T", "a mismatched start_time must be left alone"
        assert json.loads((tmp_path / "stopped.json").read_text())["stopped"] == {}
    finally:
        for p in procs:
            p.kill()
            p.wait()


@contextlib.contextmanager
def recorded_stopped(tmp_path, n):
    """n sleeping processes, stopped and recorded as a controller that then
    crashed would leave them: their pids."""
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(n)]
    try:
        s = enforce.StoppedSet(str(tmp_path))
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
            assert _wait_state(p.pid, "T") == "T"
            s.add(p.pid, enforce.proc_start_time(p.pid), "fail_call")
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_recover_leaves_a_denied_allocation_stopped_for_the_probes(tmp_path):
    # Resumed before the next daemon's probes attach, a thread stopped at a
    # denied allocation would allocate past its limit, and every later call
    # of it would run unprobed until they attach.
    with recorded_stopped(tmp_path, 2) as (denied, held):
        at = {denied: "cuMemAlloc_v2"}
        out = enforce.StoppedSet.recover(str(tmp_path), at_probe=at.get)
        assert out[held] == "resumed"
        assert out[denied].startswith("skipped: stopped at cuMemAlloc_v2")
        assert _wait_state(held, "S") == "S"
        time.sleep(0.05)
        assert enforce.proc_state(denied) == "T"


def test_recover_resumes_where_it_cannot_tell_where_a_process_stopped(tmp_path):
    def unreadable(pid):
        raise PermissionError(13, "Permission denied")
    with recorded_stopped(tmp_path, 1) as (pid,):
        out = enforce.StoppedSet.recover(str(tmp_path), at_probe=unreadable)
        assert out[pid] == "resumed"
        assert _wait_state(pid, "S") == "S"


def test_resume_all_and_resume_gone(tmp_path):
    p = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        assert _wait_state(p.pid, "T") == "T"
        s = enforce.StoppedSet(str(tmp_path))
        s.add(p.pid, enforce.proc_start_time(p.pid), "x")
        assert s.resume_all() == [p.pid]
        assert _wait_state(p.pid, "S") == "S"
        assert len(s) == 0
    finally:
        p.kill()
        p.wait()
    assert enforce.resume(p.pid) is False


# --------------------------------------------------------------------------
# ptrace stop kinds, and what a crashed controller leaves behind


def _tracer_pid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("TracerPid:")).split()[1])


def test_seize_group_stopped_reports_event_stop():
    p = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        assert _wait_state(p.pid, "T") == "T"
        ptrace.seize(p.pid)
        ptrace.interrupt(p.pid)
        stop = ptrace.wait_stop(p.pid, 1.0)
        assert stop.status == 0x80137F and stop.is_event_stop and stop.sig == signal.SIGSTOP
        regs = ptrace.get_regs(p.pid)
        ptrace.set_regs(p.pid, regs)
        ptrace.detach(p.pid)
        assert _tracer_pid(p.pid) == 0
        assert _wait_state(p.pid, "T") == "T"  # detached into the group stop again
        enforce.resume(p.pid)
        assert _wait_state(p.pid, "S") == "S"
    finally:
        p.kill()
        p.wait()


def test_sigstop_arriving_while_seized_is_a_signal_delivery_stop():
    p = subprocess.Popen(["sleep", "30"])
    try:
        ptrace.seize(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        stop = ptrace.wait_stop(p.pid, 1.0)
        assert stop.is_signal_delivery and stop.sig == signal.SIGSTOP
        ptrace.detach(p.pid, 0)  # suppressed: the process never stops
        assert _tracer_pid(p.pid) == 0
        time.sleep(0.05)
        assert enforce.proc_state(p.pid) == "S"
    finally:
        p.kill()
        p.wait()


def test_fail_call_on_running_process_refuses_and_leaves_it_running():
    p = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(enforce.EnforceRefused, match="not entry\\+1"):
            enforce.fail_call(p.pid, p.pid, 0x1000)
        assert _tracer_pid(p.pid) == 0
        assert _wait_state(p.pid, "S") == "S"
    finally:
        p.kill()
        p.wait()


CRASHING_CONTROLLER = r"""
import os, signal, sys
from hami_bpf import enforce, ptrace
pid, state_dir = int(sys.argv[1]), sys.argv[2]
os.kill(pid, signal.SIGSTOP)
s = enforce.StoppedSet(state_dir)
s.add(pid, enforce.proc_start_time(pid), "crash test")
ptrace.seize(pid)
ptrace.interrupt(pid)
ptrace.wait_stop(pid, 2.0)
os._exit(9)  # dies holding it: seized, stopped, recorded
"""


def test_recover_after_controller_crash(tmp_path):
    import sys

    p = subprocess.Popen(["sleep", "30"])
    try:
        subprocess.run(
            [sys.executable, "-c", CRASHING_CONTROLLER, str(p.pid), str(tmp_path)],
            check=False, timeout=20,
        )
        assert _wait_state(p.pid, "T") == "T"  # the kernel detached it, still stopped
        assert _tracer_pid(p.pid) == 0
        out = enforce.StoppedSet.recover(str(tmp_path))
        assert out == {p.pid: "resumed"}
        assert _wait_state(p.pid, "S") == "S"
    finally:
        p.kill()
        p.wait()
