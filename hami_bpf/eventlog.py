"""The controller's event log: what it decided and why, for `hami-bpf events`,
the TUI and the socket's "events" op.

Every record has a kind from :class:`Kind` (the one list of kinds; the CLI
styles them by it) and a JSON-able payload whose fields tests assert on. The
one-line ``message`` is for people; nothing parses it.
"""
from __future__ import annotations

import collections
import enum
import logging
import threading
import time

from .snapshot import EventRecord

log = logging.getLogger("hami_bpf")

EVENT_LOG_LEN = 2000


class Kind(str, enum.Enum):
    """Every kind of record the controller writes, and who writes it."""
    REGISTER = "register"          # registry: a process joined a group (pid, group, slot)
    EXEC = "exec"                  # registry: a process replaced its image (pid, group)
    COMPACT = "compact"            # registry: a slot freed, the last one moved (group, removed, moves)
    GROUP = "group"                # registry: an empty group deleted (group)
    RECONCILE = "reconcile"        # registry: usage corrected from the kernel (pid, before, after)
    LIMIT = "limit"                # grouplimits: a memory limit, priority or SM cap (group, device, limit)
    DENY = "deny"                  # memory: an allocation refused (pid, group, device, size)
    DENY_IGNORED = "deny_ignored"  # registry: a refused allocation returned success
    THROTTLE = "throttle"          # smcontrol: SM-cap holds and their corrections
    PROBES = "probes"              # libwatch: libraries attached and detached
    ADOPT = "adopt"                # startup: a predecessor's maps taken over
    RECOVER = "recover"            # startup: stops a previous run left, finished
    STATE = "state"                # startup: kept state discarded or waited for
    CONFIG = "config"              # policy, registration: configuration read and problems in it
    FALLBACK = "fallback"          # any: a mechanism unavailable, what is used instead
    ERROR = "error"                # any: something failed; what still holds


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

    def record(self, kind: str | Kind, message: str, **data) -> None:
        kind = Kind(kind)
        with self._lock:
            self._seq += 1
            self.records.append(EventRecord(time.time(), kind.value, message, data, self._seq))
        lvl = (logging.WARNING if kind in WARN_KINDS else
               logging.INFO if (self.verbose or kind in INFO_KINDS) else logging.DEBUG)
        log.log(lvl, "%s", message)

    def since(self, seq: int) -> list[EventRecord]:
        with self._lock:
            return [e for e in self.records if e.seq > seq]

    def __iter__(self):
        return iter(list(self.records))
