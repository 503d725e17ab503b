"""The kernel matrix runs a guest again only when the guest kernel itself
tripped (tests/kernels/run_matrix.py: patching_oops), never for a BPF
program's fault or a failing test."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "run_matrix", Path(__file__).resolve().parents[1] / "kernels" / "run_matrix.py")
run_matrix = importlib.util.module_from_spec(SPEC)
sys.modules.setdefault("run_matrix", run_matrix)    # its dataclasses look themselves up
SPEC.loader.exec_module(run_matrix)

TEXT_POKE = """tests/kernels/test_mechanisms.py::test_oom_mechanism[return-oom] [  300.600019] Oops: int3: 0000 [#1] SMP NOPTI
[  300.622502] CPU: 0 UID: 0 PID: 161 Comm: python Not tainted 7.3.4+deb13-amd64 #1 PREEMPT(lazy)
[  300.623049] Hardware name: QEMU Standard PC (Q35 + ICH9, 2009)
[  300.634065] RIP: 0010:trace_syscall_exit+0xa/0xa0
[  300.666200] Kernel panic - not syncing: Fatal exception in interrupt
"""

IN_A_PROGRAM = """[  120.1] BUG: unable to handle page fault for address: 00007fffff79626c
[  120.2] Oops: 0000 [#1] PREEMPT SMP NOPTI
[  120.3] RIP: 0010:bpf_prog_6deef7357e7b4530_uprobe__cuMemAlloc_v2+0x1c2/0x2e0
"""

INT3_IN_A_PROGRAM = """[  10.0] Oops: int3: 0000 [#1] SMP NOPTI
[  10.1] RIP: 0010:bpf_prog_0123456789abcdef_uprobe__cuInit+0x10/0x80
"""


def test_an_int3_oops_in_kernel_text_is_the_kernels_own():
    why = run_matrix.patching_oops(TEXT_POKE)
    assert "trace_syscall_exit+0xa/0xa0" in why


def test_a_fault_in_a_bpf_program_is_not_retried():
    assert run_matrix.patching_oops(IN_A_PROGRAM) == ""
    assert run_matrix.patching_oops(INT3_IN_A_PROGRAM) == ""


def test_a_clean_console_is_not_retried():
    assert run_matrix.patching_oops("HAMI-GUEST-BOOTED\n5 passed\n") == ""


def _guest(monkeypatch, tmp_path, consoles, boot_failure=""):
    """run_guest over a fake boot whose console logs are `consoles`, in turn."""
    import types
    boots = []

    def boot(k, outdir, *a):
        outdir.mkdir(parents=True, exist_ok=True)
        (outdir / "console.log").write_text(consoles[min(len(boots), len(consoles) - 1)])
        boots.append(outdir)
        return {"boot_failure": boot_failure, "timed_out": False}
    monkeypatch.setattr(run_matrix, "boot", boot)
    monkeypatch.setattr(run_matrix, "kvm_boots", lambda *a: (False, "no kvm"))
    monkeypatch.setattr(run_matrix, "log", lambda m: None)
    monkeypatch.setattr(run_matrix, "_save_row", lambda r: None)
    row = types.SimpleNamespace(outdir=tmp_path / "debian-7", how="", run=None, error=None)
    k = types.SimpleNamespace(spec=types.SimpleNamespace(key="debian-7"), version="7")
    run_matrix.run_guest(row, k, types.SimpleNamespace(timeout=10, no_lockdown_pass=True,
                                                       guest_patch=None))
    return len(boots), sorted(p.name for p in tmp_path.iterdir())


def test_a_guest_that_trips_over_its_text_patching_twice_boots_a_third_time(monkeypatch, tmp_path):
    n, dirs = _guest(monkeypatch, tmp_path, [TEXT_POKE, TEXT_POKE, "clean"])
    assert n == run_matrix.MAX_BOOTS == 3
    assert dirs == ["debian-7", "debian-7.attempt1", "debian-7.attempt2"]


def test_a_bpf_programs_fault_boots_once_and_a_hung_boot_twice(monkeypatch, tmp_path):
    assert _guest(monkeypatch, tmp_path / "a", [IN_A_PROGRAM])[0] == 1
    assert _guest(monkeypatch, tmp_path / "b", ["clean"], boot_failure="no line from guest.sh")[0] == 2
