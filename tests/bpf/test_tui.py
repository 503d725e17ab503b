"""`hami-bpf top` tested as a person uses it: in a real terminal (tmux), keys
sent with `send-keys`, the screen read with `capture-pane`, against a real
daemon with real uprobes on stand-in libcuda processes.

One daemon per module (with --count-launches, so launches/s has numbers);
each tmux session runs on its own tmux server (-L) so nobody else's tmux is
touched.
"""
from __future__ import annotations

import re
import subprocess
import threading
import time
import uuid

import pytest

from helpers import (Daemon, Tracked, finish_daemon, gname, hami_bpf_bin, wait_for,
                     wait_registered)

pytestmark = [pytest.mark.bpf, pytest.mark.tmux]

MiB = 1 << 20
SCREEN_TIMEOUT = 10.0


class Screen:
    """`hami-bpf top` in a detached 200x50 tmux session."""

    def __init__(self, socket: str, *args: str):
        self.server = f"hami-tui-{uuid.uuid4().hex[:8]}"
        self.session = "top"
        cmd = " ".join([hami_bpf_bin(), "top", "--socket", socket, *args])
        self._tmux("new-session", "-d", "-x", "200", "-y", "50", "-s", self.session,
                   "-e", "TERM=xterm-256color", cmd)
        # Keep the pane after top exits so a crash leaves its last words readable.
        self._tmux("set-option", "-t", self.session, "remain-on-exit", "on")

    def _tmux(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.server, *args], capture_output=True, text=True,
                              check=check, timeout=10)

    def text(self, ansi: bool = False) -> str:
        args = ["capture-pane", "-p", "-t", self.session] + (["-e"] if ansi else [])
        return self._tmux(*args).stdout

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", self.session, *keys)

    def dead(self) -> bool:
        r = self._tmux("list-panes", "-t", self.session, "-F", "#{pane_dead}", check=False)
        return r.returncode != 0 or r.stdout.strip() == "1"

    def wait(self, check, what: str, timeout: float = SCREEN_TIMEOUT) -> str:
        """Poll the screen until check(text) is falsy-free (True / empty list)."""
        box = {}

        def problem():
            box["text"] = t = self.text()
            ok = check(t)
            return None if ok else f"{what}; screen:\n{t}"

        wait_for(problem, timeout, interval=0.1, what=what)
        return box["text"]

    def close(self) -> None:
        self._tmux("kill-server", check=False)

    def __enter__(self) -> "Screen":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_ROW = re.compile(r"^│\s+(\d+)?\s+(\d+)\s+(\S+)\s")


def panel_rows(text: str, group: str) -> list[tuple[int | None, int]]:
    """(slot, pid) of the rows in the group's panel, in screen order."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith("╭─") and f"group {group} " in line:
            inside = True
            continue
        if inside and line.startswith("╰"):
            break
        if inside:
            m = _ROW.match(line)
            if m and not line.lstrip("│ ").startswith("GPU"):
                rows.append((int(m.group(1)) if m.group(1) else None, int(m.group(2))))
    return rows


def header(text: str) -> str:
    return text.splitlines()[0] if text else ""


@pytest.fixture(scope="module")
def daemon(fakecuda):
    d = Daemon(fakecuda, count_launches=True, extra=["--sm-limits"]).start()
    yield d
    finish_daemon(d)


def test_top_shows_groups_processes_and_compaction(daemon, fakecuda):
    g = gname("tui")
    with Tracked.spawn(fakecuda, g) as a, Tracked.spawn(fakecuda, g) as b, \
            Tracked.spawn(fakecuda, g) as c:
        wait_registered(daemon, [a, b, c])
        a.alloc("alloc 96M", 0)
        b.alloc("alloc 32M", 0)
        c.alloc("alloc 64M", 0)
        c.ok("launch 500")
        with Screen(daemon.socket) as s:
            text = s.wait(lambda t: {p.pid for p in (a, b, c)} <= {pid for _, pid in
                                                                 panel_rows(t, g)},
                          f"group {g} with pids {a.pid}, {b.pid}, {c.pid}")
            assert f"group {g}" in text
            assert "96.0 MiB" in text and "running" in text
            assert "mechanisms:" in text and "counters:" in text
            rows = panel_rows(text, g)
            # sorted by memory (the default): a (96M), c (64M), b (32M)
            assert [pid for _, pid in rows] == [a.pid, c.pid, b.pid]
            assert sorted(slot for slot, _ in rows) == [0, 1, 2]
            slot_of = dict((pid, slot) for slot, pid in rows)
            assert slot_of[a.pid] == 0

            # a (slot 0) exits: the last slot moves into the hole.
            a.proc.send("exit 0")
            a.proc.wait(5)
            a.mark_dead()
            text = s.wait(lambda t: [pid for _, pid in panel_rows(t, g)] and
                          a.pid not in {pid for _, pid in panel_rows(t, g)},
                          f"pid {a.pid} gone from group {g}")
            rows = panel_rows(text, g)
            assert sorted(slot for slot, _ in rows) == [0, 1], rows
            assert dict((pid, slot) for slot, pid in rows) == {c.pid: 0, b.pid: 1}
            assert f"group {g}  slots 2" in text


def test_top_keys_sort_filter_device_quit(daemon, fakecuda):
    g1, g2 = gname("tuia"), gname("tuib")
    with Tracked.spawn(fakecuda, g1) as a, Tracked.spawn(fakecuda, g1) as b, \
            Tracked.spawn(fakecuda, g2) as c:
        wait_registered(daemon, [a, b, c])
        a.alloc("alloc 8M", 0)          # a: little memory, many launches
        a.ok("launch 20000")
        b.alloc("alloc 80M", 0)
        b.ok("device 1")
        b.alloc("alloc 16M", 1)         # b: two devices
        c.alloc("alloc 4M", 0)
        with Screen(daemon.socket) as s:
            s.wait(lambda t: a.pid in {p for _, p in panel_rows(t, g1)}
                   and c.pid in {p for _, p in panel_rows(t, g2)}, "both groups")
            by_pid = sorted((a.pid, b.pid))
            text = s.text()
            assert "sort: memory" in header(text)
            assert [p for _, p in panel_rows(text, g1)] == [b.pid, a.pid]

            s.keys("s")
            s.wait(lambda t: "sort: launches" in header(t), "sort: launches")
            s.keys("s")
            text = s.wait(lambda t: "sort: pid" in header(t), "sort: pid")
            assert [p for _, p in panel_rows(text, g1)] == by_pid
            s.keys("s")
            s.wait(lambda t: "sort: memory" in header(t), "sort back to memory")

            # f: all -> each group in turn -> all
            seen = []
            for _ in range(20):
                s.keys("f")
                text = s.wait(lambda t: "filter: " in header(t), "filter")
                time.sleep(0.3)
                text = s.text()
                cur = re.search(r"filter: (\S+)", header(text)).group(1)
                seen.append(cur)
                if cur == g1:
                    assert f"group {g1}" in text and f"group {g2}" not in text
                if cur == g2:
                    assert f"group {g2}" in text and f"group {g1}" not in text
                if cur == "all":
                    break
            assert g1 in seen and g2 in seen and seen[-1] == "all", seen

            # d: one row per device; b shows GPU 0 and 1 on two lines
            s.keys("d")
            text = s.wait(lambda t: "view: per-device" in header(t), "per-device view")
            lines = [ln for ln in text.splitlines() if f" {b.pid} " in ln]
            assert len(lines) == 1
            idx = text.splitlines().index(lines[0])
            follow = text.splitlines()[idx + 1]
            assert "16.0 MiB" in follow, follow
            s.keys("d")
            s.wait(lambda t: "view: per-process" in header(t), "per-process view")

            s.keys("q")
            wait_for(lambda: None if s.dead() else "top still running after q", 5,
                     what="top quits on q")


def test_top_launch_rate(daemon, fakecuda):
    g = gname("tuil")
    with Tracked.spawn(fakecuda, g) as a:
        wait_registered(daemon, [a])
        stop = threading.Event()

        def launcher():
            while not stop.is_set():
                a.ok("launch 200")
                time.sleep(0.02)

        t = threading.Thread(target=launcher, daemon=True)
        t.start()
        try:
            with Screen(daemon.socket) as s:
                def rate(text):
                    for line in text.splitlines():
                        if f" {a.pid} " in line:
                            m = re.search(r"/ unlimited\s+(\d[\d.k]*)\s", line)
                            return m and m.group(1)
                    return None
                text = s.wait(lambda t: rate(t) not in (None, "0", "0.0"), "launches/s > 0")
                assert rate(text)
        finally:
            stop.set()
            t.join(10)


def test_top_and_events_follow_survive_daemon_restart(daemon, fakecuda, tmp_path):
    g = gname("tuir")
    out, err = tmp_path / "events.out", tmp_path / "events.err"
    with Tracked.spawn(fakecuda, g) as a, open(out, "w") as fo, open(err, "w") as fe:
        a.alloc("alloc 24M", 0)
        wait_registered(daemon, [a])
        follow = subprocess.Popen([hami_bpf_bin(), "events", "--follow", "--interval", "0.2",
                                   "--socket", daemon.socket], stdout=fo, stderr=fe)
        try:
            with Screen(daemon.socket) as s:
                s.wait(lambda t: a.pid in {p for _, p in panel_rows(t, g)}, "process shown")
                wait_for(lambda: None if f"pid {a.pid} (cudaprog) registered in group '{g}'"
                         in out.read_text() else "no register line", 5, what="events line")
                assert daemon.stop() == 0
                text = s.wait(lambda t: "reconnecting" in t, "reconnecting")
                assert not s.dead()
                daemon.start()
                text = s.wait(lambda t: "reconnecting" not in t
                              and a.pid in {p for _, p in panel_rows(t, g)},
                              "recovered with the process listed")
                assert f"group {g}" in text
            # events --follow: said so on stderr, then printed the new daemon's
            # registration of the same process.
            reg = re.compile(rf"^\d\d:\d\d:\d\d\.\d{{3}}  register  pid {a.pid} \(cudaprog\) "
                             rf"registered in group '{g}' slot 0$", re.M)
            wait_for(lambda: None if len(reg.findall(out.read_text())) == 2 else
                     f"stdout:\n{out.read_text()}\nstderr:\n{err.read_text()}", 10,
                     what="a second register line after the restart")
            assert "reconnecting" in err.read_text() and "reconnected" in err.read_text()
            assert follow.poll() is None
        finally:
            follow.terminate()
            follow.wait(10)


def test_top_once_plain_frame(daemon, fakecuda):
    g = gname("tuio")
    with Tracked.spawn(fakecuda, g) as a:
        a.alloc("alloc 3M", 0)
        wait_registered(daemon, [a])
        r = subprocess.run([hami_bpf_bin(), "top", "--once", "--socket", daemon.socket],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert "\x1b[?1049h" not in r.stdout       # no alternate screen
        assert f"group {g}" in r.stdout and str(a.pid) in r.stdout


def test_top_shows_throttled(daemon, fakecuda):
    """A process over its SM limit shows as throttled."""
    g = gname("tuit")
    with Tracked.spawn(fakecuda, g, env={"CUDA_DEVICE_SM_LIMIT": "10"}) as a:
        wait_registered(daemon, [a])
        stop = threading.Event()

        def launcher():
            while not stop.is_set():
                try:
                    a.cmd("launch 2000", timeout=30)
                except Exception:
                    return

        t = threading.Thread(target=launcher, daemon=True)
        t.start()
        try:
            deadline = time.monotonic() + 3
            sm = None
            while time.monotonic() < deadline and sm is None:
                grp = next((x for x in daemon.snapshot()["groups"] if x["id"] == g), None)
                sm = grp and grp.get("sm_limit")
                time.sleep(0.1)
            assert sm is not None, f"group {g} reports no SM limit"
            with Screen(daemon.socket) as s:
                text = s.wait(lambda t: any(f" {a.pid} " in ln and "throttled" in ln
                                            for ln in t.splitlines()),
                              f"pid {a.pid} throttled", timeout=15)
                assert "SM cap 10%" in text
        finally:
            stop.set()
            t.join(40)
