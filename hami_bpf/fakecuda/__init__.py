"""fakecuda: a stand-in libcuda (C, compiled at run time with gcc) and a
scriptable CUDA workload, ``cudaprog``, for tests, the demo and benches.

    fake = build()                       # cached by source hash
    with CudaProc(fake, env={"FAKECUDA_DEVICES": "1"}) as p:
        p.cmd("init"); p.cmd("device 0")
        rc, aid = p.alloc(1 << 30)
        rc, free, total = p.meminfo()
        p.free(aid)

The simulated devices live inside each process: nothing is shared between
processes and no GPU is touched.  See libcuda.c and cudaprog.c for the
behaviour and the command language.
"""
from __future__ import annotations

import hashlib
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

__all__ = [
    "CUDA_ERROR_INVALID_CONTEXT",
    "CUDA_ERROR_INVALID_VALUE",
    "CUDA_ERROR_NOT_INITIALIZED",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "CUDA_SUCCESS",
    "ENTRY_SYMBOLS",
    "CudaProc",
    "FakeCuda",
    "FakeCudaError",
    "LIB_CFLAGS",
    "build",
    "default_cache_dir",
]

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_CONTEXT = 201

SRC_DIR = Path(__file__).resolve().parent
LIB_SOURCE = SRC_DIR / "libcuda.c"
PROG_SOURCE = SRC_DIR / "cudaprog.c"
NVML_SOURCE = Path(__file__).with_name("libnvidia-ml.c")

# Every exported entry must start with `push %rbp` (0x55), like libcuda 580:
# no endbr64 (-fcf-protection=none), a frame in every function (the ENTRY()
# macro plus the frame-pointer flags), no tail-call or shrink-wrapped entries
# and no identical-code folding (distinct addresses for each variant).
LIB_CFLAGS: tuple[str, ...] = (
    "-O2",
    "-fno-omit-frame-pointer",
    "-mno-omit-leaf-frame-pointer",
    "-fno-optimize-sibling-calls",
    "-fno-shrink-wrap",
    "-fno-ipa-icf",
    "-fcf-protection=none",
    "-fvisibility=hidden",
    "-fPIC",
    "-shared",
    "-Wall",
    "-Wl,-soname,libcuda.so.1",
)
PROG_CFLAGS: tuple[str, ...] = ("-O2", "-Wall", "-pthread")

# The driver entry points the stand-in exports (all begin with push %rbp).
ENTRY_SYMBOLS: tuple[str, ...] = (
    "cuInit", "cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetCount",
    "cuDeviceGetName", "cuDeviceGetUuid", "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2",
    "cuCtxCreate_v2", "cuCtxCreate_v3", "cuCtxCreate_v4", "cuCtxDestroy_v2",
    "cuCtxSetCurrent", "cuCtxGetCurrent", "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2", "cuCtxGetDevice",
    "cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemFree_v2",
    "cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuMemFreeAsync",
    "cuMemFreeAsync_ptsz", "cuMemAllocFromPoolAsync",
    "cuMemAllocFromPoolAsync_ptsz", "cuMemCreate", "cuMemRelease", "cuMemMap",
    "cuMemUnmap", "cuMemAddressReserve", "cuMemAddressFree", "cuMemSetAccess",
    "cuMemGetInfo_v2", "cuArrayCreate_v2", "cuArray3DCreate_v2", "cuMipmappedArrayCreate",
    "cuArrayDestroy", "cuMipmappedArrayDestroy",
    "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx",
    "cuLaunchKernelEx_ptsz", "cuLaunchCooperativeKernel",
    "cuLaunchCooperativeKernel_ptsz", "cuGraphLaunch", "cuGraphLaunch_ptsz",
    "cuCtxSynchronize", "cuCtxSynchronize_v2", "cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuEventSynchronize",
    "cuGetProcAddress_v2", "cuGetErrorString",
)


class FakeCudaError(RuntimeError):
    """cudaprog answered `err ...`, exited, or did not answer in time."""


@dataclass(frozen=True)
class FakeCuda:
    """A built stand-in: ``lib_dir`` holds libcuda.so.1 (+ libcuda.so link)."""

    lib_dir: Path
    libcuda: Path
    cudaprog: Path

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """os.environ plus ``extra`` (values str()-ed)."""
        env = dict(os.environ)
        if extra:
            env.update({k: str(v) for k, v in extra.items()})
        return env


def default_cache_dir() -> Path:
    """/var/cache/hami-bpf/fakecuda when writable, else a per-user tmp dir."""
    root = Path("/var/cache/hami-bpf/fakecuda")
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK | os.X_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"hami-bpf-fakecuda-{os.getuid()}"


def _source_hash(cc: str) -> str:
    h = hashlib.sha256()
    for part in (LIB_SOURCE.read_bytes(), PROG_SOURCE.read_bytes(), NVML_SOURCE.read_bytes(),
                 " ".join(LIB_CFLAGS).encode(), " ".join(PROG_CFLAGS).encode(),
                 cc.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _run_cc(args: list[str]) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FakeCudaError(
            f"building fakecuda failed ({' '.join(args)}):\n{proc.stderr.strip()}")


def build(dest: Path | None = None, cc: str | None = None) -> FakeCuda:
    """Compile libcuda.so.1 and cudaprog into ``dest/<source hash>/``.

    Reuses an earlier build with the same sources and flags.  Safe against
    concurrent builders (each builds in a private dir and renames it in).
    """
    cc = cc or os.environ.get("CC") or "gcc"
    if shutil.which(cc) is None:
        raise FakeCudaError(f"building fakecuda needs a C compiler: {cc!r} not found "
                            "(run `make install`, which installs gcc)")
    root = Path(dest) if dest is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    out = root / _source_hash(cc)
    fake = FakeCuda(lib_dir=out, libcuda=out / "libcuda.so.1", cudaprog=out / "cudaprog")
    if fake.libcuda.is_file() and fake.cudaprog.is_file():
        return fake
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _run_cc([cc, *LIB_CFLAGS, "-o", str(tmp / "libcuda.so.1"), str(LIB_SOURCE),
                 "-pthread", "-ldl"])
        (tmp / "libcuda.so").symlink_to("libcuda.so.1")
        _run_cc([cc, *LIB_CFLAGS, "-o", str(tmp / "libnvidia-ml.so.1"), str(NVML_SOURCE)])
        # rpath names the final directory, not the temporary one
        _run_cc([cc, *PROG_CFLAGS, "-o", str(tmp / "cudaprog"), str(PROG_SOURCE),
                 f"-L{tmp}", "-lcuda", f"-Wl,-rpath,{out}", "-ldl"])
        tmp.chmod(0o755)
        try:
            tmp.rename(out)
        except OSError:
            # another builder won the race; use its result
            if not (fake.libcuda.is_file() and fake.cudaprog.is_file()):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return fake


def _parse_reply(line: str) -> dict[str, str]:
    words = line.split()
    result: dict[str, str] = {}
    for w in words[1:]:
        k, sep, v = w.partition("=")
        if sep:
            result[k] = v
    return result


class CudaProc:
    """A running cudaprog driven line by line.

    ``cmd(line)`` sends one command and returns the answer's key=value pairs
    as a dict; an ``err`` answer, an exit or a timeout raise FakeCudaError.
    ``send``/``reply`` split that in two (for calls that enforcement stops).
    Use as a context manager: leaving it kills the process if still alive.
    """

    def __init__(self, fake: FakeCuda, env: Mapping[str, str] | None = None,
                 args: Sequence[str] = (), stderr=None, cwd: str | os.PathLike | None = None):
        self.fake = fake
        self.proc = subprocess.Popen(
            [str(fake.cudaprog), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            env=fake.env(env), cwd=cwd, bufsize=0, close_fds=True)
        self.pid: int = self.proc.pid
        self._buf = b""
        self._last: str | None = None

    # -- protocol ------------------------------------------------------------
    def send(self, line: str) -> None:
        if "\n" in line:
            raise ValueError("one command per send")
        self._last = line
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise FakeCudaError(f"cudaprog {self.pid} is gone ({e}); "
                                f"could not send {line!r}") from None

    def reply(self, timeout: float = 10) -> dict[str, str]:
        line = self._readline(timeout)
        if line.startswith("ok"):
            return _parse_reply(line)
        if line.startswith("err"):
            raise FakeCudaError(f"cudaprog {self.pid}: {line[4:]} (command {self._last!r})")
        raise FakeCudaError(f"cudaprog {self.pid}: unexpected answer {line!r}")

    def cmd(self, line: str, timeout: float = 10) -> dict[str, str]:
        self.send(line)
        return self.reply(timeout)

    def _readline(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FakeCudaError(f"cudaprog {self.pid}: no answer to {self._last!r} "
                                    f"within {timeout}s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                rc = self.proc.poll()
                if rc is None:
                    try:
                        rc = self.proc.wait(1)
                    except subprocess.TimeoutExpired:
                        rc = None
                raise FakeCudaError(f"cudaprog {self.pid} closed its output "
                                    f"(exit status {rc}) while answering {self._last!r}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace").strip()

    # -- helpers ---------------------------------------------------------------
    def alloc(self, size: int, timeout: float = 10) -> tuple[int, int]:
        """cuMemAlloc_v2 -> (rc, id); id is -1 on failure."""
        r = self.cmd(f"alloc {int(size)}", timeout)
        return int(r["rc"]), int(r["id"])

    def free(self, alloc_id: int, timeout: float = 10) -> int:
        return int(self.cmd(f"free {int(alloc_id)}", timeout)["rc"])

    def meminfo(self, timeout: float = 10) -> tuple[int, int, int]:
        """cuMemGetInfo_v2 -> (rc, free, total)."""
        r = self.cmd("meminfo", timeout)
        return int(r["rc"]), int(r["free"]), int(r["total"])

    def exit(self, code: int = 0, timeout: float = 10) -> int:
        """Ask the process to exit(code); returns its exit status."""
        self.cmd(f"exit {int(code)}", timeout)
        return self.wait(timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGKILL)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass

    def __enter__(self) -> "CudaProc":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CudaProc(pid={self.pid}, returncode={self.proc.poll()})"
