"""The BPF tests' deadlines (tests/bpf/helpers.py: Deadlines), checked with a
stub command standing in for `hami-bpf run`: no BPF, no root needed.

The stub prints 'ready' after HAMI_STUB_READY_AFTER seconds (never when
negative) and then answers pings on its --socket, as the daemon does."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bpf"))
from helpers import Daemon, DaemonError, Deadlines, wait_for  # noqa: E402

STUB = """\
import json, os, signal, socket, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
after = float(os.environ["HAMI_STUB_READY_AFTER"])
path = sys.argv[sys.argv.index("--socket") + 1]
if after < 0:
    time.sleep(3600)
time.sleep(after)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen()
print("hami-bpf: ready (stub)", file=sys.stderr, flush=True)
while True:
    c, _ = srv.accept()
    c.recv(4096)
    c.sendall(json.dumps({"ok": True, "data": "pong"}).encode() + b"\\n")
    c.close()
"""
NO_CUDA = types.SimpleNamespace(libcuda="/nonexistent/libcuda.so")


@pytest.fixture
def stub(tmp_path) -> str:
    p = tmp_path / "stub-daemon"
    p.write_text(f"#!{sys.executable}\n" + STUB)
    p.chmod(0o755)
    return str(p)


def _start(stub: str, deadlines: Deadlines, ready_after: float, monkeypatch) -> Daemon:
    monkeypatch.setenv("HAMI_STUB_READY_AFTER", str(ready_after))
    d = Daemon(NO_CUDA, deadlines=deadlines, command=stub)
    try:
        return d.start()
    except BaseException:
        d.cleanup()
        raise


def test_no_start_yet_leaves_timeouts_unscaled():
    dl = Deadlines(first_ready_timeout=123)
    assert dl.scale() == 1.0
    assert dl.timeout(2) == 2
    t, why = dl.ready_timeout()
    assert t == 123 and "first start" in why and "HAMI_TEST_READY_TIMEOUT" in why


def test_a_fast_start_never_shortens_a_timeout():
    dl = Deadlines(first_ready_timeout=100, reference_ready_s=4)
    dl.saw_ready(0.5)
    assert dl.scale() == 1.0
    assert dl.timeout(2) == 2


def test_slow_first_start_scales_later_deadlines(stub, monkeypatch):
    dl = Deadlines(first_ready_timeout=60, reference_ready_s=0.1, ready_factor=3,
                   ready_floor_s=0.2)
    d = _start(stub, dl, 0.6, monkeypatch)
    try:
        assert d.ready_after is not None and d.ready_after >= 0.6
        assert dl.slowest_ready == d.ready_after
        assert dl.scale() == pytest.approx(d.ready_after / 0.1)
        t, why = dl.ready_timeout()
        assert t == pytest.approx(3 * d.ready_after)
        assert f"{d.ready_after:.1f} s" in why
        # a converge-style wait of 0.1 base seconds now waits scale() times as long
        with pytest.raises(AssertionError) as ei:
            wait_for(lambda: "still wrong", 0.1, what="accounting", deadlines=dl)
        msg = str(ei.value)
        m = re.search(r"accounting: not reached within ([\d.]+) s \(0\.1 s x ([\d.]+), scaled "
                      r"from the slowest daemon start so far, ([\d.]+) s\); gave up after "
                      r"([\d.]+) s", msg)
        assert m, msg
        assert float(m.group(1)) == pytest.approx(dl.timeout(0.1), abs=0.05)
        assert float(m.group(4)) >= float(m.group(1)) - 0.05   # both printed to 0.1 s
        assert "still wrong" in msg
    finally:
        d.stop()
        d.cleanup()


def test_slower_start_raises_the_scale(stub, monkeypatch):
    # The floor leaves the second start all the time a loaded host needs to
    # start the stub's interpreter: the test is about the scale, not the bound.
    dl = Deadlines(first_ready_timeout=60, reference_ready_s=0.1, ready_floor_s=60)
    dl.saw_ready(0.2)
    d = _start(stub, dl, 0.5, monkeypatch)
    d.stop()
    d.cleanup()
    assert dl.slowest_ready == d.ready_after >= 0.5
    dl.saw_ready(0.1)           # a faster start later does not lower it
    assert dl.slowest_ready == d.ready_after


def test_daemon_never_ready_names_the_step_and_the_time(stub, monkeypatch):
    dl = Deadlines(first_ready_timeout=60, reference_ready_s=0.1, ready_factor=2,
                   ready_floor_s=0.2)
    first = _start(stub, dl, 0.4, monkeypatch)
    first.stop()
    first.cleanup()
    bound = dl.ready_timeout()[0]
    monkeypatch.setenv("HAMI_STUB_READY_AFTER", "-1")
    d = Daemon(NO_CUDA, deadlines=dl, command=stub)
    try:
        with pytest.raises(DaemonError) as ei:
            d.start()
        msg = str(ei.value)
        m = re.search(r"^daemon start: no 'ready' within ([\d.]+) s \(scaled from the slowest "
                      r"start so far, ([\d.]+) s\); gave up after ([\d.]+) s", msg)
        assert m, msg
        assert m.group(2) == f"{first.ready_after:.1f}"
        assert float(m.group(3)) >= bound - 0.05   # printed to 0.1 s
        assert d.proc.poll() is not None, "the stub was left running"
    finally:
        d.stop()
        d.cleanup()


def test_first_start_never_ready_says_which_bound(stub, monkeypatch):
    dl = Deadlines(first_ready_timeout=0.5)
    monkeypatch.setenv("HAMI_STUB_READY_AFTER", "-1")
    d = Daemon(NO_CUDA, deadlines=dl, command=stub)
    try:
        with pytest.raises(DaemonError) as ei:
            d.start()
        msg = str(ei.value)
        assert msg.startswith("daemon start: no 'ready' within 0.5 s (the first start in this test "
                              "run; HAMI_TEST_READY_TIMEOUT sets it); gave up after "), msg
        assert dl.slowest_ready is None
    finally:
        d.stop()
        d.cleanup()
