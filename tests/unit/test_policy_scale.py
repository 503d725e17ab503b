"""Policy files of many rules: loading reads the text a bounded number of
times, lookups agree with a plain first-match, and a reload reads the file
off the loop's thread (the loop keeps handling events meanwhile)."""
from __future__ import annotations

import fnmatch
import threading

from hypothesis import given
from hypothesis import strategies as st

from hami_bpf import limits
from hami_bpf.limits import GroupRule, LimitSpec, Policy, load_policy


def many_rules(n: int) -> str:
    return '[default]\nmemory = "8Gi"\n' + "".join(
        f'[[group]]\nmatch = "/kubepods/pod{i}*"\nmemory = "{i % 7 + 1}Gi"\n' for i in range(n))


def test_loading_scans_each_line_a_bounded_number_of_times(monkeypatch):
    text = many_rules(500)
    calls = []
    real = limits._HEADER_RE

    class Counting:
        def match(self, line):
            calls.append(line)
            return real.match(line)
    monkeypatch.setattr(limits, "_HEADER_RE", Counting())
    p = load_policy(text, "p")
    assert len(p.rules) == 500
    assert len(calls) <= 2 * len(text.splitlines())


patterns = st.text(alphabet="ab*?[]/", max_size=6)
names = st.text(alphabet="ab/[]", max_size=6)


@given(st.lists(patterns, max_size=12), st.lists(names, max_size=8))
def test_lookup_is_the_first_match_in_file_order(pats, groups):
    rules = tuple(GroupRule(pat, LimitSpec(memory=i + 1)) for i, pat in enumerate(pats))
    p = Policy("p", LimitSpec(memory=10**9), rules)
    for g in groups + pats:
        want = next((r.limits for r in rules if fnmatch.fnmatchcase(g, r.match)), p.default)
        assert p.limits_for(g) == want
        assert p.limits_for(g) == want      # and again, remembered


def test_a_reload_reads_the_file_off_the_loops_thread(monkeypatch, tmp_path):
    from hami_bpf.config import DaemonConfig
    from hami_bpf.daemon import Daemon
    from fakes import FakeProbes

    d = Daemon(DaemonConfig(policy=str(tmp_path / "p.toml"), state_dir=str(tmp_path)))
    d.probes = FakeProbes()
    old = d.policy.current = load_policy(many_rules(1), "old")
    release = threading.Event()
    seen = {}

    def slow_read(path):
        seen["thread"] = threading.current_thread()
        seen["waited"] = release.wait(10)
        return load_policy(many_rules(2), "new")
    monkeypatch.setattr(d.policy, "read", slow_read)
    d.policy.reload()
    # Returned while the file is still being read; nothing changed yet.
    assert d.policy.current is old and not d.policy.asked
    release.set()
    d.policy.wait(10)
    assert seen["thread"] is not threading.current_thread() and seen["waited"]
    assert d.policy.asked        # the loop is asked to apply it
    d.policy.asked = False
    d.policy.reload()
    assert d.policy.current is not old and d.policy.current.source == "new"
    assert d.counters["policy_reloads"] == 1


def test_a_refused_reload_keeps_the_policy(monkeypatch, tmp_path):
    from hami_bpf.config import DaemonConfig
    from hami_bpf.daemon import Daemon, DaemonError
    from fakes import FakeProbes

    d = Daemon(DaemonConfig(policy=str(tmp_path / "p.toml"), state_dir=str(tmp_path)))
    d.probes = FakeProbes()
    old = d.policy.current = load_policy(many_rules(1), "old")

    def bad(path):
        raise DaemonError("--policy p: refused")
    monkeypatch.setattr(d.policy, "read", bad)
    d.policy.reload()
    d.policy.wait(10)
    d.policy.reload()
    assert d.policy.current is old
    assert any((e.kind, e.what) == ("error", "policy_failed") and "refused" in e.data["error"]
               for e in d.log)
