"""The controller's pulse, and the pace of memory denials.

``Heartbeat`` tells the BPF side the controller is alive from a thread of its
own. The BPF side stops a process at a denied allocation only while the
heartbeat is fresh (nobody else would answer the stop), and lets the call
through otherwise. Beaten from the event loop, a burst of work (thousands of
denials, each a ptrace round trip) made the heartbeat look stale and the BPF
side admit what it should have denied. Here it beats as long as the loop
makes progress, however much work is queued; a loop that makes none for
``stall_s`` (wedged) stops it, so that new processes are not stopped for
nobody to answer.

``DenyPacer`` bounds what a process retrying an allocation over its limit
costs the controller: a few answers per second are immediate, more wait,
longer and longer (the process stays stopped meanwhile). Pure: times in,
delays out.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("hami_bpf.heartbeat")

BEAT_EVERY_S = 0.2     # a tenth of the BPF side's staleness bound (2 s)
LOOP_STALL_S = 30.0    # no progress this long: the loop is wedged, stop beating

FREE_DENIALS_PER_S = 8     # answered at once (an allocator retries after freeing its cache)
DENY_BACKOFF_S = 0.005     # the first denial past those waits this long ...
DENY_BACKOFF_MAX_S = 1.0   # ... doubling, up to this
DENY_WINDOW_S = 1.0


class Heartbeat:
    def __init__(self, beat: Callable[[], None], *, every_s: float = BEAT_EVERY_S,
                 stall_s: float = LOOP_STALL_S, clock: Callable[[], float] = time.monotonic):
        self._beat = beat
        self._every = every_s
        self._stall = stall_s
        self._clock = clock
        self._last = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stalled = False
        self.errors = 0

    def progress(self) -> None:
        """The loop did something (a tick, an event): cheap, any thread."""
        self._last = self._clock()

    def tick(self) -> bool:
        """One beat if the loop is not wedged; returns whether it beat."""
        if self._clock() - self._last > self._stall:
            if not self.stalled:
                self.stalled = True
                log.error("the event loop made no progress for %.0f s: heartbeat stopped "
                          "(the BPF side stops nobody until it resumes)", self._stall)
            return False
        if self.stalled:
            self.stalled = False
            log.warning("the event loop makes progress again: heartbeat resumed")
        try:
            self._beat()
        except Exception as e:  # noqa: BLE001 - a failed beat is retried at the next one
            self.errors += 1
            if self.errors == 1:
                log.warning("heartbeat: %s", e)
            return False
        return True

    def start(self) -> None:
        self.tick()
        self._thread = threading.Thread(target=self._run, name="hami-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.tick()

    def stop(self) -> None:
        """No beat after this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class DenyPacer:
    """How long to keep a process stopped at a denied allocation before
    answering it, from how many of its denials were answered in the last
    second."""

    def __init__(self, *, free: int = FREE_DENIALS_PER_S, base_s: float = DENY_BACKOFF_S,
                 max_s: float = DENY_BACKOFF_MAX_S, window_s: float = DENY_WINDOW_S):
        self.free, self.base, self.max, self.window = free, base_s, max_s, window_s
        self._answered: dict[int, collections.deque[float]] = {}

    def delay(self, pid: int, now: float) -> float:
        q = self._answered.get(pid)
        if q is None:
            return 0.0
        while q and q[0] <= now - self.window:
            q.popleft()
        excess = len(q) - self.free
        if excess < 0:
            return 0.0
        return min(self.max, self.base * (2 ** min(excess, 30)))

    def answered(self, pid: int, now: float) -> None:
        self._answered.setdefault(pid, collections.deque()).append(now)

    def forget(self, pid: int) -> None:
        self._answered.pop(pid, None)

    def __len__(self) -> int:
        return len(self._answered)
