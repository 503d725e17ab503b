"""hami_bpf/abi.py's constants against bpf_programs/hami.h's defines.

Reads the header as text (no compiler needed). Every define is either
mirrored in abi.py with the same value or listed as used only by the BPF
programs, so a new name cannot be added to one side alone.
"""
import re
import signal
from pathlib import Path

from hami_bpf import abi

# This checkout's header (abi.bpf_dir() may resolve to an installed copy).
HEADER = Path(__file__).resolve().parents[2] / "bpf_programs" / "hami.h"

# Defines only the BPF programs use: not mirrored in abi.py.
BPF_ONLY = {
    "X86_RET", "RET_SCAN_CHUNK", "RET_SCAN_CHUNKS", "CHECKPOINT_NS", "MEMPROP_LOCATION_ID",
    "LIBNAME_LEN", "PATH_SCAN", "PROT_EXEC",
    "CTXOP_SET", "CTXOP_PUSH", "CTXOP_POP", "CTXOP_DESTROY",
    "FN_ALLOC", "FN_PITCH", "FN_CREATE", "FN_CTXRETAIN", "FN_CTXCREATE", "FN_MEMINFO",
    "FN_TOTALMEM", "FN_CTXPOP", "FN_NVMLHANDLE", "FN_NVMLMEM", "FN_ARRAY",
    "ARRAY_WIDTH", "ARRAY_HEIGHT", "ARRAY_FORMAT", "ARRAY_CHANNELS", "ARRAY3D_DEPTH",
    "ARRAY3D_FORMAT", "ARRAY3D_CHANNELS", "ARRAY3D_FLAGS", "ARRAY_ELEM_MAX", "ARRAY3D_LAYERED",
    "ARRAY3D_CUBEMAP", "MIPMAP_LEVELS_MAX", "AD_UNSIGNED_INT8", "AD_UNSIGNED_INT16",
    "AD_UNSIGNED_INT32", "AD_SIGNED_INT8", "AD_SIGNED_INT16", "AD_SIGNED_INT32", "AD_HALF",
    "AD_FLOAT",
}


def _defines() -> dict[str, int]:
    text = HEADER.read_text()
    found = dict(re.findall(r"#define HAMI_(\w+)\s+(\(?[0-9xXa-fA-FuUL <]+\)?)", text))

    def value(expr: str) -> int:
        return int(eval(re.sub(r"(?<=[0-9a-fA-F])[uUlL]+", "", expr)))  # noqa: S307 - our header

    return {name: value(expr) for name, expr in found.items()}


def test_constants_match_header():
    defines = _defines()
    mirrored = {n: v for n, v in defines.items() if n not in BPF_ONLY}
    assert len(mirrored) >= 40
    assert sorted(n for n in mirrored if not hasattr(abi, n)) == []
    assert {n: getattr(abi, n) for n in mirrored} == mirrored


def test_bpf_only_names_exist():
    assert sorted(BPF_ONLY - set(_defines())) == []


def test_event_kinds_are_distinct():
    kinds = {n: v for n, v in vars(abi).items() if n.startswith("EV_")}
    assert len(set(kinds.values())) == len(kinds)


def test_signal_numbers_match_the_host():
    assert (abi.SIGKILL, abi.SIGSTOP) == (signal.SIGKILL, signal.SIGSTOP)


def test_every_uprobe_program_keeps_off_the_private_stack():
    """A uprobe program runs preemptible; from 6.13 the kernel would give one
    with 64 bytes of stack or more a per-CPU stack that another task on the
    same CPU overwrites. The tail call each one begins with rules that out
    (maps.h, no_priv_stack)."""
    src = (HEADER.parent / "hami.bpf.c").read_text()
    bodies = re.findall(r"^int (u(?:ret)?probe__\w+)\(struct pt_regs \*ctx\)\n\{\n(.*)\n", src, re.M)
    assert len(bodies) >= 20
    missing = [name for name, first in bodies if first.strip() != "keep_off_private_stack(ctx);"]
    assert not missing
    assert re.search(r"keep_off_private_stack\(struct pt_regs \*ctx\)\n\{\n\s*no_priv_stack\.call\(ctx, 0\);",
                     src)
    assert "BPF_PROG_ARRAY(no_priv_stack, 1);" in (HEADER.parent / "maps.h").read_text()
