"""hami_bpf/abi.py against bcc's own view of bpf_programs/hami.h.

bcc builds ctypes types for map keys and values from the compiled structs, so
a map per ABI struct in a throwaway program gives the compiler's layout.
"""
import ctypes as ct

import pytest

from hami_bpf import abi

pytestmark = pytest.mark.bpf


def _bcc_layouts():
    from bcc import BPF
    d = abi.bpf_dir()
    maps = "\n".join(f"BPF_ARRAY(m_{name}, struct {name}, 1);" for name in abi.STRUCTS)
    b = BPF(text=f'#include "hami.h"\n{maps}\n', cflags=[f"-I{d}"])
    try:
        return {name: b[f"m_{name}".encode()].Leaf for name in abi.STRUCTS}
    finally:
        b.cleanup()


def _fields(t):
    out = []
    for f in t._fields_:
        name = f[0]
        if name.startswith("__pad"):
            continue
        out.append((name, getattr(t, name).offset, ct.sizeof(f[1])))
    return out


def test_struct_layouts_match_bcc():
    bcc_types = _bcc_layouts()
    for name, mirror in abi.STRUCTS.items():
        theirs = bcc_types[name]
        assert ct.sizeof(mirror) == ct.sizeof(theirs), name
        assert _fields(mirror) == _fields(theirs), name
