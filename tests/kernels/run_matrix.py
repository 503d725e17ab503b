#!/usr/bin/env python3
"""Kernel matrix: hami-bpf's BPF tests on Debian kernels booted in qemu, and on the host.

    make test-kernels            # all rows
    python3 tests/kernels/run_matrix.py --only debian-7 --keep-going

For each guest kernel:
  1. Debian's packages for it (kernel image, modules, headers) are downloaded
     with `apt-get download` through a private apt configuration under
     /var/cache/hami-bpf/kernels/apt (the host's apt configuration is not touched)
     and extracted under /var/cache/hami-bpf/kernels/k/<version>/
     (HAMI_KERNELS_CACHE moves all of it).
  2. An initramfs is built (static busybox, the 9p/virtio/overlay modules of
     THAT kernel, tests/kernels/init.sh).
  3. qemu boots it: KVM if a short probe boot works, else TCG (`-cpu max`).
     The guest's root is the host's root, shared read-only over 9p under a
     tmpfs overlay, so it has the same checkout, venv, bcc and compiler;
     /lib/modules/<version>/build points at the headers of the guest kernel.
     tests/kernels/guest.sh runs `hami-bpf doctor --json` and pytest there and
     writes the results to a shared folder.
The host row runs the same tests directly (the host's own kernel is not booted).

`--fetch-only` does steps 1-2 and stops (.ci/run runs it in the background
while the host's tests run). A guest that fails to boot (no /init, or init.sh
could not hand over to guest.sh) is booted once more, and one whose kernel
tripped over its own text patching (patching_oops) up to MAX_BOOTS times in
all; a test that fails is not retried, and the row says when it ran again
and why. How long each step took goes to results/timings.txt.

Prints a table kernel x mechanism -> passed / skipped (reason) / failed and
writes it to /var/cache/hami-bpf/kernels/results/table.md. Exit status 1 if any test
failed or any row could not run.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# Downloads, extracted kernels, initramfs images and results (~800 MB): outside
# the checkout, so that nothing of it can be committed; kept between runs.
CACHE = Path(os.environ.get("HAMI_KERNELS_CACHE", "/var/cache/hami-bpf/kernels"))
VENV = Path(os.environ.get("VENV", "/opt/hami-bpf/venv"))
# Seconds from starting qemu to guest.sh's first line: generous, since under
# TCG on a loaded host a boot takes minutes; a hung boot is retried once.
BOOT_TIMEOUT = float(os.environ.get("HAMI_KERNELS_BOOT_TIMEOUT", 900))
# Boots of a row whose guest crashed in its own text patching (a hung boot: two).
MAX_BOOTS = 3

# What runs in every row (kept small: bcc compiles are slow under TCG).
PYTEST_ARGS = [
    "-v", "-rs",
    "tests/kernels/test_mechanisms.py",
    "tests/bpf/test_memlimit.py",
    "tests/bpf/test_core.py::test_byte_exact_accounting_per_process_and_group",
    "tests/bpf/test_core.py::test_groups_are_separate",
    "tests/bpf/test_core.py::test_moved_process_keeps_its_accounting",
    "--durations=10",
]
# Second pass in a guest whose kernel allows bpf_probe_write_user: lockdown is
# raised to integrity at run time, so the fallback stop-write runs there too.
LOCKDOWN_ARGS = ["-v", "-rs", "tests/kernels/test_mechanisms.py::test_meminfo_mechanism"]

APT_SOURCES = """\
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie-backports main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
"""


@dataclass
class KernelSpec:
    key: str            # row id
    title: str
    image_re: str       # regex on linux-image package names; group 1 = version


KERNELS = [
    KernelSpec("debian-7", "newest Debian 7.x (sid / trixie-backports)",
               r"^linux-image-(7\.\d+\.\d+\+deb\d+-amd64)$"),
    KernelSpec("debian-12", "Debian 12's 6.1",
               r"^linux-image-(6\.1\.0-\d+-amd64)$"),
]

# Columns of the table: (title, how a test id maps to it)
MECH_COLUMNS = [
    ("oom return-oom", "tests/kernels/test_mechanisms.py::test_oom_mechanism[return-oom]"),
    ("oom stop-rewrite", "tests/kernels/test_mechanisms.py::test_oom_mechanism[stop-rewrite]"),
    ("return-oom refused at start",
     "tests/kernels/test_mechanisms.py::test_return_oom_refused_where_the_kernel_refuses"),
    ("meminfo probe-write-user",
     "tests/kernels/test_mechanisms.py::test_meminfo_mechanism[probe-write-user]"),
    ("meminfo stop-write", "tests/kernels/test_mechanisms.py::test_meminfo_mechanism[stop-write]"),
]
SUITE_COLUMNS = [
    ("memlimit suite (auto)", "tests/bpf/test_memlimit.py::"),
    ("core subset (auto)", "tests/bpf/test_core.py::"),
]


def log(msg: str) -> None:
    print(f"[test-kernels] {msg}", flush=True)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    return subprocess.run(cmd, **kw)


# --------------------------------------------------------------------- apt

class Apt:
    """apt-get / apt-cache with a private configuration under CACHE/apt."""

    def __init__(self, root: Path):
        self.root = root
        (root / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        (root / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        (root / "etc").mkdir(parents=True, exist_ok=True)
        src = root / "etc" / "sources.list"
        if not src.exists() or src.read_text() != APT_SOURCES:
            src.write_text(APT_SOURCES)
        self.opts = [
            "-o", f"Dir::Etc::sourcelist={src}", "-o", "Dir::Etc::sourceparts=-",
            "-o", f"Dir::State::Lists={root / 'lists'}", "-o", f"Dir::Cache={root / 'cache'}",
            "-o", "Dir::State::status=/dev/null", "-o", "APT::Architecture=amd64",
            "-o", "Debug::NoLocking=1", "-o", "APT::Sandbox::User=root",
        ]

    def update(self, max_age_s: float = 6 * 3600) -> None:
        stamp = self.root / "updated"
        if stamp.exists() and time.time() - stamp.stat().st_mtime < max_age_s:
            return
        log("apt-get update (private sources: sid, trixie-backports, bookworm)")
        run(["apt-get", *self.opts, "-qq", "update"])
        stamp.touch()

    def names(self) -> list[str]:
        r = run(["apt-cache", *self.opts, "pkgnames", "linux-"], capture_output=True, text=True)
        return r.stdout.split()

    def depends(self, pkg: str) -> list[str]:
        r = run(["apt-cache", *self.opts, "show", "--no-all-versions", pkg],
                capture_output=True, text=True)
        for line in r.stdout.splitlines():
            if line.startswith("Depends:"):
                return [re.split(r"[ (|]", d.strip())[0] for d in line[8:].split(",")]
        return []

    def download(self, pkgs: list[str], dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        run(["apt-get", *self.opts, "-qq", "download", *pkgs], cwd=dest)


def _vkey(v: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"[.+-]", v)]


@dataclass
class Kernel:
    spec: KernelSpec
    version: str
    root: Path          # extracted packages
    vmlinuz: Path = None
    modules: Path = None
    build: Path = None
    source: Path = None
    initrd: Path = None
    notes: list[str] = field(default_factory=list)


def resolve(apt: Apt, spec: KernelSpec, names: list[str]) -> str:
    found = [m.group(1) for n in names if (m := re.match(spec.image_re, n))]
    if not found:
        raise RuntimeError(f"{spec.key}: no package matches {spec.image_re}")
    return max(found, key=_vkey)


def fetch(apt: Apt, spec: KernelSpec, version: str) -> Kernel:
    kdir = CACHE / "k" / version
    root = kdir / "root"
    done = kdir / "extracted"
    if not done.exists():
        img = f"linux-image-{version}"
        pkgs = [img] + [d for d in apt.depends(img) if re.match(r"^linux-(binary|modules|base-\d)", d)]
        hdr = f"linux-headers-{version}"
        pkgs += [hdr] + [d for d in apt.depends(hdr) if re.match(r"^linux-(headers|kbuild)-", d)]
        log(f"{spec.key}: downloading {' '.join(pkgs)}")
        debs = kdir / "debs"
        shutil.rmtree(debs, ignore_errors=True)
        apt.download(pkgs, debs)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        for deb in sorted(debs.glob("*.deb")):
            run(["dpkg-deb", "-x", str(deb), str(root)])
        shutil.rmtree(debs)
        done.touch()
    k = Kernel(spec, version, root)
    for base in (root / "usr/lib/modules" / version, root / "lib/modules" / version):
        if (base / "kernel").is_dir():
            k.modules = base
    vm = [p for p in (root / "boot" / f"vmlinuz-{version}", k.modules / "vmlinuz") if p.exists()]
    if not vm:
        raise RuntimeError(f"{spec.key}: no vmlinuz in the packages of {version}")
    k.vmlinuz = vm[0]
    k.build = root / "usr/src" / f"linux-headers-{version}"
    mk = (k.build / "Makefile").read_text()
    m = re.search(r"include /usr/src/(\S+)/Makefile", mk)
    k.source = root / "usr/src" / m.group(1) if m else k.build
    # /lib/modules/<version> as the guest will see it (guest.sh links it)
    mr = CACHE / "modroot" / version
    mr.mkdir(parents=True, exist_ok=True)
    for name, target in (("build", k.build), ("source", k.source), ("kernel", k.modules / "kernel")):
        link = mr / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return k


# --------------------------------------------------------------- initramfs

INITRD_MODULES = ["virtio_pci", "9pnet_virtio", "9p", "overlay"]


def _module_files(mods: Path) -> dict[str, Path]:
    out = {}
    for p in (mods / "kernel").rglob("*.ko*"):
        name = p.name.split(".ko")[0].replace("-", "_")
        out[name] = p
    return out


def _builtin(mods: Path) -> set[str]:
    try:
        return {Path(line.strip()).name.split(".ko")[0].replace("-", "_")
                for line in (mods / "modules.builtin").read_text().splitlines()}
    except OSError:
        return set()


def build_initrd(k: Kernel) -> Path:
    out = CACHE / "k" / k.version / "initrd.cpio.gz"
    init = HERE / "init.sh"
    busybox = Path("/bin/busybox")
    if out.exists() and out.stat().st_mtime > init.stat().st_mtime:
        k.initrd = out
        return out
    if not busybox.exists() or "statically linked" not in run(
            ["file", "-L", str(busybox)], capture_output=True, text=True, check=False).stdout:
        raise RuntimeError("needs a static /bin/busybox: apt-get install busybox-static")
    files, builtin = _module_files(k.modules), _builtin(k.modules)
    order: list[str] = []

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if name in order or name in builtin:
            return
        if name not in files:
            raise RuntimeError(f"{k.version}: module {name} neither a file nor built in")
        deps = run(["modinfo", "-F", "depends", str(files[name])],
                   capture_output=True, text=True).stdout.strip()
        for d in filter(None, deps.split(",")):
            visit(d)
        order.append(name)

    for m in INITRD_MODULES:
        if m.replace("-", "_") in builtin:
            continue
        visit(m)
    stage = CACHE / "k" / k.version / "initrd"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "bin").mkdir(parents=True)
    (stage / "modules").mkdir()
    shutil.copy2(busybox, stage / "bin" / "busybox")
    shutil.copy2(init, stage / "init")
    os.chmod(stage / "init", 0o755)
    names = []
    for name in order:
        src = files[name]
        dst = stage / "modules" / f"{name}.ko"
        if src.name.endswith(".xz"):
            dst.write_bytes(run(["xz", "-dc", str(src)], capture_output=True).stdout)
        elif src.name.endswith(".zst"):
            dst.write_bytes(run(["zstd", "-dc", str(src)], capture_output=True).stdout)
        elif src.name.endswith(".gz"):
            dst.write_bytes(gzip.decompress(src.read_bytes()))
        else:
            shutil.copy2(src, dst)
        names.append(dst.name)
    (stage / "modules.order").write_text("\n".join(names) + "\n")
    listing = run(["find", "."], cwd=stage, capture_output=True, text=True).stdout
    cpio = run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=stage, input=listing.encode(),
               capture_output=True).stdout
    out.write_bytes(gzip.compress(cpio, 6))
    log(f"{k.spec.key}: initramfs with modules {', '.join(order) or '(all built in)'}")
    k.initrd = out
    return out


# ------------------------------------------------------------------- qemu

def qemu_cmd(k: Kernel, accel: str, outdir: Path, extra_append: str = "",
             mem: str = "6G", smp: int = 2) -> list[str]:
    append = (f"console=ttyS0 panic=-1 quiet loglevel=4 hami.repo={REPO} hami.venv={VENV} "
              f"{extra_append}").strip()
    cmd = ["qemu-system-x86_64", "-machine", "q35", "-m", mem, "-smp", str(smp),
           "-nographic", "-no-reboot", "-nodefaults", "-serial", "stdio",
           "-kernel", str(k.vmlinuz), "-initrd", str(k.initrd), "-append", append,
           "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                      "multidevs=remap,id=hostroot",
           "-virtfs", f"local,path={outdir},mount_tag=hamiout,security_model=none,"
                      "multidevs=remap,id=hamiout"]
    if accel == "kvm":
        cmd += ["-accel", "kvm", "-cpu", "host"]
    else:
        cmd += ["-accel", "tcg", "-cpu", "max"]
    return cmd


def kvm_boots(k: Kernel, scratch: Path, timeout: float = 30) -> tuple[bool, str]:
    """Whether KVM boots this kernel to our /init here (a probe boot that powers off at once)."""
    if os.environ.get("HAMI_KERNELS_KVM") == "0":
        return False, "KVM disabled by HAMI_KERNELS_KVM=0"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "no /dev/kvm"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(qemu_cmd(k, "kvm", scratch, "hami.probe=1", mem="1G", smp=1),
                           capture_output=True, text=True, timeout=timeout)
        out = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        out = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
               else (e.stdout or ""))
        return False, f"KVM probe boot did not reach /init within {timeout:g}s" + \
            (": " + _kvm_error(out) if _kvm_error(out) else "")
    if "HAMI-GUEST-BOOTED" in out:
        return True, "KVM"
    lines = [ln for ln in out.strip().splitlines() if "error" in ln.lower()] or out.strip().splitlines()[-1:]
    return False, "KVM probe boot failed: " + (_kvm_error(out) or (lines[0][:160] if lines else "?"))


def _kvm_error(out: str) -> str:
    m = re.search(r"KVM internal error[^\n]*", out)
    return m.group(0) if m else ""


def boot(k: Kernel, outdir: Path, accel: str, timeout: float, lockdown_pass: bool,
         patch: Path | None = None) -> dict:
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir(parents=True)
    if patch:
        shutil.copy2(patch, outdir / "guest.patch")
    (outdir / "pytest.args").write_text("\n".join(PYTEST_ARGS) + "\n")
    (outdir / "modroot").write_text(f"{CACHE / 'modroot' / k.version}\n")
    if lockdown_pass:
        (outdir / "pytest2.args").write_text("\n".join(LOCKDOWN_ARGS) + "\n")
    cmd = qemu_cmd(k, accel, outdir)
    log(f"{k.spec.key}: booting {k.version} under {accel.upper()}")
    t0 = time.monotonic()
    console = open(outdir / "console.log", "w")
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
    timed_out = False
    # A guest that hangs before guest.sh is given up on early (it is booted
    # again); once guest.sh runs, the tests get the whole `timeout`.
    in_guest_sh = False
    try:
        deadline = t0 + timeout
        boot_deadline = t0 + min(timeout, BOOT_TIMEOUT)
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if now > deadline or (not in_guest_sh and now > boot_deadline):
                timed_out = True
                p.kill()
                break
            if not sel.select(timeout=5):
                if p.poll() is not None:
                    break
                continue
            line = p.stdout.readline()
            if not line:
                break
            console.write(line)
            console.flush()
            in_guest_sh = in_guest_sh or "hami-guest: " in line
            s = line.rstrip("\r\n")
            if s and not s.startswith("\x1b"):
                print(f"  [{k.spec.key}] {s}", flush=True)
        p.wait(30)
    finally:
        console.close()
        if p.poll() is None:
            p.kill()
            p.wait()
    took = time.monotonic() - t0
    res = {"accel": accel, "seconds": round(took), "timed_out": timed_out, "qemu_rc": p.returncode,
           "boot_failure": boot_failure(outdir, p.returncode, timed_out)}
    log(f"{k.spec.key}: guest finished in {took:.0f} s (qemu exit {p.returncode}"
        f"{', TIMED OUT' if timed_out else ''})")
    return res


def boot_failure(outdir: Path, qemu_rc: int | None, timed_out: bool) -> str:
    """Why the guest never reached tests/kernels/guest.sh ("" when it did)."""
    if (outdir / "guest.log").exists():
        return ""
    try:
        console = (outdir / "console.log").read_text(errors="replace")
    except OSError:
        console = ""
    console = re.sub(r"\x1b(\[[0-9;?]*[A-Za-z]|c)", "", console)   # the firmware's screen codes
    m = re.search(r"HAMI-GUEST-FAIL: [^\n]*", console)
    if m:
        return m.group(0).strip()
    tail = " | ".join(ln.strip() for ln in console.strip().splitlines()[-3:]) or "no console output"
    if "HAMI-GUEST-BOOTED" not in console:
        why = "the kernel did not reach /init"
    else:
        why = "/init did not hand over to guest.sh"
    how = "timed out" if timed_out else f"qemu exit {qemu_rc}"
    return f"{why} ({how}; console: {tail[-300:]})"


def patching_oops(console: str) -> str:
    """The guest kernel tripped over its own text patching: an int3 Oops at a
    kernel address outside any BPF program (seen on 7.3 under TCG, at
    trace_syscall_exit while the daemon enables syscall tracepoints: the
    patch's int3 taken after the kernel had finished with it). Not a test's
    failure, and not ours: "" when the console shows none."""
    console = re.sub(r"\x1b(\[[0-9;?]*[A-Za-z]|c)", "", console)
    m = re.search(r"Oops: int3\b[^\n]*\n(?:[^\n]*\n){0,8}?[^\n]*RIP: 0010:(\S+)", console)
    if not m or "bpf_prog" in m.group(1):
        return ""
    return f"guest kernel Oops (int3) in its own text patching at {m.group(1)}"


class _host_lock:
    """Holds the file named by HAMI_CI_HOST_LOCK (flock) while the host row
    runs: .ci/run's container stage, beside the matrix, uses the host's BPF
    too and holds the same lock. No variable, no lock."""

    def __enter__(self):
        self.fd = None
        path = os.environ.get("HAMI_CI_HOST_LOCK")
        if path:
            import fcntl
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            log(f"host: waiting for {path}")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)   # releases the lock
        return False


def run_host(outdir: Path, timeout: float) -> dict:
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir(parents=True)
    t0 = time.monotonic()
    with open(outdir / "doctor.json", "w") as f:
        subprocess.run([str(VENV / "bin/hami-bpf"), "doctor", "--json"], stdout=f,
                       stderr=subprocess.DEVNULL, cwd=REPO)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    log(f"host: pytest {' '.join(PYTEST_ARGS)}")
    with open(outdir / "pytest.log", "w") as f, _host_lock():
        p = subprocess.run([str(VENV / "bin/python"), "-m", "pytest", "-p", "no:cacheprovider",
                            "-o", "junit_family=legacy",
                            f"--junitxml={outdir / 'junit.xml'}", *PYTEST_ARGS],
                           cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    (outdir / "rc").write_text(f"{p.returncode}\n")
    took = time.monotonic() - t0
    log(f"host: pytest exit {p.returncode} in {took:.0f} s")
    return {"accel": "none (host)", "seconds": round(took), "timed_out": False, "qemu_rc": None}


# ----------------------------------------------------------------- results

@dataclass
class Case:
    nodeid: str
    outcome: str        # passed | failed | skipped | error
    message: str = ""
    mechanism: str = ""
    seconds: float = 0.0


def read_junit(path: Path) -> dict[str, Case]:
    cases: dict[str, Case] = {}
    if not path.exists():
        return cases
    for tc in ET.parse(path).getroot().iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        file = cls.replace(".", "/") + ".py"
        nodeid = f"{file}::{name}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = el.get("message") or (el.text or "")
                if tag != "skipped":
                    msg = _key_line((el.text or "") + "\n" + msg)
                break
        mech = ""
        props = tc.find("properties")
        if props is not None:
            for pr in props.iter("property"):
                if pr.get("name") == "mechanism":
                    mech = pr.get("value", "")
        case = Case(nodeid, outcome, " ".join(msg.split()), mech, float(tc.get("time") or 0))
        prev = cases.get(nodeid)
        if prev is None or outcome in ("failed", "error"):   # teardown errors add a second entry
            cases[nodeid] = case
    return cases


def _short(msg: str, n: int = 140) -> str:
    msg = re.sub(r"^Skipped: ", "", msg)
    return msg if len(msg) <= n else msg[: n - 1] + "…"


def _key_line(text: str) -> str:
    """The line of a failure that says why: the daemon's error or the verifier's verdict."""
    found = []
    m = re.search(r"hami-bpf: error: [^\n]*(Failed to load BPF program [^\n:]*)", text)
    if m:
        text = m.group(1) + "\n" + text
    for pat in (r"Failed to load BPF program [^\n:]*", r"Unreleased reference[^\n]*",
                r"invalid [^\n]*", r"AssertionError: [^\n]*", r"E\s+assert [^\n]*"):
        m = re.search(pat, text)
        if m:
            found.append(m.group(0))
    return ": ".join(found[:2]) if found else text


def cell_for(cases: dict[str, Case], nodeid: str) -> str:
    c = cases.get(nodeid)
    if c is None:
        return "not run"
    if c.outcome == "passed":
        return "passed"
    if c.outcome == "skipped":
        return f"skipped ({_short(c.message)})"
    return f"**{c.outcome.upper()}** ({_short(c.message)})"


def suite_cell(cases: dict[str, Case], prefix: str) -> str:
    sel = [c for n, c in cases.items() if n.startswith(prefix)]
    if not sel:
        return "not run"
    counts: dict[str, int] = {}
    for c in sel:
        counts[c.outcome] = counts.get(c.outcome, 0) + 1
    text = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    bad = [c for c in sel if c.outcome in ("failed", "error")]
    if bad:
        text = "**" + text + "**: " + "; ".join(c.nodeid.split("::")[-1] for c in bad)
    return text


@dataclass
class Row:
    key: str
    label: str
    how: str
    outdir: Path
    run: dict = field(default_factory=dict)
    error: str = ""


def _doctor(r: Row, name: str = "doctor.json") -> dict:
    try:
        return json.loads((r.outdir / name).read_text())
    except (OSError, ValueError):
        return {}


def summarize(rows: list[Row]) -> tuple[str, bool]:
    """Two markdown tables: the kernels (how each ran, what the start-up probe
    found), then mechanism x kernel -> passed / skipped (reason) / FAILED."""
    ok = True
    details: list[str] = []
    k_lines = ["| row | kernel | how it ran | start-up probe | `auto` chose |",
               "|---|---|---|---|---|"]
    cols = []
    for r in rows:
        doc = _doctor(r)
        feats = doc.get("features") or {}
        fl = ", ".join(f"{k} {'yes' if feats.get(k) else 'no'}"
                       for k in ("reg_write", "probe_write_user", "send_signal")) if feats else "?"
        mech = doc.get("mechanisms") or {}
        chose = f"oom={mech.get('oom', '?')}, meminfo={mech.get('meminfo', '?')}"
        kern = (doc.get("kernel") or {}).get("value") or "?"
        lock = (doc.get("lockdown") or {}).get("value", "?")
        how = r.how + (f", {r.run['seconds']} s" if r.run.get("seconds") is not None else "")
        if r.error:
            how += f"; **NOT RUN**: {_short(r.error, 300)}"
            ok = False
        k_lines.append(f"| {r.key} | {kern} (lockdown {lock}) | {how} | {fl} | {chose} |")
        cases = read_junit(r.outdir / "junit.xml")
        cases2 = read_junit(r.outdir / "junit2.xml")
        cols.append((r, cases, cases2))
        for c in list(cases.values()) + list(cases2.values()):
            if c.outcome in ("failed", "error"):
                ok = False
                details.append(f"- {r.key}: {c.nodeid}: {c.outcome}: {_short(c.message, 600)}")
        if not cases and not r.error:
            ok = False
            details.append(f"- {r.key}: no results (see {r.outdir}/console.log or pytest.log)")
        rc = r.outdir / "rc"
        if cases and rc.exists() and rc.read_text().strip() != "0" \
                and not any(c.outcome in ("failed", "error") for c in cases.values()):
            ok = False
            details.append(f"- {r.key}: pytest exit {rc.read_text().strip()}")

    m_lines = ["| mechanism / test | " + " | ".join(r.key for r, _, _ in cols) + " |",
               "|---|" + "---|" * len(cols)]
    for title, nodeid in MECH_COLUMNS:
        m_lines.append(f"| {title} | " + " | ".join(
            "not run" if r.error else cell_for(c, nodeid) for r, c, _ in cols) + " |")
    for title, prefix in SUITE_COLUMNS:
        m_lines.append(f"| {title} | " + " | ".join(
            "not run" if r.error else suite_cell(c, prefix) for r, c, _ in cols) + " |")
    lk = "tests/kernels/test_mechanisms.py::test_meminfo_mechanism[stop-write]"
    cells = []
    for r, _, c2 in cols:
        if c2:
            cells.append(cell_for(c2, lk))
        elif r.key == "host":
            cells.append("n/a (the host already runs lockdown=integrity: see meminfo stop-write)")
        else:
            cells.append("not run (only where bpf_probe_write_user is allowed)")
    m_lines.append("| meminfo stop-write after `lockdown=integrity` at run time | "
                   + " | ".join(cells) + " |")
    out = "\n".join(k_lines) + "\n\n" + "\n".join(m_lines)
    if details:
        out += "\n\nFailures:\n" + "\n".join(details)
    return out, ok


# -------------------------------------------------------------------- main

def _save_row(row: Row) -> None:
    row.outdir.mkdir(parents=True, exist_ok=True)
    (row.outdir / "row.json").write_text(json.dumps({"how": row.how, "run": row.run,
                                                     "error": row.error}))


def run_guest(row: Row, k: Kernel, args) -> tuple[str, float]:
    """Boot `k` and run the tests in it (a boot that fails is tried once more);
    returns (what, seconds) for the timings."""
    key = k.spec.key
    t0 = time.monotonic()
    try:
        kvm, why = kvm_boots(k, CACHE / "k" / k.version / "kvm-probe")
        accel = "kvm" if kvm else "tcg"
        row.how = f"qemu {accel.upper()}" + ("" if kvm else f" ({why})")
        log(f"{key}: {row.how}")
        row.run = boot(k, row.outdir, accel, args.timeout, not args.no_lockdown_pass,
                       args.guest_patch)
        for attempt in range(1, MAX_BOOTS):
            try:
                oops = patching_oops((row.outdir / "console.log").read_text(errors="replace"))
            except OSError:
                oops = ""
            if not (row.run["boot_failure"] or oops) or (row.run["boot_failure"] and attempt > 1):
                break
            # Only a boot, or a guest kernel that tripped over its own text
            # patching (under TCG it can, twice in a row), is retried: a
            # failing test fails the row.
            why = row.run["boot_failure"] or oops
            kept = Path(f"{row.outdir}.attempt{attempt}")
            log(f"{key}: {'the guest did not boot' if row.run['boot_failure'] else 'the guest crashed'}: "
                f"{why}; booting it once more (attempt {attempt} kept in {kept})")
            shutil.rmtree(kept, ignore_errors=True)
            row.outdir.rename(kept)
            row.run = boot(k, row.outdir, accel, args.timeout, not args.no_lockdown_pass,
                           args.guest_patch)
            row.how += f", booted again (attempt {attempt}: {_short(why, 200)})"
        if args.guest_patch:
            row.how += f", with --guest-patch {args.guest_patch.name}"
        if row.run["boot_failure"]:
            row.error = f"guest did not boot: {row.run['boot_failure']}"
        elif row.run["timed_out"]:
            row.error = f"guest timed out after {args.timeout:g} s"
    except Exception as e:  # a row that cannot run is reported, not hidden
        row.error = f"{type(e).__name__}: {e}"
        log(f"{key}: {row.error}")
    _save_row(row)
    return f"{key}: {row.how.split(' (')[0]}, boot and tests", time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", default=[],
                    help="row key(s) to run: debian-7, debian-12, host (default: all)")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("HAMI_KERNELS_TIMEOUT", 2400)),
                    help="seconds per guest boot (default 2400)")
    ap.add_argument("--no-lockdown-pass", action="store_true",
                    help="skip the second pass with lockdown raised to integrity")
    ap.add_argument("--guest-patch", type=Path, default=None, metavar="FILE",
                    help="a patch (-p1) applied inside each guest only, to try a fix on a kernel "
                         "before committing it; the checkout is not touched")
    ap.add_argument("--report-only", action="store_true", help="print the table of the last run")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("HAMI_KERNELS_JOBS", 2)),
                    help="guests booted side by side (default 2)")
    ap.add_argument("--fetch-only", action="store_true",
                    help="download and extract the kernels and build their initramfs, then stop")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("test-kernels: needs root (BPF on the host, qemu's 9p export of /)", file=sys.stderr)
        return 2
    want = set(args.only) or {s.key for s in KERNELS} | {"host"}
    results = CACHE / "results"
    rows: list[Row] = []
    t_start = time.monotonic()

    if not args.report_only:
        for tool in ("qemu-system-x86_64", "cpio", "modinfo", "xz", "file"):
            if shutil.which(tool) is None:
                print(f"test-kernels: {tool} not found (apt-get install qemu-system-x86 "
                      "busybox-static cpio kmod xz-utils zstd file)", file=sys.stderr)
                return 2
    apt = None
    timings: list[tuple[str, float]] = []
    guests: list[tuple[Row, Kernel]] = []
    for spec in KERNELS:
        if spec.key not in want:
            continue
        row = Row(spec.key, spec.title, "qemu", results / spec.key)
        rows.append(row)
        if args.report_only:
            continue
        try:
            t0 = time.monotonic()
            if apt is None:
                apt = Apt(CACHE / "apt")
                apt.update()
                names = apt.names()
            version = resolve(apt, spec, names)
            k = fetch(apt, spec, version)
            build_initrd(k)
            timings.append((f"{spec.key}: fetch {version}", time.monotonic() - t0))
            guests.append((row, k))
        except Exception as e:  # a row that cannot run is reported, not hidden
            row.error = f"{type(e).__name__}: {e}"
            log(f"{spec.key}: {row.error}")
            _save_row(row)
    if args.fetch_only:
        for what, sec in timings:
            log(f"{what}: {sec:.0f} s")
        return 1 if any(r.error for r in rows) else 0
    # The guests' work is mostly one compiler at a time: booting them side by
    # side uses both CPUs of a small host.
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for got in pool.map(lambda rk: run_guest(*rk, args), guests):
            timings.append(got)
    if "host" in want:
        row = Row("host", "host kernel, run directly (not booted in qemu)", "directly on the host",
                  results / "host")
        rows.append(row)
        if not args.report_only:
            t0 = time.monotonic()
            try:
                row.run = run_host(row.outdir, args.timeout)
            except Exception as e:
                row.error = f"{type(e).__name__}: {e}"
            timings.append(("host: tests", time.monotonic() - t0))
            (row.outdir / "row.json").write_text(json.dumps({"how": row.how, "run": row.run,
                                                             "error": row.error}))
    if args.report_only:
        for r in rows:
            try:
                j = json.loads((r.outdir / "row.json").read_text())
                r.how, r.run, r.error = j["how"], j["run"], j["error"]
            except (OSError, ValueError, KeyError):
                pass

    table, ok = summarize(rows)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    total = time.monotonic() - t_start
    head = (f"Kernel matrix, {stamp}, `make test-kernels` on {platform.node()} "
            f"(host kernel {platform.release()}, {os.cpu_count()} CPUs)"
            + ("" if args.report_only else f", {total:.0f} s in all"))
    text = head + "\n\n" + table + "\n"
    results.mkdir(parents=True, exist_ok=True)
    (results / "table.md").write_text(text)
    if not args.report_only:
        (results / "timings.txt").write_text(
            "".join(f"{what}\t{sec:.0f}\n" for what, sec in timings))
    print("\n" + text)
    print(f"test-kernels: {'all rows passed' if ok else 'FAILED'} "
          f"(details: {results}/<row>/pytest.log, console.log)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
