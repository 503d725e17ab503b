"""The shape of the controller: a small composition root, modules of a
readable size, and /proc read in one place."""
import re
import signal
from pathlib import Path

from hami_bpf import signals

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hami_bpf"
MODULE_MAX = 700


def test_the_composition_root_stays_small():
    assert len((PKG / "daemon.py").read_text().splitlines()) < 300


def test_no_module_is_over_the_limit():
    big = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MODULE_MAX}
    assert big == {}, big


def test_test_modules_have_unique_names():
    # pytest imports test modules by their bare names (the tests import
    # each other's helpers so): two of one name stop `make test`, which
    # collects every directory at once, at collection.
    names: dict[str, list[str]] = {}
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        names.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in names.items() if len(ps) > 1} == {}


def test_only_procfs_names_proc_paths():
    pattern = re.compile(r'''["']/proc/|f["']/proc|open\(["']/proc''')
    hits = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in sorted(PKG.rglob("*.py"))
            if p.name != "procfs.py" for line in p.read_text().splitlines()
            if pattern.search(line) and not line.strip().startswith("#")]
    assert hits == []


def test_exit_status_after_each_signal():
    assert signals.exit_status(None) == (0, "stopped")
    assert signals.exit_status(signal.SIGTERM) == (0, "stopped")
    assert signals.exit_status(signal.SIGINT) == (0, "stopped")
    assert signals.exit_status(signal.SIGUSR1) == (128 + signal.SIGUSR1, "stopped (SIGUSR1)")
    rt = signal.SIGRTMIN + 1
    assert signals.exit_status(rt)[0] == 128 + rt
    assert signal.SIGHUP not in signals.FATAL_SIGNALS     # SIGHUP reloads the policy
    assert signal.SIGKILL not in signals.FATAL_SIGNALS
