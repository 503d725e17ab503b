"""hami_bpf.libcuda: finding the driver and reading its ELF symbols."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from hami_bpf.fakecuda import ENTRY_SYMBOLS
from hami_bpf.libcuda import (
    LibcudaError,
    cuda_symbols,
    file_offset,
    find_libcuda,
    read_entry_bytes,
    read_symbols,
    symbol_file_offsets,
    validate_libcuda,
)


def _nm_functions(path) -> dict[str, int]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                         text=True, check=True).stdout
    result = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in ("T", "W", "i"):
            result[parts[2].split("@")[0]] = int(parts[0], 16)
    return result


def test_read_symbols_matches_nm(fakecuda):
    syms = read_symbols(fakecuda.libcuda)
    assert set(ENTRY_SYMBOLS) <= set(syms)
    nm = {k: v for k, v in _nm_functions(fakecuda.libcuda).items()}
    assert {k: syms[k] for k in nm} == nm
    assert not any(k in syms for k in ("do_alloc", "malloc", "pthread_mutex_lock"))
    assert set(cuda_symbols(fakecuda.libcuda)) == {k for k in syms if k.startswith("cu")}


def test_file_offsets_point_at_entry_bytes(fakecuda):
    syms = read_symbols(fakecuda.libcuda)
    offs = symbol_file_offsets(fakecuda.libcuda)
    data = fakecuda.libcuda.read_bytes()
    for name in ("cuMemAlloc_v2", "cuMemGetInfo_v2", "cuLaunchKernel", "cuMemCreate"):
        off = file_offset(fakecuda.libcuda, syms[name])
        assert off == offs[name]
        assert data[off] == 0x55
        assert read_entry_bytes(fakecuda.libcuda, name, 4) == data[off:off + 4]
    assert symbol_file_offsets(fakecuda.libcuda, ["cuInit", "nope"]).keys() == {"cuInit"}
    with pytest.raises(LibcudaError, match="no loadable segment"):
        file_offset(fakecuda.libcuda, 1 << 60)


def test_validate_accepts_stand_in(fakecuda):
    cu = validate_libcuda(fakecuda.libcuda)
    assert "cuMemAlloc_v2" in cu and "fakecuda_launch_count" not in cu


@pytest.mark.parametrize("content,message", [
    (b"root:x:0:0:root:/root:/bin/bash\n", "not an ELF file"),
    (b"", "not an ELF file"),
    (b"\x7fELF\x02\x01", "truncated ELF header"),
    (b"\x7fELF\x01\x01\x01" + b"\0" * 60, "not a 64-bit little-endian ELF file"),
])
def test_validate_rejects_non_elf(tmp_path, content, message):
    p = tmp_path / "libcuda.so.1"
    p.write_bytes(content)
    with pytest.raises(LibcudaError) as e:
        validate_libcuda(p)
    assert str(e.value) == f"--libcuda {p}: {message}"
    assert isinstance(e.value, ValueError)


def test_validate_messages_are_one_line(tmp_path):
    with pytest.raises(LibcudaError, match=r"^--libcuda /etc/passwd: not an ELF file$"):
        validate_libcuda("/etc/passwd")
    with pytest.raises(LibcudaError, match="no such file"):
        validate_libcuda(tmp_path / "missing.so")
    with pytest.raises(LibcudaError, match="is a directory"):
        validate_libcuda(tmp_path)


def test_validate_rejects_elf_without_cuda(tmp_path):
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("needs gcc")
    src = tmp_path / "x.c"
    src.write_text("int cuserid_like(void) { return 0; }\nint other(void) { return 1; }\n")
    lib = tmp_path / "libx.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(LibcudaError, match="exports no cuInit"):
        validate_libcuda(lib)
    src.write_text("int other(void) { return 1; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(LibcudaError, match=r"exports no cu\* functions"):
        validate_libcuda(lib)


def test_find_libcuda_explicit_dedupes_by_inode(fakecuda, tmp_path):
    link = tmp_path / "libcuda.so.1"
    link.symlink_to(fakecuda.libcuda)
    hard = tmp_path / "hard.so"
    os.link(fakecuda.libcuda, hard)
    found = find_libcuda([str(link), str(fakecuda.lib_dir / "libcuda.so"), str(hard)])
    assert found == [fakecuda.libcuda.resolve()]
    with pytest.raises(LibcudaError, match="no such file"):
        find_libcuda([str(tmp_path / "nope.so")])


def test_find_libcuda_search_returns_existing_files():
    for p in find_libcuda(None):
        assert p.is_file() and p == p.resolve()
