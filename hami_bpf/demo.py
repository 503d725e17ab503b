"""A small simulated multi-process CUDA workload for `hami-bpf run` on a host
without a GPU.

Processes of the bundled ``cudaprog`` (linked against the stand-in libcuda)
init, pick device 0 or 1, allocate and free various sizes, launch kernels,
sleep, and end in different ways: most exit cleanly, some crash (SIGSEGV),
some are killed with SIGKILL while holding memory.  Ended processes are
replaced until the stop event is set.  They come in two groups, told apart by
their environment (``CUDA_DEVICE_MEMORY_SHARED_CACHE`` as HAMi sets it, plus ``HAMI_BPF_GROUP``
and ``HAMI_GROUP``, so ``--group-by env:HAMI_GROUP`` separates them).
"""
from __future__ import annotations

import random
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .fakecuda import FakeCuda

__all__ = ["DEMO_GROUPS", "SIMULATED_BANNER", "DemoProcess", "DemoWorkload",
           "start_demo_workload"]

SIMULATED_BANNER = (
    "SIMULATED: no NVIDIA GPU or libcuda found. hami-bpf is observing a demo "
    "workload that calls a stand-in libcuda (bundled, built with gcc); the "
    "devices, memory and kernels shown are simulated, not real hardware."
)

GIB = 1 << 30
MIB = 1 << 20

# group name -> (CUDA_DEVICE_MEMORY_LIMIT as HAMi would set it, share of processes)
DEMO_GROUPS: dict[str, str] = {"demo-a": "6g", "demo-b": "4g"}


@dataclass
class DemoProcess:
    pid: int
    group: str
    device: int
    ending: str            # "exit", "crash" or "kill"
    started: float
    popen: subprocess.Popen = field(repr=False)


def _script(rng: random.Random, device: int, ending: str) -> str:
    cmds = ["init", f"device {device}"]
    live: list[int] = []
    next_id = 0
    for _ in range(rng.randint(3, 7)):
        size = rng.choice([64 * MIB, 256 * MIB, 512 * MIB, 1 * GIB, 2 * GIB])
        kind = rng.choice(["alloc", "alloc", "alloc", "allocasync", "allocmanaged"])
        cmds.append(f"{kind} {size}")
        live.append(next_id)
        next_id += 1
        cmds.append(f"launch {rng.randint(100, 2000)}")
        cmds.append(f"sleep {rng.randint(300, 1500)}")
        cmds.append("meminfo")
        if live and rng.random() < 0.4:
            victim = live.pop(rng.randrange(len(live)))
            cmds.append(f"free {victim}")
    if ending == "exit":
        for i in live[: len(live) // 2]:
            cmds.append(f"free {i}")  # the rest is left for exit to release
        cmds.append(f"sleep {rng.randint(200, 1000)}")
        cmds.append("exit 0")
    elif ending == "crash":
        cmds.append(f"sleep {rng.randint(200, 1000)}")
        cmds.append("crash")
    else:  # killed from outside while it holds memory
        cmds.append("hang")
    return "; ".join(cmds)


class DemoWorkload(threading.Thread):
    """Keeps ``n_procs`` demo processes alive until ``stop_event`` is set."""

    def __init__(self, fake: FakeCuda, n_procs: int = 4,
                 stop_event: threading.Event | None = None, seed: int | None = None,
                 launch_ns: int = 20_000, kill_after: float = 8.0):
        super().__init__(name="hami-bpf-demo", daemon=True)
        self.fake = fake
        self.n_procs = max(1, n_procs)
        self.stop_event = stop_event or threading.Event()
        self.rng = random.Random(seed)
        self.launch_ns = launch_ns
        self.kill_after = kill_after
        self.workdir = Path(tempfile.mkdtemp(prefix="hami-bpf-demo-"))
        self._lock = threading.Lock()
        self._procs: list[DemoProcess] = []
        self._spawned = 0
        self.ended: list[tuple[int, str, int]] = []   # (pid, group, returncode)

    @property
    def procs(self) -> list[DemoProcess]:
        with self._lock:
            return list(self._procs)

    def _spawn(self) -> None:
        n = self._spawned
        self._spawned += 1
        groups = list(DEMO_GROUPS)
        group = groups[n % len(groups)]
        device = self.rng.choice([0, 1])
        # one in six is killed, one in eight crashes, the rest exit
        roll = n % 24
        ending = "kill" if roll % 6 == 5 else "crash" if roll % 8 == 7 else "exit"
        env = self.fake.env({
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(self.workdir / f"{group}.cache"),
            "CUDA_DEVICE_MEMORY_LIMIT": DEMO_GROUPS[group],
            "HAMI_BPF_GROUP": group,
            "HAMI_GROUP": group,     # what tests/bpf use with --group-by env:HAMI_GROUP
            "FAKECUDA_DEVICES": "2",
            "FAKECUDA_LAUNCH_NS": str(self.launch_ns),
        })
        popen = subprocess.Popen(
            [str(self.fake.cudaprog), "-q", "-c", _script(self.rng, device, ending)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env, close_fds=True)
        with self._lock:
            self._procs.append(DemoProcess(popen.pid, group, device, ending,
                                           time.monotonic(), popen))

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            rc = p.popen.poll()
            if rc is None and p.ending == "kill" and now - p.started > self.kill_after:
                p.popen.send_signal(signal.SIGKILL)
                try:
                    rc = p.popen.wait(2)
                except subprocess.TimeoutExpired:
                    rc = None
            if rc is not None:
                with self._lock:
                    self._procs.remove(p)
                    self.ended.append((p.pid, p.group, rc))
                    del self.ended[:-100]

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                self._reap()
                while len(self.procs) < self.n_procs and not self.stop_event.is_set():
                    self._spawn()
                    # stagger the starts so the views have something moving
                    self.stop_event.wait(self.rng.uniform(0.2, 0.8))
                self.stop_event.wait(0.2)
        finally:
            self._kill_all()

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGKILL)
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
        with self._lock:
            self._procs.clear()

    def stop(self, timeout: float = 10) -> None:
        self.stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)


def start_demo_workload(fake: FakeCuda, n_procs: int = 4,
                        stop_event: threading.Event | None = None,
                        seed: int | None = None) -> DemoWorkload:
    """Start the demo workload in a background (daemon) thread and return it.
    Set ``stop_event`` (or call ``.stop()``) to end it; remaining processes
    are then killed."""
    w = DemoWorkload(fake, n_procs=n_procs, stop_event=stop_event, seed=seed)
    w.start()
    return w
