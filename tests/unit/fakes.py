"""Stand-ins for the kernel side, so the controller's real components run
without root, bcc or real processes: FakeProbes records what would be written
to the BPF maps, FakeProc is a /proc tree of made-up processes (procfs reads
it once procfs.PROC points there) that also takes the signals the controller
sends them."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from hami_bpf import abi


class FakeProbes:
    """The maps the controller writes, recorded; what BPF would report, settable."""

    def __init__(self):
        self.proc_cfg: dict[int, tuple[int, int]] = {}
        self.phys: dict[int, list[int] | None] = {}
        self.limits: dict[tuple[int, int], int | None] = {}
        self.totals: dict[tuple[int, int], int | None] = {}
        self.deleted_groups: list[int] = []
        self.gate_wait: set[int] = set()     # pids the cuInit probe holds
        self.pmem: dict[tuple[int, int], int] = {}
        self.gmem: dict[tuple[int, int], tuple[int, int]] = {}
        self.launch_probes = 0                # launch probes attached
        self.launch_counts: dict[int, int] = {}
        self.stat_values: dict[str, int] = {}
        # (group index, device) -> (consumed, launches, completed, sync_ns,
        # completed_ns, syncs), as sm_use holds them; the grants written.
        self.sm_uses: dict[tuple[int, int], tuple[int, int, int, int, int, int]] = {}
        self.grants: dict[tuple[int, int], tuple[int, bool]] = {}

    def gate_waiting(self):
        return sorted(self.gate_wait)

    def claim_gate(self, pid):
        if pid in self.gate_wait:
            self.gate_wait.discard(pid)
            return True
        return False

    def write_proc_cfg(self, pid, group_index, slot, phys, must_exist=False):
        if must_exist and pid not in self.proc_cfg:
            return False
        self.proc_cfg[pid] = (group_index, slot)
        self.phys[pid] = phys
        return True

    def set_group_limit(self, group_index, device, limit, total):
        self.limits[(group_index, device)] = limit
        self.totals[(group_index, device)] = total

    def ensure_proc(self, pid):
        pass

    def delete_proc_cfg(self, pid):
        self.proc_cfg.pop(pid, None)

    def delete_group(self, index):
        self.deleted_groups.append(index)
        for k in [k for k in self.limits if k[0] == index]:
            del self.limits[k]

    def group_used(self, gi, dev):
        return self.gmem.get((gi, dev), (0, 0))[0]

    def group_mem(self):
        return dict(self.gmem)

    def process_mem(self):
        return dict(self.pmem)

    def launch_probes_attached(self):
        return self.launch_probes

    def launches(self):
        return dict(self.launch_counts)

    def attach_launch(self, lib, syms):
        return []

    def detach_launch(self, lib):
        pass

    def delete_sm_grant(self, gi, dev):
        self.grants.pop((gi, dev), None)

    def sm_use(self):
        return dict(self.sm_uses)

    def sync_waiting(self):
        return {}

    def set_sm_grant(self, gi, dev, granted, held, checkpoint=True, hold_at_sync=False):
        self.grants[(gi, dev)] = (granted, held)

    def stats(self):
        return dict(self.stat_values)

    def bpf_procs(self):
        return set(self.proc_cfg)

    def sweep(self, live):
        return 0


class FakeProc:
    """A /proc of made-up processes. ``signals`` lists every (pid, signal)
    sent to them; SIGSTOP and SIGCONT change the state their stat shows."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.signals: list[tuple[int, int]] = []
        self._next_start = 1000

    def spawn(self, pid: int, env: dict[str, str] | None = None, comm: str = "python",
              cgroup: str = "/kubepods/burstable/pod1/ctr1") -> int:
        d = self.root / str(pid)
        d.mkdir()
        self._next_start += 1
        self._write_stat(pid, comm, "S", self._next_start)
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0"
                                             for k, v in (env or {}).items()))
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        (d / "comm").write_text(comm + "\n")
        (d / "status").write_text(f"Name:\t{comm}\nNSpid:\t{pid}\t7\n")
        return pid

    def _write_stat(self, pid: int, comm: str, state: str, start: int) -> None:
        fields = [state, "1"] + ["0"] * 17 + [str(start)] + ["0"] * 30   # start: field 22
        (self.root / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")

    def state(self, pid: int) -> str | None:
        from hami_bpf import procfs
        return procfs.state(pid, proc=str(self.root))

    def set_state(self, pid: int, state: str) -> None:
        from hami_bpf import procfs
        f = procfs.stat_fields(pid, proc=str(self.root))
        self._write_stat(pid, f[1], state, int(f[21]))

    def exit(self, pid: int) -> None:
        d = self.root / str(pid)
        for p in d.iterdir():
            p.unlink()
        d.rmdir()

    def kill(self, pid: int, sig: int) -> None:
        """os.kill for the fake processes (ProcessLookupError when gone)."""
        if not (self.root / str(pid)).is_dir():
            raise ProcessLookupError(pid)
        self.signals.append((pid, sig))
        if sig == signal.SIGSTOP:
            self.set_state(pid, "T")
        elif sig == signal.SIGCONT:
            self.set_state(pid, "S")

    def install(self, monkeypatch) -> "FakeProc":
        from hami_bpf import procfs
        monkeypatch.setattr(procfs, "PROC", str(self.root))
        monkeypatch.setattr(os, "kill", self.kill)
        return self


def event(kind: int, pid: int, flags: int = 0, **fields) -> abi.Event:
    e = abi.Event()
    e.kind, e.tgid, e.tid, e.flags = kind, pid, pid, flags
    for k, v in fields.items():
        setattr(e, k, v)
    return e


class FakeSm:
    """SmControl as the registry and the views call it: what they asked, recorded."""

    def __init__(self):
        self.released: list[tuple[str, int]] = []
        self.forgotten: list[tuple[str, int]] = []
        self.throttled: dict[str, set[int]] = {}
        self.shares: dict[int, float] = {}
        self.sm_caps: dict[str, dict[int, int]] = {}

    def release(self, group, pid):
        self.released.append((group, pid))

    def forget_group(self, name, index):
        self.forgotten.append((name, index))

    def caps(self, group):
        return self.sm_caps.get(group, {})

    def shown_throttled(self, group, pid, now):
        return pid in self.throttled.get(group, ())

    def group_share(self, group_index):
        return self.shares.get(group_index)

    def group_view(self, group, index):
        caps = self.sm_caps.get(group)
        return dict(sm_limit=min(caps.values()) if caps else None, priority=1,
                    sm_lending=(), sm_turns=())


class FakeLimits:
    """GroupLimits: every apply and sync, recorded; ``fail``: the next apply
    raises it (once)."""

    def __init__(self, ctx_bytes: int = 0):
        self.ctx_bytes = ctx_bytes
        self.applied: list[tuple[str, int, int, str | None]] = []
        self.synced: list[tuple[str, int]] = []
        self.unseen_devices: dict[int, list[int]] = {}   # pid -> devices with unseen bytes
        self.fail: Exception | None = None

    def forget_process(self, pid):
        return self.unseen_devices.pop(pid, [])

    def apply(self, group, index, pid, cvd):
        self.applied.append((group, index, pid, cvd))
        if self.fail is not None:
            e, self.fail = self.fail, None
            raise e

    def sync(self, group, device):
        self.synced.append((group, device))


class FakeMemory:
    def __init__(self):
        self.forgotten: list[int] = []
        self.denials: dict[int, int] = {}

    def forget(self, pid):
        self.forgotten.append(pid)

    def denied(self, pid):
        return self.denials.get(pid, 0)


class FakeWatch:
    def __init__(self):
        self.released: list[int] = []
        self.housekept = 0

    def release(self, pid):
        self.released.append(pid)

    def housekeeping(self, now):
        self.housekept += 1


class FakeRegions:
    def __init__(self):
        self.gone_groups: list[str] = []

    def gone(self, group):
        self.gone_groups.append(group)
