"""Names of the counters a snapshot can carry, in one place.

A snapshot's counters come from three producers: the slot table
(slots.STAT_NAMES), the BPF programs' stats map (abi.STAT_NAMES) and the
daemon itself (DAEMON_COUNTERS below, plus the families named by prefix).
Anything that displays or exports counters by name should use only names
known here, so a renamed counter cannot silently vanish from a display.
"""
from __future__ import annotations

import collections

from . import abi, slots

# Counted by the controller's components (one Counter, Daemon.counters).
DAEMON_COUNTERS: tuple[str, ...] = (
    "adopted_exited",
    "adopted_processes",
    "alloc_failures",
    "classify_failures",
    "compactions",
    "denials",
    "denials_paced",
    "enforce_errors",
    "enforce_refused",
    "events",
    "execs",
    "gate_scan_claims",       # processes held at cuInit found by the scan, not by their event
    "handler_errors",
    "holds_cut_short",
    "launch_probes",          # set, not counted: probes attached on launch calls
    "lib_opens",              # processes the open gate stopped at a driver library
    "lib_opens_probed",       # ... whose library nobody probed yet
    "meminfo_rewrites",
    "memory_unseen_changes",  # a process's memory no probe charged changed (hami_bpf.unseen)
    "policy_reloads",
    "reaped",
    "slot_write_after_exit",
    "sm_errors",
    "sm_holds_at_sync",
    "state_write_errors",
    "throttle_episodes",      # SM-cap holds: a group stopped until its budget refills
    "throttle_ms",
    "usage_corrections",
    "would_deny",
)

# Counter families whose suffix is a value (a reason, a mode, a bucket).
DAEMON_COUNTER_PREFIXES: tuple[str, ...] = ("sm_corrections_", "sm_mode_", "sm_slices_",
                                             "sm_giveback_", "sm_overlap_", "sm_samples_",
                                             "exit_latency_")


def known(name: str) -> bool:
    """Whether some producer can emit a counter of this name."""
    return (name in DAEMON_COUNTERS or name in slots.STAT_NAMES
            or name in abi.STAT_NAMES.values()
            or name.startswith(DAEMON_COUNTER_PREFIXES))


class Counters(collections.Counter):
    """The daemon's counters: a Counter that refuses a name no producer
    declares (KeyError), so a misspelt or undeclared counter fails where it is
    counted instead of silently vanishing from displays and the exporter."""

    def __missing__(self, name: str) -> int:
        if not known(name):
            raise KeyError(f"undeclared counter {name!r} (hami_bpf/counters.py)")
        return 0

    def __setitem__(self, name: str, value: int) -> None:
        # A name already present was checked when it was first set.
        if name not in self and not known(name):
            raise KeyError(f"undeclared counter {name!r} (hami_bpf/counters.py)")
        super().__setitem__(name, value)
