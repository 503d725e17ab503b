"""The symbol tables (probetable) against the BPF source, read as text: every
program they name is a function of bpf_programs/hami.bpf.c, every symbol is
listed once, and the per-thread-stream (_ptsz) and versioned twins the
comments promise are there, with the same programs."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from hami_bpf import probetable as pt

ROOT = Path(__file__).resolve().parents[2]
BPF_SOURCE = (ROOT / "bpf_programs" / "hami.bpf.c").read_text()
FUNCTIONS = set(re.findall(r"^int\s+(\w+)\s*\(", BPF_SOURCE, re.M))
TABLES = ("CORE_PROBES", "NVML_PROBES", "LAUNCH_PROBES")


def programs():
    for sym, (entry, ret) in {**pt.CORE_PROBES, **pt.NVML_PROBES}.items():
        yield sym, entry, False
        if ret is not None:
            yield sym, ret, True
    for sym, entry in pt.LAUNCH_PROBES.items():
        yield sym, entry, False


def test_the_bpf_source_was_read():
    assert "uprobe__cuInit" in FUNCTIONS and len(FUNCTIONS) > 20


def test_every_program_named_is_a_function_of_the_bpf_source():
    missing = sorted({p for _s, p, _r in programs()} - FUNCTIONS)
    assert not missing


def test_every_program_the_attacher_names_is_a_function_of_the_bpf_source():
    # The sync programs are named where they are attached.
    text = (ROOT / "hami_bpf" / "probes.py").read_text()
    named = set(re.findall(r'"(u(?:ret)?probe__\w+)"', text))
    assert {"uprobe__sync_enter", "uretprobe__sync_return"} <= named
    assert not sorted(named - FUNCTIONS)


def test_entry_programs_are_uprobes_and_return_programs_uretprobes():
    for sym, prog, ret in programs():
        assert prog.startswith("uretprobe__" if ret else "uprobe__"), (sym, prog)


def test_every_symbol_is_listed_once():
    # A key written twice in a dict literal silently keeps the last: read the source.
    tree = ast.parse(Path(pt.__file__).read_text())
    keys: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and target.id in TABLES + ("SYNC_SYMBOLS",):
                v = node.value
                elts = v.keys if isinstance(v, ast.Dict) else v.elts
                keys += [k.value for k in elts]
    assert len(keys) == len(pt.CORE_PROBES) + len(pt.NVML_PROBES) + len(pt.LAUNCH_PROBES) \
        + len(pt.SYNC_SYMBOLS)
    dup = sorted({k for k in keys if keys.count(k) > 1})
    assert not dup


def test_launch_and_sync_symbols_are_no_core_symbols():
    core = set(pt.CORE_PROBES) | set(pt.NVML_PROBES)
    assert not core & set(pt.LAUNCH_PROBES)
    assert not core & set(pt.SYNC_SYMBOLS)
    assert not set(pt.LAUNCH_PROBES) & set(pt.SYNC_SYMBOLS)
    assert pt.LAUNCH_SYMBOLS == tuple(pt.LAUNCH_PROBES)


def test_the_sync_symbols_include_their_ptsz_and_v2_variants():
    s = set(pt.SYNC_SYMBOLS)
    assert {"cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize",
            "cuCtxSynchronize_v2", "cuEventSynchronize"} <= s


def test_every_launch_entry_has_its_ptsz_twin_on_the_same_program():
    base = [s for s in pt.LAUNCH_PROBES if not s.endswith("_ptsz")]
    assert {"cuLaunchKernel", "cuLaunchCooperativeKernel", "cuLaunchKernelEx",
            "cuGraphLaunch"} <= set(base)
    for sym in base:
        assert pt.LAUNCH_PROBES.get(sym + "_ptsz") == pt.LAUNCH_PROBES[sym], sym


def test_ptsz_twins_of_core_symbols_share_their_programs():
    twins = [s for s in pt.CORE_PROBES if s.endswith("_ptsz")]
    assert {"cuMemAllocAsync_ptsz", "cuMemAllocFromPoolAsync_ptsz", "cuMemFreeAsync_ptsz"} <= set(twins)
    for sym in twins:
        assert pt.CORE_PROBES[sym] == pt.CORE_PROBES[sym[:-len("_ptsz")]], sym


def test_alloc_symbols_are_exactly_the_admitting_entries_with_the_alloc_return():
    assert set(pt.ALLOC_SYMBOLS) == {
        "cuMemAlloc_v2", "cuMemAllocManaged", "cuMemAllocAsync", "cuMemAllocAsync_ptsz",
        "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", "cuMemAllocPitch_v2",
        "cuMemCreate", "cuArrayCreate_v2", "cuArray3DCreate_v2", "cuMipmappedArrayCreate"}
    for sym in pt.ALLOC_SYMBOLS:
        assert pt.CORE_PROBES[sym][1] == "uretprobe__alloc_return", sym


def test_nvml_handles_have_both_versions_and_memory_queries_are_virtualized():
    assert pt.NVML_PROBES["nvmlDeviceGetHandleByIndex"] == \
        pt.NVML_PROBES["nvmlDeviceGetHandleByIndex_v2"]
    for sym in ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2"):
        assert pt.NVML_PROBES[sym][1] == "uretprobe__meminfo_return"
    for sym in ("cuMemGetInfo_v2", "cuDeviceTotalMem_v2"):
        assert pt.CORE_PROBES[sym][1] == "uretprobe__meminfo_return"
