"""The node's GPUs as the daemon sees them: NVML where it answers, else a
fallback the configuration describes (the stand-in libcuda's devices in the
demo and the tests), with the simulated GPU's utilization where one runs."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import abi
from .config import DEFAULT_FALLBACK_DEVICES, DEFAULT_FALLBACK_TOTAL_MEM
from .snapshot import DeviceInfo

log = logging.getLogger("hami_bpf")

# NVML's per-process utilization costs about 2 ms a call (an H100, driver
# 580; device utilization 16-29 µs) and covers the last second of samples.
# Read at most once per PROCESS_UTIL_READ_S per device and kept, the
# controller's 100-200 Hz ticks get the same numbers without spending a
# fifth of the daemon's loop inside NVML; and at most PROCESS_UTIL_READS_PER_S
# times a second over all devices, the stalest first, so that a node of
# eight capped GPUs spends no more of it there than a node of two.
PROCESS_UTIL_READ_S = 0.1
PROCESS_UTIL_READS_PER_S = 20.0
PROCESS_UTIL_ASKED_S = 1.0     # a device asked for within this long competes for reads


def process_samples(pynvml, dev: int) -> tuple[list | None, str | None]:
    """NVML's per-process utilization samples of device `dev` over the last
    second: (samples, None); (None, None) where it has none yet
    (NVML_ERROR_NOT_FOUND: idle, still reported); (None, why) where it does
    not report them (virtual machines: the driver lists no processes)."""
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(dev)
        return pynvml.nvmlDeviceGetProcessUtilization(h, int((time.time() - 1.0) * 1e6)), None
    except Exception as e:  # noqa: BLE001 - any refusal means "not reported"
        if getattr(e, "value", None) == getattr(pynvml, "NVML_ERROR_NOT_FOUND", -1):
            return None, None
        return None, str(e) or type(e).__name__


@dataclass(frozen=True)
class Fallback:
    """What to assume where NVML does not answer."""
    devices: int = DEFAULT_FALLBACK_DEVICES
    total_mem: int = DEFAULT_FALLBACK_TOTAL_MEM
    sim_gpu: str | None = None    # the simulated GPU's shared file (fakecuda.sim)
    proc_mem: str | None = None   # the stand-in driver's per-process memory table (fakecuda.sim)


@dataclass
class Devices:
    count: int
    simulated: bool
    uuid_to_index: dict[str, int] = field(default_factory=dict)
    nvml: bool = False
    sim: object | None = None     # fakecuda.sim.SimGpu: utilization of the simulated GPU
    total_mem: int = DEFAULT_FALLBACK_TOTAL_MEM   # without NVML: each device's memory
    _no_proc_util: bool = False   # NVML refused per-process utilization once: not asked again
    proc_mem: object | None = None    # fakecuda.sim.ProcMem: the stand-in's per-process memory
    _no_proc_mem: bool = False    # NVML refused per-process memory once: not asked again
    clock: Callable[[], float] = time.monotonic
    _proc_util: dict = field(default_factory=dict)    # device -> (read at, reading)
    _proc_util_asked: dict = field(default_factory=dict)  # device -> last asked for

    @classmethod
    def discover(cls, simulated: bool, fallback: Fallback = Fallback()) -> "Devices":
        try:
            import pynvml
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            uuids = {}
            for i in range(n):
                u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                uuids[u.decode() if isinstance(u, bytes) else u] = i
            return cls(n, False, uuids, True)
        except Exception as e:
            log.info("NVML unavailable (%s): %d devices of %d bytes assumed", e,
                     fallback.devices, fallback.total_mem)
        sim = proc_mem = None
        if fallback.sim_gpu:
            from .fakecuda.sim import SimGpu
            sim = SimGpu(fallback.sim_gpu)
        if fallback.proc_mem:
            from .fakecuda.sim import ProcMem
            proc_mem = ProcMem(fallback.proc_mem)
        return cls(max(1, min(fallback.devices, abi.MAX_DEVS)), simulated, sim=sim,
                   total_mem=fallback.total_mem, proc_mem=proc_mem)

    @property
    def has_utilization(self) -> bool:
        return self.nvml or self.sim is not None

    def utilization(self) -> dict[int, float | None]:
        """Device-level SM utilization, percent (NVML in the GPU VM lists no processes)."""
        if self.sim is not None:
            return self.sim.utilization(self.count)
        import pynvml
        out = {}
        for i in range(self.count):
            try:
                out[i] = float(pynvml.nvmlDeviceGetUtilizationRates(
                    pynvml.nvmlDeviceGetHandleByIndex(i)).gpu)
            except Exception:
                out[i] = None
        return out

    def process_utilization(self, dev: int) -> dict[int, float] | None:
        """SM utilization per pid over the last second where NVML reports it
        (bare-metal hosts); None where it does not (virtual machines: the
        driver lists no processes). A device's first reading is taken at
        once; after that the kept one is returned until this device's is
        the stalest of those asked for, at least PROCESS_UTIL_READ_S old,
        and the node's read budget (PROCESS_UTIL_READS_PER_S) allows one."""
        if not self.nvml or self._no_proc_util:
            return None
        now = self.clock()
        self._proc_util_asked[dev] = now
        kept = self._proc_util.get(dev)
        if kept is not None and not self._proc_util_due(dev, now):
            return kept[1]
        out = self._read_process_utilization(dev)
        self._proc_util[dev] = (now, out)
        return out

    def _proc_util_due(self, dev: int, now: float) -> bool:
        read_at = self._proc_util[dev][0]
        if now - read_at < PROCESS_UTIL_READ_S:
            return False
        last = max(at for at, _reading in self._proc_util.values())   # any device's
        if now - last < 1.0 / PROCESS_UTIL_READS_PER_S:
            return False
        return all(self._proc_util[d][0] >= read_at
                   for d, asked in self._proc_util_asked.items()
                   if d != dev and d in self._proc_util and now - asked <= PROCESS_UTIL_ASKED_S)

    def utilization_source(self) -> str:
        """What the SM guard reads of the devices' use (`mechanisms`), probed
        now: each process's part where NVML reports it, else the device's."""
        if self.sim is not None:
            return "simulated device"
        if not self.nvml:
            return "none (no NVML)"
        if self.count:
            import pynvml
            why = process_samples(pynvml, 0)[1]
            if why is None:
                return "per process (NVML)"
            self._no_proc_util = True
            return f"device (NVML; no per-process utilization: {why})"
        return "device (NVML)"

    def _read_process_utilization(self, dev: int) -> dict[int, float] | None:
        import pynvml
        samples, why = process_samples(pynvml, dev)
        if why is not None:
            self._no_proc_util = True
            log.info("NVML per-process utilization unavailable (%s): device-level "
                     "utilization is used", why)
        if samples is None:
            return None
        out: dict[int, float] = {}
        for smp in samples:
            out[int(smp.pid)] = max(out.get(int(smp.pid), 0.0), float(smp.smUtil))
        return out

    @property
    def has_process_memory(self) -> bool:
        return (self.nvml and not self._no_proc_mem) or self.proc_mem is not None

    def process_memory(self, dev: int) -> dict[int, int] | None:
        """Device memory per pid, everything each process holds there, where
        the driver reports it (NVML's list of compute processes on bare-metal
        hosts; in a virtual machine it lists none). None: not known."""
        if self.proc_mem is not None:
            return self.proc_mem.processes(dev)
        if not self.nvml or self._no_proc_mem:
            return None
        import pynvml
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(
                pynvml.nvmlDeviceGetHandleByIndex(dev))
        except Exception as e:  # noqa: BLE001 - unsupported here: asked no more
            self._no_proc_mem = True
            log.info("NVML per-process memory unavailable (%s): only probed calls are charged", e)
            return None
        out: dict[int, int] = {}
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if isinstance(used, int) and used >= 0:     # None where NVML cannot say (containers, MIG)
                out[int(p.pid)] = out.get(int(p.pid), 0) + used
        return out

    def infos(self) -> tuple[DeviceInfo, ...]:
        if self.nvml:
            import pynvml
            out = []
            for i in range(self.count):
                try:
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    name = pynvml.nvmlDeviceGetName(h)
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                    try:
                        util = float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
                    except Exception:
                        util = None
                    uuid = next((u for u, j in self.uuid_to_index.items() if j == i), None)
                    out.append(DeviceInfo(i, name.decode() if isinstance(name, bytes) else name,
                                          int(mem.total), int(mem.used), util, False, uuid=uuid))
                except Exception:
                    out.append(DeviceInfo(i, None, None, None, None, False))  # unknown: the views say so
            return tuple(out)
        return tuple(DeviceInfo(i, "simulated device", self.total_mem if self.simulated else None,
                                None, None,
                                self.simulated) for i in range(self.count))
