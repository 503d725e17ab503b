"""A policy file is accepted only where root alone can replace it: the file
and every directory above it (config.unsafe_chain, policyfile.read_policy)."""
from __future__ import annotations

import os

import pytest

from hami_bpf.config import DaemonConfig, unsafe_chain
from hami_bpf.daemon import Daemon, DaemonError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")

POLICY = '[default]\nmemory = "1Gi"\n'


@pytest.fixture
def safe(tmp_path):
    """A directory whose whole chain only root can write (tests/conftest.py)."""
    assert unsafe_chain(str(tmp_path / "x")) is None, unsafe_chain(str(tmp_path / "x"))
    return tmp_path


def write(path, text=POLICY, mode=0o600):
    path.write_text(text)
    os.chown(path, 0, 0)
    os.chmod(path, mode)
    return path


def load(path):
    d = Daemon(DaemonConfig(policy=str(path)))
    d.policy.load()
    return d.policy.current


def refused(path) -> str:
    with pytest.raises(DaemonError) as e:
        load(path)
    return str(e.value)


def test_a_safe_chain_is_accepted(safe):
    assert load(write(safe / "p.toml")).default.memory == 1 << 30


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775, 0o757])
def test_a_writable_directory_is_refused_and_named(safe, mode):
    d = safe / "open"
    d.mkdir()
    os.chmod(d, mode)
    p = write(d / "p.toml")
    msg = refused(p)
    assert str(d) in msg and f"{mode:o}" in msg


def test_a_directory_owned_by_someone_else_is_refused(safe):
    d = safe / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, 65534, 65534)
    msg = refused(write(d / "p.toml"))
    assert str(d) in msg and "65534" in msg


def test_a_writable_directory_higher_up_is_refused(safe):
    top = safe / "top"
    (top / "mid").mkdir(parents=True)
    os.chmod(top, 0o777)
    msg = refused(write(top / "mid" / "p.toml"))
    assert str(top) in msg and str(top / "mid") not in msg.split(":")[1]


def test_a_link_into_a_writable_directory_is_refused(safe):
    open_dir = safe / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o1777)
    target = write(open_dir / "p.toml")
    link = safe / "p.toml"
    link.symlink_to(target)
    assert str(open_dir) in refused(link)
    dlink = safe / "dirlink"
    dlink.symlink_to(open_dir)
    assert str(open_dir) in refused(dlink / "p.toml")


def test_a_link_within_a_safe_chain_is_followed(safe):
    (safe / "data").mkdir(mode=0o755)
    target = write(safe / "data" / "p.toml")
    (safe / "p.toml").symlink_to(target)
    assert load(safe / "p.toml").default.memory == 1 << 30


def test_the_file_itself_is_still_checked(safe):
    assert "666" in refused(write(safe / "ww.toml", mode=0o666))
    p = write(safe / "nobody.toml")
    os.chown(p, 65534, 0)
    assert "65534" in refused(p)
