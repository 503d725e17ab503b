"""Devices: each process's device memory, from the stand-in driver's table."""
import os
import struct

import pytest

from hami_bpf.devices import Devices, Fallback
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
