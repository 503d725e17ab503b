"""The event log's kinds are declared once (eventlog.Kind): every component
records only those, and the CLI styles each of them."""
import re
from pathlib import Path

import pytest

from cli.events import KIND_STYLE
from hami_bpf.eventlog import EventLog, Kind

ROOT = Path(__file__).resolve().parents[2]


def test_every_literal_kind_recorded_is_declared():
    src = "".join(p.read_text() for p in sorted((ROOT / "hami_bpf").rglob("*.py")))
    used = set(re.findall(r'record\(\s*"([a-z_]+)"', src))
    used |= set(re.findall(r'kind="([a-z_]+)"', src))
    assert used, "nothing records by literal kind any more"
    assert sorted(used - {k.value for k in Kind}) == []


def test_every_kind_has_a_terminal_style():
    assert set(KIND_STYLE) == set(Kind)
    assert KIND_STYLE.get("deny") == KIND_STYLE[Kind.DENY]   # looked up by the wire's string


def test_records_carry_their_payload_and_sequence():
    log = EventLog(maxlen=2)
    log.record("register", "pid 1 registered", pid=1, group="g", slot=0)
    log.record(Kind.COMPACT, "compacted", group="g", removed=1, moves=[])
    log.record("group", "deleted", group="g")
    recs = log.since(0)
    assert [r.kind for r in recs] == ["compact", "group"]
    assert [r.seq for r in recs] == [2, 3]
    assert recs[0].data["removed"] == 1 and log.since(2)[0].data == {"group": "g"}


def test_an_undeclared_kind_is_refused():
    with pytest.raises(ValueError):
        EventLog().record("no_such_kind", "x")
