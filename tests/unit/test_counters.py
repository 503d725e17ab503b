"""Counter names shown or exported are ones the product produces."""
import re
from pathlib import Path

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
