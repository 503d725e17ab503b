"""Imperative output of the slot table: what the daemon must do to the BPF maps
(and what it may log). Emitted in the order they must be applied."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .events import ProcKey

__all__ = [
    "CreateGroup",
    "DeleteGroup",
    "WriteSlot",
    "ClearSlot",
    "ReleaseProcess",
    "Compacted",
    "Action",
]


@dataclass(frozen=True)
class CreateGroup:
    name: str
    index: int  # u32, monotonic, never reused within a table's lifetime


@dataclass(frozen=True)
class DeleteGroup:
    name: str
    index: int  # the group became empty


@dataclass(frozen=True)
class WriteSlot:
    """BPF map procs[key.pid] := (group_index, slot)."""

    group: str
    group_index: int
    slot: int
    key: ProcKey


@dataclass(frozen=True)
class ClearSlot:
    group: str
    group_index: int
    slot: int


@dataclass(frozen=True)
class ReleaseProcess:
    """The process is gone: the BPF side subtracts `released` (device -> bytes
    the process still held) from the group's usage and forgets key.pid."""

    key: ProcKey
    group: str
    group_index: int
    released: Mapping[int, int]


@dataclass(frozen=True)
class Compacted:
    """Informational, for the event log: `removed` left a hole that the moves
    (key, from_slot, to_slot) filled."""

    group: str
    group_index: int
    removed: ProcKey
    moves: tuple[tuple[ProcKey, int, int], ...]
    ts_ns: int


Action = CreateGroup | DeleteGroup | WriteSlot | ClearSlot | ReleaseProcess | Compacted
