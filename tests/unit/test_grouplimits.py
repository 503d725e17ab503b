"""GroupLimits.check_unseen: memory the driver counts and no probed call
charged comes off the group's admission limit, and goes back."""
import collections
from types import SimpleNamespace as NS

from hami_bpf.grouplimits import GroupLimits

MiB = 1 << 20


class Devices:
    count, has_process_memory = 1, True

    def __init__(self):
        self.held = {}
        self.reads = 0

    def process_memory(self, dev):
        self.reads += 1
        return dict(self.held)


def world(limit=64 * MiB, count_unseen=True):
    members = {7: NS(pid=7, used={0: 8 * MiB}, group="g"), 8: NS(pid=8, used={0: 1 * MiB}, group="g")}
    group = NS(name="g", index=3, limits={0: limit}, slots=[NS(pid=p) for p in members])
    table = NS(group=lambda name: group if name == "g" else None, process=members.get)
    set_limits, events = [], []
    probes = NS(set_group_limit=lambda gi, dev, admit, limit: set_limits.append((gi, dev, admit, limit)))
    devices = Devices()
    counters = collections.Counter()
    gl = GroupLimits(table=lambda: table, info=lambda pid: None, policy=None, sm=None,
                     probes=lambda: probes, devices=lambda: devices, env_limits=False,
                     record=lambda kind, what, **d: events.append((kind, what, d)), counters=counters,
                     count_unseen=count_unseen)
    return gl, devices, set_limits, events, counters


def test_unseen_bytes_come_off_the_admission_limit_and_go_back():
    gl, dev, set_limits, events, counters = world()
    dev.held = {7: 48 * MiB, 8: 1 * MiB, 99: 500 * MiB}     # 99: not a registered process
    gl.check_unseen()
    assert set_limits == []                                  # one reading: not yet
    gl.check_unseen()
    assert set_limits == [(3, 0, 64 * MiB - 40 * MiB, 64 * MiB)]
    (kind, what, d), = events
    assert (kind, what) == ("limit", "unseen")
    assert (d["pid"], d["group"], d["device"], d["held"], d["charged"], d["unseen"]) == \
        (7, "g", 0, 48 * MiB, 8 * MiB, 40 * MiB)
    assert gl.reserved("g", 0) == 40 * MiB and counters["memory_unseen_changes"] == 1

    dev.held = {7: 8 * MiB, 8: 1 * MiB}                     # the module was unloaded
    gl.check_unseen()
    assert set_limits[-1] == (3, 0, 64 * MiB, 64 * MiB)
    assert events[-1][2]["unseen"] == 0 and gl.reserved("g", 0) == 0


def test_a_member_that_leaves_takes_its_unseen_bytes_along():
    gl, dev, set_limits, events, _ = world()
    dev.held = {7: 48 * MiB}
    gl.check_unseen()
    gl.check_unseen()
    assert gl.forget_process(7) == [0]
    assert gl.unseen_bytes("g", 0) == 0


def test_without_a_per_process_count_nothing_is_read():
    gl, dev, set_limits, events, _ = world()
    dev.has_process_memory = False
    dev.held = {7: 48 * MiB}
    for _ in range(3):
        gl.check_unseen()
    assert set_limits == [] and events == []


def test_no_unseen_memory_reads_nothing():
    gl, dev, set_limits, events, _ = world(count_unseen=False)
    dev.held = {7: 48 * MiB}
    for _ in range(3):
        gl.check_unseen()
    assert dev.reads == 0 and set_limits == [] and events == []
