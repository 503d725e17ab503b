"""Slot table: random interleavings against a reference model, plus the stories
that motivated it (HAMi-core's TP=2 stale-slot stall)."""
from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hami_bpf.actions import (
    ClearSlot,
    Compacted,
    CreateGroup,
    DeleteGroup,
    ReleaseProcess,
    WriteSlot,
)
from hami_bpf.events import (
    GroupLimitSet,
    LaunchesCounted,
    MemoryAllocated,
    MemoryFreed,
    ProcessExited,
    ProcessRegistered,
    ProcKey,
    UsageObserved,
)
from hami_bpf.slots import SlotTable

# Registered (not loaded) so this module never changes other modules' settings.
settings.register_profile(
    "hami-slots",
    max_examples=int(os.environ.get("HAMI_HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    stateful_step_count=60,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = settings.get_profile("hami-slots")

PIDS = st.integers(min_value=1, max_value=12)
GROUPS = st.sampled_from(["a", "b", "c"])
DEVICES = st.integers(min_value=0, max_value=2)
PTRS = st.integers(min_value=0, max_value=6).map(lambda i: 0x7F0000000000 + (i << 20))
SIZES = st.integers(min_value=0, max_value=1 << 34)


def _sum(allocs: dict[int, tuple[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for device, size in allocs.values():
        out[device] = out.get(device, 0) + size
    return {d: s for d, s in out.items() if s}


class _Model:
    """Reference: which key is live per pid, its group, and its live ptrs."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[ProcKey, str, dict[int, tuple[int, int]]]] = {}
        self.next_start: dict[int, int] = {}
        self.launches: dict[int, int] = {}
        # pid -> device -> bytes the kernel's counters reported that no ptr explains
        self.extra: dict[int, dict[int, int]] = {}

    def usage(self, pid: int) -> dict[int, int]:
        out = _sum(self.live[pid][2])
        for device, size in self.extra.get(pid, {}).items():
            out[device] = out.get(device, 0) + size
        return {d: s for d, s in out.items() if s}

    def group_usage(self) -> dict[str, dict[int, int]]:
        out: dict[str, dict[int, int]] = {}
        for pid, (key, group, allocs) in self.live.items():
            g = out.setdefault(group, {})
            for device, size in self.usage(pid).items():
                g[device] = g.get(device, 0) + size
        return out


class SlotMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.t = SlotTable()
        self.m = _Model()
        self.ts = 0

    def _ts(self) -> int:
        self.ts += 1
        return self.ts

    def _check_exit_actions(self, actions, key: ProcKey, group: str, before: tuple[ProcKey, ...],
                            released: dict[int, int]) -> None:
        hole = before.index(key)
        last = len(before) - 1
        gi = actions[0].group_index
        assert actions[0] == ReleaseProcess(key, group, gi, released)
        if hole == last:
            rest = [ClearSlot(group, gi, last)]
        else:
            mover = before[last]
            rest = [WriteSlot(group, gi, hole, mover), ClearSlot(group, gi, last),
                    Compacted(group, gi, key, ((mover, last, hole),), self.ts)]
        if last == 0:
            rest.append(DeleteGroup(group, gi))
        assert actions[1:1 + len(rest)] == rest, actions
        return actions[1 + len(rest):]

    @rule(pid=PIDS, group=GROUPS)
    def register_new_or_reuse(self, pid: int, group: str) -> None:
        # A fresh start_time: new pid, or pid reuse without an exit seen first.
        start = self.m.next_start.get(pid, 100)
        self.m.next_start[pid] = start + 1
        key = ProcKey(pid, start)
        old = self.m.live.get(pid)
        before = self.t.group(old[1]).slots if old else ()
        actions = self.t.apply(ProcessRegistered(key, group, comm=f"p{pid}", ts_ns=self._ts()))
        if old is not None:
            actions = self._check_exit_actions(actions, old[0], old[1], before, self.m.usage(pid))
            del self.m.live[pid]
            self.m.extra.pop(pid, None)
            self.m.launches.pop(pid, None)
        expected_slot = len(self.t.group(group).slots) - 1
        self.m.live[pid] = (key, group, {})
        gv = self.t.group(group)
        if isinstance(actions[0], CreateGroup):
            assert actions[0] == CreateGroup(group, gv.index)
            actions = actions[1:]
            assert expected_slot == 0
        assert actions == [WriteSlot(group, gv.index, expected_slot, key)]

    @rule(pid=PIDS, group=GROUPS, comm=st.sampled_from(["", "renamed"]))
    def register_again(self, pid: int, group: str, comm: str) -> None:
        if pid not in self.m.live:
            return
        key = self.m.live[pid][0]
        before = self.t.process(pid)
        assert self.t.apply(ProcessRegistered(key, group, comm=comm)) == []
        after = self.t.process(pid)
        assert (after.group, after.slot) == (before.group, before.slot)
        assert after.comm == (comm or before.comm)

    @rule(pid=PIDS)
    def register_older_start_time(self, pid: int) -> None:
        if pid not in self.m.live:
            return
        key = self.m.live[pid][0]
        stale = self.t.stats["stale_register"]
        assert self.t.apply(ProcessRegistered(ProcKey(pid, key.start_time - 1), "c")) == []
        assert self.t.stats["stale_register"] == stale + 1

    @rule(pid=PIDS, device=DEVICES, size=SIZES, ptr=PTRS)
    def allocate(self, pid: int, device: int, size: int, ptr: int) -> None:
        unknown = self.t.stats["unknown_pid"]
        assert self.t.apply(MemoryAllocated(pid, device, size, ptr)) == []
        if pid in self.m.live:
            self.m.live[pid][2][ptr] = (device, size)
        else:
            assert self.t.stats["unknown_pid"] == unknown + 1

    @rule(pid=PIDS, ptr=PTRS)
    def free(self, pid: int, ptr: int) -> None:
        unknown_ptr = self.t.stats["unknown_ptr"]
        assert self.t.apply(MemoryFreed(pid, ptr)) == []
        if pid in self.m.live:
            if self.m.live[pid][2].pop(ptr, None) is None:
                assert self.t.stats["unknown_ptr"] == unknown_ptr + 1

    @rule(pid=PIDS, used=st.dictionaries(DEVICES, SIZES, max_size=3), same=st.booleans())
    def kernel_counters(self, pid: int, used: dict[int, int], same: bool) -> None:
        """The kernel's per-process counters (pmem) replace the table's sum."""
        corrected = self.t.stats["usage_corrected"]
        if pid in self.m.live and same:
            used = self.m.usage(pid)
        assert self.t.apply(UsageObserved(pid, used)) == []
        if pid not in self.m.live:
            return
        want = {d: b for d, b in used.items() if b}
        have = self.m.usage(pid)
        if want == have:
            assert self.t.stats["usage_corrected"] == corrected
            return
        assert self.t.stats["usage_corrected"] == corrected + 1
        changed = {d for d in set(want) | set(have) if want.get(d, 0) != have.get(d, 0)}
        allocs = self.m.live[pid][2]
        for ptr in [p for p, (d, _) in allocs.items() if d in changed]:
            del allocs[ptr]
        extra = self.m.extra.setdefault(pid, {})
        for d in changed:
            if want.get(d):
                extra[d] = want[d]
            else:
                extra.pop(d, None)

    @rule(pid=PIDS, count=st.integers(min_value=0, max_value=10**9))
    def launches(self, pid: int, count: int) -> None:
        self.t.apply(LaunchesCounted(pid, count))
        if pid in self.m.live:
            self.m.launches[pid] = count

    @rule(pid=PIDS, exact=st.booleans())
    def exit_clean(self, pid: int, exact: bool) -> None:
        ts = self._ts()
        if pid not in self.m.live:
            unknown = self.t.stats["unknown_pid"]
            assert self.t.apply(ProcessExited(pid, ts_ns=ts)) == []
            assert self.t.stats["unknown_pid"] == unknown + 1
            return
        key, group, allocs = self.m.live[pid]
        before = self.t.group(group).slots
        actions = self.t.apply(ProcessExited(pid, key.start_time if exact else None, ts_ns=ts))
        assert self._check_exit_actions(actions, key, group, before, self.m.usage(pid)) == []
        del self.m.live[pid]
        self.m.extra.pop(pid, None)
        self.m.launches.pop(pid, None)

    @rule(pid=PIDS)
    def exit_wrong_start_time(self, pid: int) -> None:
        if pid not in self.m.live:
            return
        key = self.m.live[pid][0]
        assert self.t.apply(ProcessExited(pid, key.start_time + 1000)) == []
        assert self.t.resolve(pid) is not None

    @rule(pid=st.integers(min_value=10**6, max_value=10**6 + 5))
    def unknown_pid_events(self, pid: int) -> None:
        before = self.t.stats["unknown_pid"]
        for ev in (MemoryAllocated(pid, 0, 1, 1), MemoryFreed(pid, 1), LaunchesCounted(pid, 1),
                   ProcessExited(pid)):
            assert self.t.apply(ev) == []
        assert self.t.stats["unknown_pid"] == before + 4

    @rule(group=GROUPS, device=DEVICES, limit=st.none() | st.integers(min_value=0, max_value=1 << 40))
    def set_limit(self, group: str, device: int, limit: int | None) -> None:
        assert self.t.apply(GroupLimitSet(group, device, limit)) == []
        assert self.t.limits(group)[device] == limit
        gv = self.t.group(group)
        if gv is not None:
            assert gv.limits[device] == limit

    @invariant()
    def matches_model(self) -> None:
        self.t.check_invariants()
        usage = self.m.group_usage()
        groups = {g.name: g for g in self.t.groups()}
        assert set(groups) == {g for _, g, _ in self.m.live.values()}
        for name, g in groups.items():
            assert dict(g.used) == usage.get(name, {})
            assert len(set(g.slots)) == len(g.slots)
        assert len(self.t.processes()) == len(self.m.live)
        for pid, (key, group, allocs) in self.m.live.items():
            view = self.t.process(pid)
            assert view is not None and view.key == key and view.group == group
            assert dict(view.used) == self.m.usage(pid)
            assert view.launches == self.m.launches.get(pid)
            g, slot = self.t.resolve(pid)
            assert g == group and 0 <= slot < len(groups[g].slots)
            assert groups[g].slots[slot] == key


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = PROFILE


# ------------------------------------------------------------------ examples
def _reg(t: SlotTable, pid: int, group: str, start: int = 1) -> list:
    return t.apply(ProcessRegistered(ProcKey(pid, start), group, comm=f"p{pid}"))


def test_register_creates_group_then_slot():
    t = SlotTable()
    assert _reg(t, 10, "pod") == [CreateGroup("pod", 1), WriteSlot("pod", 1, 0, ProcKey(10, 1))]
    assert _reg(t, 11, "pod") == [WriteSlot("pod", 1, 1, ProcKey(11, 1))]
    assert _reg(t, 12, "other") == [CreateGroup("other", 2), WriteSlot("other", 2, 0, ProcKey(12, 1))]
    assert t.resolve(11) == ("pod", 1)
    t.check_invariants()


def test_move_emits_exactly_writeslot_clearslot_compacted():
    t = SlotTable()
    for pid in (1, 2, 3, 4):
        _reg(t, pid, "g")
    t.apply(MemoryAllocated(2, 0, 100, 0xA))
    t.apply(MemoryAllocated(2, 1, 7, 0xB))
    actions = t.apply(ProcessExited(2, ts_ns=55))
    assert actions == [
        ReleaseProcess(ProcKey(2, 1), "g", 1, {0: 100, 1: 7}),
        WriteSlot("g", 1, 1, ProcKey(4, 1)),
        ClearSlot("g", 1, 3),
        Compacted("g", 1, ProcKey(2, 1), ((ProcKey(4, 1), 3, 1),), 55),
    ]
    assert t.resolve(4) == ("g", 1)
    assert t.group("g").slots == (ProcKey(1, 1), ProcKey(4, 1), ProcKey(3, 1))
    assert t.stats["compactions"] == 1
    t.check_invariants()


def test_last_slot_exit_only_clears():
    t = SlotTable()
    _reg(t, 1, "g")
    _reg(t, 2, "g")
    assert t.apply(ProcessExited(2)) == [ReleaseProcess(ProcKey(2, 1), "g", 1, {}), ClearSlot("g", 1, 1)]
    assert t.apply(ProcessExited(1)) == [
        ReleaseProcess(ProcKey(1, 1), "g", 1, {}), ClearSlot("g", 1, 0), DeleteGroup("g", 1)]
    assert t.groups() == ()
    # A group index is never reused, even for the same name.
    assert _reg(t, 3, "g")[0] == CreateGroup("g", 2)


def test_pid_reuse_without_exit_releases_old_first():
    t = SlotTable()
    _reg(t, 7, "g", start=100)
    t.apply(MemoryAllocated(7, 0, 4096, 0x1))
    actions = _reg(t, 7, "g", start=200)
    assert actions == [
        ReleaseProcess(ProcKey(7, 100), "g", 1, {0: 4096}),
        ClearSlot("g", 1, 0),
        DeleteGroup("g", 1),
        CreateGroup("g", 2),
        WriteSlot("g", 2, 0, ProcKey(7, 200)),
    ]
    assert t.stats["reregistered_stale"] == 1
    assert dict(t.process(7).used) == {}
    # The old identity's exit arriving late must not touch the new process.
    assert t.apply(ProcessExited(7, 100)) == []
    assert t.process(7).key == ProcKey(7, 200)
    t.check_invariants()


def test_tp2_story_ranks_keep_accounting_through_churn():
    """Two TP ranks share a group with short-lived helpers that exit in random
    order; every compaction may move a rank, and the ranks' later allocations
    and frees must still land on their own records."""
    rng = random.Random(2)
    t = SlotTable()
    # Engine/compile helpers start before the ranks, so their exits move ranks.
    helpers: list[int] = []
    for pid in (900, 901, 902):
        _reg(t, pid, "vllm")
        t.apply(MemoryAllocated(pid, 0, 1 << 20, 0xDEAD))
        helpers.append(pid)
    _reg(t, 100, "vllm")
    _reg(t, 101, "vllm")
    rank_bytes = {100: 0, 101: 0}
    ptr = 0x1000
    live_ptrs: dict[int, list[tuple[int, int]]] = {100: [], 101: []}
    next_pid = 1000
    moved = 0
    for _round in range(60):
        for _ in range(rng.randint(0, 4)):
            _reg(t, next_pid, "vllm")
            t.apply(MemoryAllocated(next_pid, 0, 1 << 20, 0xDEAD))
            helpers.append(next_pid)
            next_pid += 1
        rng.shuffle(helpers)
        for _ in range(rng.randint(0, len(helpers))):
            for a in t.apply(ProcessExited(helpers.pop())):
                if isinstance(a, Compacted):
                    moved += any(k.pid in rank_bytes for k, _, _ in a.moves)
        for rank, device in ((100, 0), (101, 1)):
            ptr += 0x1000
            size = rng.randint(1, 1 << 30)
            t.apply(MemoryAllocated(rank, device, size, ptr))
            live_ptrs[rank].append((ptr, size))
            rank_bytes[rank] += size
            if rng.random() < 0.3:
                p, s = live_ptrs[rank].pop(rng.randrange(len(live_ptrs[rank])))
                t.apply(MemoryFreed(rank, p))
                rank_bytes[rank] -= s
        t.check_invariants()
        g = t.group("vllm")
        for rank in rank_bytes:
            name, slot = t.resolve(rank)
            assert name == "vllm" and 0 <= slot < g.proc_num and g.slots[slot].pid == rank
        assert dict(t.process(100).used) == ({0: rank_bytes[100]} if rank_bytes[100] else {})
        assert dict(t.process(101).used) == ({1: rank_bytes[101]} if rank_bytes[101] else {})
        assert g.used.get(0, 0) == rank_bytes[100] + (1 << 20) * len(helpers)
        assert g.used.get(1, 0) == rank_bytes[101]
    assert moved > 0, "the story must actually move a rank"
    assert t.stats["unknown_pid"] == 0 and t.stats["unknown_ptr"] == 0


def test_200_processes_exit_in_random_order_leave_empty_table():
    rng = random.Random(200)
    t = SlotTable()
    pids = list(range(1, 201))
    for pid in pids:
        _reg(t, pid, f"g{pid % 7}")
        for i in range(3):
            t.apply(MemoryAllocated(pid, i % 2, pid * 1000 + i, i))
    rng.shuffle(pids)
    for n, pid in enumerate(pids):
        t.apply(ProcessExited(pid))
        if n % 20 == 0:
            t.check_invariants()
    t.check_invariants()
    assert t.groups() == () and t.processes() == () and len(t) == 0
    assert t.stats["exited"] == 200 and t.stats["groups_deleted"] == 7


def test_released_bytes_sum_to_all_charges():
    rng = random.Random(5)
    t = SlotTable()
    charged = 0
    for pid in range(1, 51):
        _reg(t, pid, "g")
        for i in range(5):
            size = rng.randint(1, 1 << 20)
            t.apply(MemoryAllocated(pid, 0, size, i))
            charged += size
    released = 0
    order = list(range(1, 51))
    rng.shuffle(order)
    for pid in order:
        for a in t.apply(ProcessExited(pid)):
            if isinstance(a, ReleaseProcess):
                released += sum(a.released.values())
    assert released == charged


def test_unknown_and_invalid_events_never_raise():
    t = SlotTable()
    assert t.apply(MemoryFreed(5, 1)) == []
    assert t.apply(object()) == []
    _reg(t, 5, "g")
    assert t.apply(MemoryFreed(5, 1)) == []
    assert t.apply(MemoryAllocated(5, 0, -1, 1)) == []
    assert t.stats["unknown_pid"] == 1
    assert t.stats["unknown_ptr"] == 1
    assert t.stats["unknown_event"] == 1
    assert t.stats["invalid_event"] == 1
    t.check_invariants()


def test_duplicate_ptr_replaces_lost_free():
    t = SlotTable()
    _reg(t, 1, "g")
    t.apply(MemoryAllocated(1, 0, 100, 0x10))
    t.apply(MemoryAllocated(1, 1, 30, 0x10))
    assert dict(t.process(1).used) == {1: 30}
    assert t.stats["duplicate_ptr"] == 1
    t.check_invariants()


def test_limits_stored_before_group_exists_and_survive_it():
    t = SlotTable()
    t.apply(GroupLimitSet("pod", 0, 8 << 30))
    t.apply(GroupLimitSet("pod", 1, None))
    _reg(t, 1, "pod")
    assert dict(t.group("pod").limits) == {0: 8 << 30, 1: None}
    t.apply(ProcessExited(1))
    assert dict(t.limits("pod")) == {0: 8 << 30, 1: None}


def test_max_slots_refuses_extra_members():
    t = SlotTable(max_slots=2)
    _reg(t, 1, "g")
    _reg(t, 2, "g")
    assert _reg(t, 3, "g") == []
    assert t.stats["group_full"] == 1 and t.resolve(3) is None
    t.check_invariants()


def test_views_are_immutable():
    t = SlotTable()
    _reg(t, 1, "g")
    t.apply(MemoryAllocated(1, 0, 5, 1))
    with pytest.raises(TypeError):
        t.process(1).used[0] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        t.stats["registered"] = 0  # type: ignore[index]
    with pytest.raises(AttributeError):
        t.groups()[0].name = "x"  # type: ignore[misc]


def test_check_invariants_catches_stale_slot():
    """Simulate the HAMi-core bug: a record whose slot index is outside proc_num."""
    t = SlotTable()
    for pid in (1, 2, 3):
        _reg(t, pid, "g")
    t._by_pid[3].slot = 5  # noqa: SLF001 - deliberately corrupt
    with pytest.raises(AssertionError, match="slot"):
        t.check_invariants()


def test_a_new_group_takes_the_index_the_maps_already_use():
    """A restarted daemon adopts its predecessor's maps: a group keeps its index."""
    t = SlotTable()
    [create, _] = t.apply(ProcessRegistered(ProcKey(10, 1), "a", index=7))
    assert create == CreateGroup("a", 7)
    # the index is taken from then on, and indices are never reused
    [create_b, _] = t.apply(ProcessRegistered(ProcKey(11, 1), "b", index=7))
    assert create_b.index == 8
    [create_c, _] = t.apply(ProcessRegistered(ProcKey(12, 1), "c"))
    assert create_c.index == 9
    # an existing group ignores the hint
    assert t.apply(ProcessRegistered(ProcKey(13, 1), "a", index=3))[0] == WriteSlot("a", 7, 1, ProcKey(13, 1))
    assert t.stats["index_adopted"] == 1
    t.check_invariants()


def test_kernel_counters_correct_a_lost_free_and_later_frees_stay_exact():
    t = SlotTable()
    _reg(t, 10, "a")
    t.apply(MemoryAllocated(10, 0, 100, 0x1000))
    t.apply(MemoryAllocated(10, 0, 50, 0x2000))
    t.apply(MemoryAllocated(10, 1, 30, 0x3000))
    # the free of 0x1000 was lost; the kernel's counters say 50 on device 0
    t.apply(UsageObserved(10, {0: 50, 1: 30}))
    assert dict(t.process(10).used) == {0: 50, 1: 30}
    assert dict(t.group("a").used) == {0: 50, 1: 30}
    assert t.stats["usage_corrected"] == 1
    # device 1 agreed: its pointer is still known and frees exactly
    t.apply(MemoryFreed(10, 0x3000))
    assert dict(t.process(10).used) == {0: 50}
    # device 0's bytes are unattributed: a free there is unknown until the counters say
    t.apply(MemoryFreed(10, 0x2000))
    assert t.stats["unknown_ptr"] == 1
    t.apply(UsageObserved(10, {}))
    assert dict(t.process(10).used) == {} and dict(t.group("a").used) == {}
    t.check_invariants()


def test_kernel_counters_for_another_start_time_are_ignored():
    t = SlotTable()
    _reg(t, 10, "a", start=5)
    t.apply(UsageObserved(10, {0: 99}, start_time=4))
    assert dict(t.process(10).used) == {}
    t.apply(UsageObserved(10, {0: -1}))
    assert t.stats["invalid_event"] == 1
