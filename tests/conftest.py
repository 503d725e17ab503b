"""Shared fixtures and marker handling for hami-bpf's tests.

* ``fakecuda`` (session): the stand-in libcuda and cudaprog, built once into a
  pytest temporary directory.
* ``@pytest.mark.bpf``: needs root, an importable bcc and a mounted tracefs
  (mounted here at /sys/kernel/tracing if it is not).  Without them the test
  is skipped with the reason -- except under CI (env CI=true), where a missing
  capability FAILS the test, so that CI cannot pass by skipping everything.
* ``@pytest.mark.tmux``: needs the tmux binary; same skip/fail rule.
* As root, temporary directories live under /run/hami-bpf-tests (0700):
  policy files must sit in a chain of directories only root can write.
* Hypothesis: no deadline per example; ``HAMI_HYPOTHESIS_EXAMPLES`` (set by `make test`) sets
  max_examples for every property test.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

TRACEFS = Path("/sys/kernel/tracing")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


try:  # hypothesis is a test extra; unit tests that need it import it themselves
    from hypothesis import settings as _hyp_settings

    # No per-example deadline, ever: tests assert behaviour, not speed, and a
    # loaded host runs an example slower than Hypothesis's 200 ms default.
    _examples = os.environ.get("HAMI_HYPOTHESIS_EXAMPLES")
    _hyp_settings.register_profile(
        "hami", deadline=None, **({"max_examples": int(_examples)} if _examples else {}))
    _hyp_settings.load_profile("hami")
except ImportError:  # pragma: no cover
    pass


def _root_only_tempdir() -> None:
    """As root, temporary files (pytest's tmp_path, tempfile) go under a
    directory only root can write, and so do every directory above it: the
    daemon refuses a policy file anywhere else (a world-writable /tmp
    included), and the tests write their policies into temporary dirs."""
    if os.geteuid() != 0:
        return
    root = "/run/hami-bpf-tests"
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return
    st = os.lstat(root)
    import stat
    if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022:
        import tempfile
        tempfile.tempdir = root


_root_only_tempdir()


def _tracefs_mounted() -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[2] == "tracefs" for line in f if len(line.split()) > 2)
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def bpf_unavailable() -> str | None:
    """None when BPF tests can run here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (run `sudo make test`)"
    try:
        import bcc  # noqa: F401
    except Exception as e:
        return (f"cannot import bcc ({type(e).__name__}: {e}); run `make install` "
                "(installs python3-bpfcc and a venv with system site packages)")
    if not _tracefs_mounted():
        TRACEFS.mkdir(parents=True, exist_ok=True) if not TRACEFS.exists() else None
        r = subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)],
                           capture_output=True, text=True)
        if r.returncode != 0 and not _tracefs_mounted():
            return f"tracefs not mounted and mounting it failed: {r.stderr.strip()}"
    return None


@functools.lru_cache(maxsize=None)
def tmux_unavailable() -> str | None:
    if shutil.which("tmux") is None:
        return "needs tmux (run `make install`)"
    return None


def _skip_or_fail(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"CI=true and a required capability is missing: {reason}",
                    pytrace=False)
    pytest.skip(reason)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("bpf") is not None:
        reason = bpf_unavailable()
        if reason:
            _skip_or_fail(f"bpf test: {reason}")
    if item.get_closest_marker("tmux") is not None:
        reason = tmux_unavailable()
        if reason:
            _skip_or_fail(f"tmux test: {reason}")


@pytest.fixture(scope="session")
def fakecuda(tmp_path_factory):
    """The built stand-in libcuda (hami_bpf.fakecuda.FakeCuda)."""
    from hami_bpf.fakecuda import build

    return build(tmp_path_factory.mktemp("fakecuda"))


def pytest_sessionfinish(session, exitstatus) -> None:
    """Unpin what this run's test daemons kept (tests/bpf/helpers.py)."""
    import sys
    helpers = sys.modules.get("helpers")
    if helpers is not None and hasattr(helpers, "remove_pin_dirs"):
        helpers.remove_pin_dirs()
