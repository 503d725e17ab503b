"""The controller's event log: what it decided and why, for `hami-bpf events`,
the TUI and the socket's "events" op.

Every record has a kind from :class:`Kind` (the CLI styles them by it), a type
within it and a JSON-able payload whose fields tests assert on; both are
declared in one table (eventtext.TYPES). The human line is rendered from the
payload where it is shown (this module's log line, the socket's JSON, the CLI);
nothing parses it.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

from .eventtext import Kind, check, render
from .snapshot import EventRecord

log = logging.getLogger("hami_bpf")

EVENT_LOG_LEN = 2000

__all__ = ["EVENT_LOG_LEN", "EventLog", "INFO_KINDS", "Kind", "WARN_KINDS"]


WARN_KINDS = frozenset({Kind.CONFIG, Kind.ERROR, Kind.DENY_IGNORED})
INFO_KINDS = frozenset({Kind.DENY, Kind.FALLBACK, Kind.RECOVER})


class EventLog:
    """A bounded, sequenced log (written by the loop, read by the server's
    threads under a lock)."""

    def __init__(self, maxlen: int = EVENT_LOG_LEN):
        self.records: collections.deque[EventRecord] = collections.deque(maxlen=maxlen)
        self._seq = 0
        self._lock = threading.Lock()
        self.verbose = False        # every kind logged at INFO (the simulated demo)

    def record(self, kind: str | Kind, what: str, **data) -> None:
        """Append a record of a declared type; ValueError for an undeclared
        one or a payload without its fields (eventtext.check)."""
        kind = check(kind, what, data).kind
        with self._lock:
            self._seq += 1
            self.records.append(EventRecord(time.time(), kind.value, what, data, self._seq))
        lvl = (logging.WARNING if kind in WARN_KINDS else
               logging.INFO if (self.verbose or kind in INFO_KINDS) else logging.DEBUG)
        if log.isEnabledFor(lvl):
            log.log(lvl, "%s", render(kind.value, what, data))

    def since(self, seq: int) -> list[EventRecord]:
        with self._lock:
            return [e for e in self.records if e.seq > seq]

    def __iter__(self):
        return iter(list(self.records))
