"""Find the CUDA driver library and read its exported entry points.

bcc resolves uprobe offsets itself; this module exists so that the CLI can
say clearly what it will probe, and so that enforcement can read the entry
bytes of a function from the file (in memory, the first byte of a probed
entry is the breakpoint).  The ELF parsing is done here with ``struct`` (only
ELF64 little-endian, i.e. x86-64 and aarch64 builds of the driver).
"""
from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path
from typing import Iterable

__all__ = [
    "LibcudaError",
    "SEARCH_DIRS",
    "cuda_symbols",
    "file_offset",
    "find_libcuda",
    "read_entry_bytes",
    "read_symbols",
    "symbol_file_offsets",
    "validate_libcuda",
]

SEARCH_DIRS: tuple[str, ...] = (
    "/usr/local/nvidia/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/local/cuda/compat",
)
LIB_NAMES = ("libcuda.so.1", "libcuda.so")


class LibcudaError(ValueError):
    """A one-line, user-facing reason why a path is not a usable libcuda."""


# -- finding -------------------------------------------------------------------
def _ldconfig_paths() -> list[Path]:
    for exe in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([exe, "-p"], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        paths = []
        for line in out.splitlines():
            line = line.strip()
            if line.startswith("libcuda.so.1 ") and "=>" in line:
                paths.append(Path(line.split("=>", 1)[1].strip()))
        return paths
    return []


def _dedupe(paths: Iterable[Path]) -> list[Path]:
    seen: set[tuple[int, int]] = set()
    result: list[Path] = []
    for p in paths:
        try:
            real = p.resolve(strict=True)
            st = real.stat()
        except (OSError, RuntimeError):
            continue
        if not real.is_file():
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            continue
        seen.add(key)
        result.append(real)
    return result


def find_libcuda(explicit: list[str] | None = None) -> list[Path]:
    """Candidate driver libraries, symlinks resolved, de-duplicated by inode.

    Explicit paths (``--libcuda``) are returned alone, in order; one that does
    not exist raises LibcudaError.  Otherwise: ``ldconfig -p`` entries for
    libcuda.so.1, then libcuda.so.1/libcuda.so in SEARCH_DIRS.  May be empty.
    """
    if explicit:
        for e in explicit:
            p = Path(e)
            if not p.exists():
                raise LibcudaError(f"--libcuda {e}: no such file")
            if p.is_dir():
                raise LibcudaError(f"--libcuda {e}: is a directory, not a library file")
        return _dedupe(Path(e) for e in explicit)
    candidates = list(_ldconfig_paths())
    for d in SEARCH_DIRS:
        for name in LIB_NAMES:
            candidates.append(Path(d) / name)
    return _dedupe(candidates)


# -- ELF -------------------------------------------------------------------------
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")   # Elf64_Ehdr
_SHDR = struct.Struct("<IIQQQQIIQQ")          # Elf64_Shdr
_PHDR = struct.Struct("<IIQQQQQQ")            # Elf64_Phdr
_SYM = struct.Struct("<IBBHQQ")               # Elf64_Sym
SHT_DYNSYM = 11
PT_LOAD = 1
STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_GLOBAL = 1
STB_WEAK = 2
SHN_UNDEF = 0


class _Elf:
    def __init__(self, path: str | os.PathLike, label: str | None = None):
        self.path = Path(path)
        self.label = label or str(path)
        try:
            self.f = open(self.path, "rb")
        except FileNotFoundError:
            raise LibcudaError(f"{self.label}: no such file") from None
        except IsADirectoryError:
            raise LibcudaError(f"{self.label}: is a directory, not a library file") from None
        except OSError as e:
            raise LibcudaError(f"{self.label}: cannot read ({e.strerror})") from None
        try:
            head = self.f.read(_EHDR.size)
            if len(head) < 4 or head[:4] != b"\x7fELF":
                raise LibcudaError(f"{self.label}: not an ELF file")
            if len(head) < _EHDR.size:
                raise LibcudaError(f"{self.label}: truncated ELF header")
            if head[4] != 2 or head[5] != 1:
                raise LibcudaError(f"{self.label}: not a 64-bit little-endian ELF file")
            (_, self.e_type, self.e_machine, _, _, self.e_phoff, self.e_shoff, _, _,
             self.e_phentsize, self.e_phnum, self.e_shentsize, self.e_shnum,
             self.e_shstrndx) = _EHDR.unpack(head)
            self.size = os.fstat(self.f.fileno()).st_size
        except BaseException:
            self.f.close()
            raise

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> "_Elf":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, off: int, n: int) -> bytes:
        if off < 0 or off + n > self.size:
            raise LibcudaError(f"{self.label}: truncated or corrupt ELF file")
        self.f.seek(off)
        return self.f.read(n)

    def sections(self) -> list[tuple]:
        if self.e_shoff == 0 or self.e_shnum == 0:
            return []
        if self.e_shentsize != _SHDR.size:
            raise LibcudaError(f"{self.label}: unexpected ELF section header size")
        data = self.read(self.e_shoff, self.e_shnum * _SHDR.size)
        return [_SHDR.unpack_from(data, i * _SHDR.size) for i in range(self.e_shnum)]

    def segments(self) -> list[tuple]:
        if self.e_phoff == 0 or self.e_phnum == 0:
            return []
        if self.e_phentsize != _PHDR.size:
            raise LibcudaError(f"{self.label}: unexpected ELF program header size")
        data = self.read(self.e_phoff, self.e_phnum * _PHDR.size)
        return [_PHDR.unpack_from(data, i * _PHDR.size) for i in range(self.e_phnum)]

    def dynamic_functions(self) -> dict[str, int]:
        secs = self.sections()
        result: dict[str, int] = {}
        for sh in secs:
            sh_type, sh_offset, sh_size, sh_link, sh_entsize = sh[1], sh[4], sh[5], sh[6], sh[9]
            if sh_type != SHT_DYNSYM:
                continue
            if sh_link >= len(secs):
                raise LibcudaError(f"{self.label}: corrupt .dynsym (bad string table link)")
            strtab = secs[sh_link]
            strs = self.read(strtab[4], strtab[5])
            entsize = sh_entsize or _SYM.size
            syms = self.read(sh_offset, sh_size)
            for i in range(sh_size // entsize):
                st_name, st_info, _other, st_shndx, st_value, _size = _SYM.unpack_from(
                    syms, i * entsize)
                if st_shndx == SHN_UNDEF or st_value == 0:
                    continue
                if (st_info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC):
                    continue
                if (st_info >> 4) not in (STB_GLOBAL, STB_WEAK):
                    continue
                end = strs.find(b"\0", st_name)
                name = strs[st_name:end if end >= 0 else None].decode("ascii", "replace")
                if name:
                    result.setdefault(name, st_value)
        return result


def read_symbols(path: str | os.PathLike) -> dict[str, int]:
    """Exported, defined FUNC symbols of an ELF shared object -> st_value
    (the virtual address of the entry, relative to the load base)."""
    with _Elf(path) as elf:
        return elf.dynamic_functions()


def cuda_symbols(path: str | os.PathLike) -> dict[str, int]:
    """read_symbols() restricted to CUDA driver API names (``cu*``)."""
    return {k: v for k, v in read_symbols(path).items() if k.startswith("cu")}


def file_offset(path: str | os.PathLike, vaddr: int) -> int:
    """File offset of virtual address ``vaddr`` through the PT_LOAD headers."""
    with _Elf(path) as elf:
        for p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz, _memsz, _align in elf.segments():
            if p_type == PT_LOAD and p_vaddr <= vaddr < p_vaddr + p_filesz:
                return vaddr - p_vaddr + p_offset
    raise LibcudaError(f"{path}: address {vaddr:#x} is in no loadable segment")


def symbol_file_offsets(path: str | os.PathLike,
                        names: Iterable[str] | None = None) -> dict[str, int]:
    """Entry file offsets of exported functions (all, or those in ``names``
    that exist).  The uprobe offset and the /proc/PID/maps arithmetic use it."""
    with _Elf(path) as elf:
        syms = elf.dynamic_functions()
        loads = [(s[3], s[5], s[2]) for s in elf.segments() if s[0] == PT_LOAD]
    wanted = syms if names is None else {n: syms[n] for n in names if n in syms}
    result = {}
    for name, vaddr in wanted.items():
        for p_vaddr, p_filesz, p_offset in loads:
            if p_vaddr <= vaddr < p_vaddr + p_filesz:
                result[name] = vaddr - p_vaddr + p_offset
                break
    return result


def read_entry_bytes(path: str | os.PathLike, name: str, n: int = 16) -> bytes:
    """The first ``n`` bytes of exported function ``name``, read from the file."""
    offs = symbol_file_offsets(path, [name])
    if name not in offs:
        raise LibcudaError(f"{path}: no exported function {name}")
    with open(path, "rb") as f:
        f.seek(offs[name])
        return f.read(n)


def validate_libcuda(path: str | os.PathLike, label: str = "--libcuda") -> dict[str, int]:
    """Check that ``path`` is an ELF shared object exporting ``cu*`` functions,
    cuInit among them.

    Returns those symbols (name -> vaddr).  Raises LibcudaError with a one-line
    message such as ``--libcuda /etc/passwd: not an ELF file``.
    """
    shown = f"{label} {path}" if label else str(path)
    with _Elf(path, shown) as elf:
        syms = elf.dynamic_functions()
    cu = {k: v for k, v in syms.items() if k.startswith("cu")}
    if not cu:
        raise LibcudaError(f"{shown}: exports no cu* functions (not a CUDA driver library)")
    if "cuInit" not in cu:  # libc, for one, exports `cuserid`
        raise LibcudaError(f"{shown}: exports no cuInit (not a CUDA driver library)")
    return cu
