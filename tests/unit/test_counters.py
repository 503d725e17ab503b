"""Counter names shown or exported are ones the product produces."""
import re
from pathlib import Path

import pytest

from cli import render
from hami_bpf import counters, metrics, snapshot

ROOT = Path(__file__).resolve().parents[2]


def test_render_lists_only_produced_counters():
    unknown = [k for k in render._COUNTER_ORDER if not counters.known(k)]
    assert unknown == []


def test_metrics_export_only_produced_counters():
    names = [v for k, v in vars(snapshot).items() if k.startswith("COUNTER_")]
    names += [m[1] for m in metrics._COUNTERS]
    assert names and [k for k in names if not counters.known(k)] == []


def test_daemon_counters_are_declared():
    # Every component counts into the daemon's one Counter.
    src = "".join(p.read_text() for p in sorted((ROOT / "hami_bpf").rglob("*.py")))
    used = set(re.findall(r'counters\["([a-z_0-9]+)"\]', src))
    prefixes = set(re.findall(r'counters\[f"([a-z_0-9]+)\{', src))
    assert used, "the controller no longer counts anything by literal name"
    assert sorted(k for k in used if not counters.known(k)) == []
    assert sorted(prefixes - set(counters.DAEMON_COUNTER_PREFIXES)) == []


def test_known_rejects_unknown_names():
    assert not counters.known("no_such_counter")
    assert counters.known("bpf_throttles") and counters.known("registered")


def test_render_marks_and_hides_only_produced_counters():
    assert [k for k in render._COUNTERS_BAD if not counters.known(k)] == []
    assert set(render._COUNTERS_HIDDEN) <= set(counters.DAEMON_COUNTER_PREFIXES)


def test_metrics_families_are_produced_counters():
    assert [k for k in metrics.PROBE_ERROR_KINDS if not counters.known(k)] == []
    assert {m[1] for m in metrics._SM_LABELLED} <= set(counters.DAEMON_COUNTER_PREFIXES)
    names = [metrics.EXIT_LATENCY_COUNT, metrics.EXIT_LATENCY_SUM,
             metrics.EXIT_LATENCY_BUCKET.format(metrics.EXIT_LATENCY_BUCKETS_NS[0])]
    assert [k for k in names if not counters.known(k)] == []
    c = counters.Counters()
    metrics.observe_exit_latency(c, 10 ** 12)      # past every bucket
    metrics.observe_exit_latency(c, 0)             # in every bucket
    assert c[metrics.EXIT_LATENCY_COUNT] == 2


def test_the_daemons_counters_refuse_undeclared_names():
    c = counters.Counters()
    c["events"] += 1
    c["sm_mode_duty"] += 2                 # a declared family
    assert c["denials"] == 0 and "denials" not in c
    with pytest.raises(KeyError):
        c["no_such_counter"] += 1
    with pytest.raises(KeyError):
        c["no_such_counter"]
    with pytest.raises(KeyError):
        c.update({"no_such_counter": 1})
    assert dict(c) == {"events": 1, "sm_mode_duty": 2}


def test_the_daemon_counts_into_checked_counters(tmp_path):
    from hami_bpf.config import DaemonConfig
    from hami_bpf.daemon import Daemon
    d = Daemon(DaemonConfig(state_dir=str(tmp_path)))
    assert isinstance(d.counters, counters.Counters)
    assert d.sm.counters is d.counters and d.registry.counters is d.counters
