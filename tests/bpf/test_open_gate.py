"""Without the open gate (--no-open-gate, as on a kernel without the openat
syscall tracepoints), a container's own libcuda is still found by scanning
/proc and probed; the calls it makes before that are not seen."""
from __future__ import annotations

import pytest

from helpers import Daemon, converge, finish_daemon, gname, wait_for
from test_namespaces import Contained, entry_byte, own_lib  # noqa: F401 - own_lib is a fixture

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def daemon(fakecuda):
    d = Daemon(fakecuda, extra=["--no-open-gate"]).start()
    yield d
    finish_daemon(d)


def attached(d: Daemon, pid: int) -> bool:
    return any(e["kind"] == "probes" and e["what"] == "attached" and e["data"].get("pid") == pid
               for e in d.events())


def test_without_the_gate_a_private_copy_is_found_by_the_scan(daemon, fakecuda, own_lib):  # noqa: F811
    mech = daemon.snapshot()["mechanisms"]["private_libs"]
    assert mech.startswith("found by scanning /proc") and "--no-open-gate" in mech
    with Contained.start(fakecuda, gname("ns"), own_lib=own_lib) as c:
        wait_for(lambda: None if entry_byte(c.pid, f"/proc/{c.pid}/root{fakecuda.libcuda}")
                 == 0xCC else "cuMemAlloc_v2 of the container's libcuda is not probed",
                 5, what="attach to the container's libcuda by the scan")
        # The allocation probe is among the first attached; the daemon reads
        # its events once the library's last probe is on (seconds, on a busy
        # machine), which its "attached" event says.
        wait_for(lambda: None if attached(daemon, c.pid)
                 else "no probes/attached event for the container's process",
                 10, what="the scan's attach to finish", deadlines=daemon.deadlines)
        c.alloc("alloc 2M", 0)
        converge(daemon, [c])
    assert daemon.snapshot()["counters"].get("lib_opens", 0) == 0
