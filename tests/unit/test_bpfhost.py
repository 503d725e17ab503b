"""The kernel-side preparations that need no root or BPF (bpfhost): the kept
maps' layout fingerprint, the pin directory's checks and what it says about
adoption, and whether the open gate's tracepoints exist. The bpf filesystem
and root's ownership are faked (procfs.mounts, os.lstat)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from hami_bpf import abi, bpfhost, procfs

FP = "abi1-000000000000"


class Owned:
    """A stat result with another owner."""

    def __init__(self, st, uid):
        self._st, self.st_uid = st, uid

    def __getattr__(self, name):
        return getattr(self._st, name)


@pytest.fixture
def bpffs(tmp_path, monkeypatch):
    """tmp_path/bpf is a bpf filesystem whose directories root owns
    (``bpffs.owner["uid"]``: who owns them instead)."""
    root = tmp_path / "bpf"
    root.mkdir()
    monkeypatch.setattr(procfs, "mounts", lambda proc=None: [("/", "ext4"),
                                                            (os.path.realpath(root), "bpf")])
    owner = {"uid": 0}
    real = os.lstat
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: Owned(real(p, *a, **k), owner["uid"]))
    return SimpleNamespace(path=root, owner=owner)


def test_the_fingerprint_names_the_abi_and_changes_with_the_layout():
    fp = bpfhost.layout_fingerprint(4096)
    assert fp.startswith(f"abi{abi.ABI_VERSION}-") and len(fp.split("-")[1]) == 12
    assert bpfhost.layout_fingerprint(4096) == fp
    assert bpfhost.layout_fingerprint(8192) != fp


def test_the_fingerprint_covers_every_kept_maps_structures(monkeypatch):
    fp = bpfhost.layout_fingerprint(4096)
    maps = dict(bpfhost.KEPT_MAPS)
    maps["procs"] = ("u32", "ProcCfg")
    monkeypatch.setattr(bpfhost, "KEPT_MAPS", maps)
    assert bpfhost.layout_fingerprint(4096) != fp
    for _m, (k, v) in bpfhost.KEPT_MAPS.items():
        for t in (k, v):
            assert t in ("u32", "u64", "s32") or hasattr(abi, t), t


@pytest.mark.parametrize("bad", ["relative/dir", "/sys/fs/bpf/with space", '/sys/fs/bpf/q"uote',
                                 "/sys/fs/bpf/back\\slash"])
def test_a_pin_dir_that_is_not_a_plain_absolute_path_is_refused(bad):
    with pytest.raises(bpfhost.PinRefused):
        bpfhost.prepare_pin_dir(bad, FP, False)


def test_a_pin_dir_off_a_bpf_filesystem_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(procfs, "mounts", lambda proc=None: [("/", "ext4")])
    with pytest.raises(bpfhost.ProbeError, match="not on a bpf filesystem"):
        bpfhost.prepare_pin_dir(str(tmp_path / "pins"), FP, False)
    assert not (tmp_path / "pins").exists()


def test_a_new_pin_dir_holds_nothing_to_adopt_and_a_used_one_does(bpffs):
    pin = str(bpffs.path / "hami")
    here, adopting = bpfhost.prepare_pin_dir(pin, FP, False)
    assert here == os.path.join(pin, FP) and os.path.isdir(here) and adopting is False
    assert bpfhost.prepare_pin_dir(pin, FP, False) == (here, False)    # empty: still nothing
    open(os.path.join(here, "procs"), "w").close()
    assert bpfhost.prepare_pin_dir(pin, FP, False) == (here, True)
    assert bpfhost.prepare_pin_dir(pin, FP, True) == (here, False)     # --fresh discards ours
    assert os.listdir(here) == []


def test_another_layouts_state_is_refused_unless_fresh(bpffs):
    pin = bpffs.path / "hami"
    (pin / "abi0-aaaaaaaaaaaa").mkdir(parents=True)
    (pin / "abi0-aaaaaaaaaaaa" / "procs").touch()
    with pytest.raises(bpfhost.PinRefused, match="abi0-aaaaaaaaaaaa"):
        bpfhost.prepare_pin_dir(str(pin), FP, False)
    here, adopting = bpfhost.prepare_pin_dir(str(pin), FP, True)
    assert os.listdir(pin) == [FP] and adopting is False


def test_a_pin_dir_others_could_write_is_refused(bpffs):
    pin = bpffs.path / "hami"
    pin.mkdir()
    os.chmod(pin, 0o777)
    with pytest.raises(bpfhost.PinRefused):
        bpfhost.prepare_pin_dir(str(pin), FP, False)
    os.chmod(pin, 0o700)
    bpffs.owner["uid"] = 1000
    with pytest.raises(bpfhost.PinRefused):
        bpfhost.prepare_pin_dir(str(pin), FP, False)
    assert not (pin / FP).exists()


def test_a_pin_dir_that_is_a_link_is_refused(bpffs, tmp_path):
    target = bpffs.path / "real"
    target.mkdir()
    (bpffs.path / "hami").symlink_to(target)
    with pytest.raises(bpfhost.PinRefused):
        bpfhost.prepare_pin_dir(str(bpffs.path / "hami"), FP, False)


def test_the_open_gate_needs_every_syscall_tracepoint(tmp_path):
    for tp in bpfhost.OPEN_TRACEPOINTS:
        (tmp_path / "events" / tp).mkdir(parents=True)
    assert bpfhost.open_gate_missing(str(tmp_path)) is None
    last = bpfhost.OPEN_TRACEPOINTS[-1]
    (tmp_path / "events" / last).rmdir()
    why = bpfhost.open_gate_missing(str(tmp_path))
    assert why is not None and last in why


def test_features_as_a_dict_copy_their_errors():
    f = bpfhost.Features(True, False, True, False, True, {"send_signal": "EPERM"})
    d = f.as_dict()
    assert d == {"ringbuf": True, "send_signal": False, "probe_write_user": True,
                 "reg_write": False, "atomics": True, "errors": {"send_signal": "EPERM"}}
    d["errors"]["x"] = "y"
    assert f.errors == {"send_signal": "EPERM"}
