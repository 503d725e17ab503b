"""--policy reloads (policyfile.PolicyFile) driven directly: the file is read
off the loop's thread, applied at the loop's next turn, and a file that fails
leaves the previous policy in force. The reader is injected, so the file's
ownership checks (tests/unit/test_policy_path.py, root only) are not needed."""
from __future__ import annotations

import threading

import pytest

from hami_bpf.counters import Counters
from hami_bpf.eventlog import EventLog
from hami_bpf.limits import PolicyError, load_policy
from hami_bpf.policyfile import DaemonError, PolicyFile

GiB = 1 << 30


def parse(path):
    """read_policy without its ownership checks."""
    with open(path) as f:
        text = f.read()
    try:
        return load_policy(text, str(path))
    except PolicyError as e:
        raise DaemonError(str(e)) from None


class World:
    def __init__(self, path, read=parse):
        self.log = EventLog()
        self.counters = Counters()
        self.applied = []
        self.pf = PolicyFile(str(path) if path else None, record=self.log.record,
                             counters=self.counters,
                             applied=lambda: self.applied.append(self.pf.current), read=read)

    def events(self):
        return [(e.kind, e.what, dict(e.data)) for e in self.log]

    def sighup(self):
        """SIGHUP, then the loop's turns until the reading thread's result is applied."""
        self.pf.request()
        self.pf.due()                 # starts the reading thread
        self.pf.wait(5)
        assert self.pf.asked          # the thread asks the loop to apply its result
        self.pf.due()


def memory(policy, group="any"):
    return policy.limits_for(group).memory_limit(0)


@pytest.fixture
def policy(tmp_path):
    p = tmp_path / "policy.toml"
    p.write_text('[default]\nmemory = "4Gi"\n')
    return p


def test_load_reads_the_file_and_without_a_path_there_is_no_policy(policy):
    w = World(policy)
    w.pf.load()
    assert memory(w.pf.current) == 4 * GiB
    n = World(None, read=lambda p: pytest.fail("read without --policy"))
    n.pf.load()
    assert n.pf.current is None


def test_a_reload_picks_up_the_changed_file(policy):
    w = World(policy)
    w.pf.load()
    policy.write_text('[default]\nmemory = "8Gi"\n')
    w.sighup()
    assert memory(w.pf.current) == 8 * GiB
    assert w.applied == [w.pf.current]
    assert w.counters["policy_reloads"] == 1
    assert w.events() == [("config", "policy_reloaded", {"policy": str(policy)})]


def test_the_previous_policy_stays_in_force_until_the_loop_applies_the_new_one(policy):
    gate = threading.Event()

    def slow(path):
        gate.wait(5)
        return parse(path)
    w = World(policy, read=slow)
    w.pf.current = old = parse(policy)
    policy.write_text('[default]\nmemory = "8Gi"\n')
    w.pf.request()
    w.pf.due()
    assert w.pf.current is old and not w.applied     # still reading
    gate.set()
    w.pf.wait(5)
    assert w.pf.current is old                       # read, not yet applied
    w.pf.due()
    assert memory(w.pf.current) == 8 * GiB


def test_a_malformed_file_leaves_the_previous_policy_and_records_an_error(policy):
    w = World(policy)
    w.pf.load()
    old = w.pf.current
    policy.write_text('[default]\nmemory = \n')
    w.sighup()
    assert w.pf.current is old and not w.applied
    assert w.counters["policy_reloads"] == 0
    ((kind, what, data),) = w.events()
    assert (kind, what) == ("error", "policy_failed") and data["error"]
    policy.write_text('[default]\nmemory = "2Gi"\n')   # fixed: the next SIGHUP takes it
    w.sighup()
    assert memory(w.pf.current) == 2 * GiB and w.counters["policy_reloads"] == 1


def test_a_reader_failing_unexpectedly_is_reported_with_the_path(policy):
    def broken(path):
        raise OSError("disk gone")
    w = World(policy, read=broken)
    w.sighup()
    ((kind, what, data),) = w.events()
    assert (kind, what) == ("error", "policy_failed")
    assert str(policy) in data["error"] and "disk gone" in data["error"]
    assert w.pf.current is None


def test_sighup_without_a_policy_says_so(policy):
    w = World(None, read=lambda p: pytest.fail("read without --policy"))
    w.pf.request()
    w.pf.due()
    assert w.events() == [("config", "no_policy", {})]
    assert not w.pf.asked and w.counters["policy_reloads"] == 0


def test_a_sighup_while_reading_reads_the_file_once_more(policy):
    gate, first_read = threading.Event(), threading.Event()
    reads = []

    def slow(path):
        reads.append(path)
        got = parse(path)           # the file as it was when this read began
        if len(reads) == 1:
            first_read.set()
            gate.wait(5)
        return got
    w = World(policy, read=slow)
    w.pf.request()
    w.pf.due()                                       # first read starts
    assert first_read.wait(5)
    policy.write_text('[default]\nmemory = "8Gi"\n')  # changed while it reads
    w.pf.request()
    w.pf.due()                                       # a second SIGHUP meanwhile
    gate.set()
    w.pf.wait(5)
    w.pf.due()                                       # applies the first, starts the second
    assert memory(w.applied[0]) == 4 * GiB
    w.pf.wait(5)
    w.pf.due()                                       # applies the second
    assert len(reads) == 2
    assert memory(w.pf.current) == 8 * GiB
    assert w.counters["policy_reloads"] == 2
    assert [what for _, what, _ in w.events()] == ["policy_reloaded", "policy_reloaded"]


def test_a_request_only_asks_the_loop_does_the_reading(policy):
    w = World(policy, read=lambda p: pytest.fail("read in the signal handler"))
    w.pf.request()
    assert w.pf.asked and w.pf.current is None and not w.events()
