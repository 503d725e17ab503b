"""The event log's kinds and types are declared once (eventtext): every
component records only declared types with their fields, the CLI styles each
kind, and the human line is rendered from the payload without ever failing."""
import ast
import logging
import re
from pathlib import Path

import pytest

from cli.events import KIND_STYLE
from hami_bpf import eventtext
from hami_bpf.eventlog import EventLog, Kind
from hami_bpf.snapshot import EventRecord

ROOT = Path(__file__).resolve().parents[2]

# Payload values for fields whose text needs a shape; any other field gets 1.
SAMPLE = {
    "group": "g", "comm": "python", "moves": [{"pid": 9, "from": 2, "to": 0}],
    "before": {"0": 1}, "after": {"0": 2}, "reasons": ["bad env"], "classify_failed": ["env"],
    "outcome": "learned", "released": ["a", "b"], "held": ["b"], "turns": {"a": 0.5, "b": 0.5},
    "gains": {"a": 1.2, "b": 1.0}, "pids": [7, 8], "sm_mode": "duty", "lending": True,
    "limit": None, "sm": None, "contended": True, "launcher_bound": False,
    "probe_share": 0.02, "by_completion": True, "paced": True,
}


def _sample(t: eventtext.EventType) -> dict:
    return {f: SAMPLE.get(f, 1) for f in t.fields}


def _record_calls():
    """(file, line, first argument, second argument) of every call named
    record/_record in the controller's source."""
    for p in sorted((ROOT / "hami_bpf").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("record", "_record")):
                yield p.name, node.lineno, node.args[:1], node.args[1:2]


def test_every_kind_has_a_terminal_style():
    assert set(KIND_STYLE) == set(Kind)
    assert KIND_STYLE.get("deny") == KIND_STYLE[Kind.DENY]   # looked up by the wire's string


def test_every_declared_type_renders_from_its_fields_alone():
    for t in eventtext.TYPES:
        line = eventtext.render(t.kind.value, t.what, _sample(t))
        assert "cannot render" not in line, line
        assert line and "\n" not in line


def test_every_record_call_names_a_declared_type():
    calls = list(_record_calls())
    assert len(calls) > 40, "the controller no longer records by literal type"
    declared = {(t.kind.value, t.what) for t in eventtext.TYPES}
    whats = {t.what for t in eventtext.TYPES}
    bad = []
    for name, line, kind, what in calls:
        if not what or not isinstance(what[0], ast.Constant) or not isinstance(what[0].value, str):
            bad.append((name, line, "the type is not a literal"))
        elif kind and isinstance(kind[0], ast.Constant):
            if (kind[0].value, what[0].value) not in declared:
                bad.append((name, line, kind[0].value, what[0].value))
        elif what[0].value not in whats:   # the kind is chosen at run time
            bad.append((name, line, what[0].value))
    assert bad == []
    # ... from a caller's literal: libwatch._refuse(..., kind="config")
    src = "".join(p.read_text() for p in sorted((ROOT / "hami_bpf").rglob("*.py")))
    assert sorted(set(re.findall(r'kind="([a-z_]+)"', src)) - {k.value for k in Kind}) == []


def test_every_declared_type_is_recorded_somewhere():
    used = {what[0].value for _n, _l, _k, what in _record_calls()
            if what and isinstance(what[0], ast.Constant)}
    assert sorted(t.what for t in eventtext.TYPES if t.what not in used) == []


def test_records_carry_their_type_payload_and_sequence():
    log = EventLog(maxlen=2)
    log.record("register", "registered", pid=1, comm="x", group="g", slot=0)
    log.record(Kind.COMPACT, "compacted", group="g", removed=1, moves=[])
    log.record("group", "deleted", group="g")
    recs = log.since(0)
    assert [(r.kind, r.what) for r in recs] == [("compact", "compacted"), ("group", "deleted")]
    assert [r.seq for r in recs] == [2, 3]
    assert recs[0].data["removed"] == 1 and log.since(2)[0].data == {"group": "g"}


def test_the_log_line_is_rendered_from_the_payload(caplog):
    with caplog.at_level(logging.DEBUG, logger="hami_bpf"):
        EventLog().record("group", "deleted", group="g")
    assert caplog.messages == ["group 'g' is empty: deleted"]


@pytest.mark.parametrize("kind,what,data", [
    ("no_such_kind", "deleted", {"group": "g"}),
    ("group", "no_such_type", {"group": "g"}),
    ("register", "deleted", {"group": "g"}),        # declared, in another kind
    ("group", "deleted", {}),                        # a field missing
    ("compact", "compacted", {"group": "g", "removed": 1}),
])
def test_an_undeclared_type_or_missing_field_is_refused(kind, what, data):
    log = EventLog()
    with pytest.raises(ValueError):
        log.record(kind, what, **data)
    assert log.since(0) == []


@pytest.mark.parametrize("kind,what,data", [
    ("group", "deleted", {}),                                   # a field missing
    ("compact", "compacted", {"group": "g", "removed": 1, "moves": 3}),
    ("throttle", "turns_rescaled", {"device": 0, "gains": {}, "util": "x", "target": None}),
    ("throttle", "corrected", {k: "?" for k in eventtext.BY_KEY["throttle", "corrected"].fields}),
    ("no_such_kind", "x", {"a": object()}),                     # not even JSON-able
    ("deny", "newer_type", {"pid": 1}),                         # from a newer daemon
])
def test_rendering_a_malformed_record_says_so_and_never_raises(kind, what, data):
    line = eventtext.render(kind, what, data)
    assert line.startswith(f"{kind}/{what}: cannot render")
    e = EventRecord(1.0, kind, what, {k: v for k, v in data.items() if k != "a"})
    assert e.message.startswith(f"{kind}/{what}") and e.to_json()["message"] == e.message
