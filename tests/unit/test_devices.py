"""Devices: each process's device memory, from the stand-in driver's table; NVML's
per-process utilization, read at most once per period."""
import os
import struct
import sys
from types import SimpleNamespace

import pytest

from hami_bpf import doctor
from hami_bpf.devices import PROCESS_UTIL_READ_S, PROCESS_UTIL_READS_PER_S, Devices, Fallback
from hami_bpf.fakecuda.sim import PM_DEVS, PM_SLOTS

SLOT = struct.Struct(f"<II{PM_DEVS}Q")


def table(tmp_path, rows):
    path = tmp_path / "procmem"
    buf = bytearray(PM_SLOTS * SLOT.size)
    for i, (pid, used) in enumerate(rows):
        SLOT.pack_into(buf, i * SLOT.size, pid, 0, *(used + [0] * (PM_DEVS - len(used))))
    path.write_bytes(bytes(buf))
    return str(path)


def test_the_stand_in_table_gives_each_live_process_its_memory(tmp_path):
    dead = 4194303      # above any pid_max default: no such process
    path = table(tmp_path, [(os.getpid(), [5 << 20, 0, 7]), (dead, [1 << 30])])
    d = Devices.discover(True, Fallback(proc_mem=path))
    if d.nvml:
        pytest.skip("NVML answers here: the stand-in's table is not read")
    assert d.has_process_memory
    assert d.process_memory(0) == {os.getpid(): 5 << 20}
    assert d.process_memory(1) == {}          # nothing held there
    assert d.process_memory(2) == {os.getpid(): 7}


class FakeNvml:
    """pynvml's per-process utilization, counting the calls."""

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(value)
            self.value = value

    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_NOT_SUPPORTED = 3

    def __init__(self, util=None, error=None):
        self.calls, self.util, self.error = 0, util or {}, error

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlDeviceGetProcessUtilization(self, handle, since):
        self.calls += 1
        if self.error is not None:
            raise self.NVMLError(self.error)
        return [SimpleNamespace(pid=pid, smUtil=u) for pid, u in self.util.items()]


def nvml_devices(monkeypatch, fake):
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    now = [100.0]
    d = Devices(2, False, nvml=True, clock=lambda: now[0])
    return d, now


def test_per_process_utilization_is_read_at_most_once_per_period_per_device(monkeypatch):
    fake = FakeNvml({41: 30.0, 42: 12.0})
    d, now = nvml_devices(monkeypatch, fake)
    assert d.process_utilization(0) == {41: 30.0, 42: 12.0}
    for _ in range(20):                 # a controller ticking at 200 Hz
        now[0] += 0.005
        assert d.process_utilization(0) == {41: 30.0, 42: 12.0}
    assert fake.calls == 1
    d.process_utilization(1)            # another device: its own reading
    assert fake.calls == 2
    fake.util = {41: 55.0}
    now[0] += 1.5 * PROCESS_UTIL_READ_S
    assert d.process_utilization(0) == {41: 55.0}
    assert fake.calls == 3


def test_a_node_of_many_gpus_shares_one_read_budget_stalest_first(monkeypatch):
    fake = FakeNvml({41: 30.0})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    now = [100.0]
    d = Devices(8, False, nvml=True, clock=lambda: now[0])
    read_at = {}
    seconds, tick = 4.0, 0.005
    for _ in range(int(seconds / tick)):     # every device asked at every tick, at 200 Hz
        for dev in range(8):
            before = fake.calls
            assert d.process_utilization(dev) == {41: 30.0}
            if fake.calls != before:
                read_at.setdefault(dev, []).append(now[0])
        now[0] += tick
    # each device's first reading at once, then the node's budget
    assert fake.calls <= 8 + PROCESS_UTIL_READS_PER_S * seconds + 1
    # and no device starves: each is read again within its turn of the budget
    # (each read of the node at most a tick past its due time)
    turn = 8 * (1 / PROCESS_UTIL_READS_PER_S + tick)
    for dev in range(8):
        gaps = [b - a for a, b in zip(read_at[dev], read_at[dev][1:])]
        assert len(read_at[dev]) >= seconds / turn - 1
        assert gaps[0] <= PROCESS_UTIL_READ_S + turn, (dev, gaps)   # the first round
        assert max(gaps[1:]) <= turn + 1e-6, (dev, gaps)


def test_an_idle_device_reads_none_and_is_asked_again_later(monkeypatch):
    fake = FakeNvml(error=FakeNvml.NVML_ERROR_NOT_FOUND)
    d, now = nvml_devices(monkeypatch, fake)
    assert d.process_utilization(0) is None
    now[0] += 1.5 * PROCESS_UTIL_READ_S
    fake.error, fake.util = None, {7: 20.0}
    assert d.process_utilization(0) == {7: 20.0}


def test_a_host_without_per_process_utilization_is_asked_once(monkeypatch):
    fake = FakeNvml(error=FakeNvml.NVML_ERROR_NOT_SUPPORTED)
    d, now = nvml_devices(monkeypatch, fake)
    for _ in range(5):
        assert d.process_utilization(0) is None
        now[0] += 1.0
    assert fake.calls == 1


@pytest.mark.parametrize("error, per_process", [
    (None, True),                                   # a sample
    (FakeNvml.NVML_ERROR_NOT_FOUND, True),          # none yet: reported, idle
    (FakeNvml.NVML_ERROR_NOT_SUPPORTED, False),     # a virtual machine's driver
])
def test_the_guards_utilization_source_is_probed_at_start(monkeypatch, error, per_process):
    fake = FakeNvml({41: 30.0}, error=error)
    d, _now = nvml_devices(monkeypatch, fake)
    source = d.utilization_source()
    assert source.startswith("per process" if per_process else "device")
    calls = fake.calls
    d.process_utilization(0)
    # Where it is not reported, it is not asked again at every tick.
    assert fake.calls == calls + (1 if per_process else 0)


def test_the_utilization_source_without_nvml_or_with_the_simulated_gpu():
    assert Devices(2, False).utilization_source().startswith("none")
    assert Devices(2, True, sim=object()).utilization_source() == "simulated device"


@pytest.mark.parametrize("error, per_process", [
    (None, True), (FakeNvml.NVML_ERROR_NOT_SUPPORTED, False)])
def test_doctor_says_whether_nvml_reports_per_process_utilization(monkeypatch, error,
                                                                  per_process):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml({41: 30.0}, error=error))
    check = doctor.check_nvml()
    assert check["ok"]
    assert check["value"] == {"devices": 1, "driver": "580.159.04",
                              "process_utilization": per_process}
