import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, strategies as st

import hami_bpf
from hami_bpf.snapshot import (SCHEMA_VERSION, DeviceUsage, EventRecord, GroupInfo, ProcessInfo,
                               SlotInfo, Snapshot, example_snapshot, ps_json, slots_json,
                               usage_json)

SCHEMAS = Path(hami_bpf.__file__).parent / "schemas"


def schema(name):
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


def test_roundtrip_through_json_text():
    snap = example_snapshot()
    doc = json.loads(json.dumps(snap.to_json()))
    assert Snapshot.from_json(doc) == snap
    assert Snapshot.from_json(doc).to_json() == snap.to_json()


def test_device_keys_are_strings_in_json_and_ints_in_python():
    snap = example_snapshot()
    p = snap.processes[1]
    assert set(p.devices) == {0, 1}
    assert set(p.to_json()["devices"]) == {"0", "1"}
    assert p.to_json()["devices"]["1"] == {"used_bytes": 256 << 20, "limit_bytes": None}


def test_immutable():
    snap = example_snapshot()
    with pytest.raises(AttributeError):
        snap.taken_at = 0  # frozen dataclass
    with pytest.raises(TypeError):
        snap.processes[0].devices[5] = DeviceUsage(1, None)
    with pytest.raises(TypeError):
        snap.counters["denials"] = 9
    ev = EventRecord(1.0, "compact", "compacted", {"moves": [[2, 0]]})
    assert ev.data["moves"] == ((2, 0),)
    with pytest.raises(TypeError):
        ev.data["x"] = 1


def test_inputs_are_copied():
    devs = {0: DeviceUsage(1, 2)}
    p = ProcessInfo(1, 2, "c", "g", 0, devs, None)
    devs[1] = DeviceUsage(3, 4)
    assert list(p.devices) == [0]


def test_version_mismatch_is_a_clear_error():
    doc = example_snapshot().to_json()
    doc["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        Snapshot.from_json(doc)


def test_malformed_snapshot_is_value_error():
    with pytest.raises(ValueError, match="malformed"):
        Snapshot.from_json({"version": SCHEMA_VERSION, "processes": [{"pid": 1}]})


def test_query_documents_match_schemas():
    snap = example_snapshot()
    jsonschema.validate(ps_json(snap.processes), schema("ps"))
    jsonschema.validate(slots_json(snap.groups), schema("slots"))
    p = snap.processes[0]
    jsonschema.validate(usage_json(p, snap.group(p.group)), schema("usage"))
    jsonschema.validate(usage_json(p, None), schema("usage"))
    ev = EventRecord(1.5, "deny", "killed", {"pid": 1, "group": "g", "device": 0, "size": 2,
                                             "limit": 1, "paced": False, "action": "kill"}, seq=7)
    jsonschema.validate(ev.to_json(), schema("events"))
    assert ev.to_json()["what"] == "killed" and "killed" in ev.to_json()["message"]
    assert EventRecord.from_json(ev.to_json()) == ev


def test_schema_rejects_int_device_keys_shape():
    bad = ps_json(example_snapshot().processes)
    bad["processes"][0]["devices"]["gpu0"] = {"used_bytes": 1, "limit_bytes": None}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema("ps"))


usages = st.builds(DeviceUsage, st.integers(0, 1 << 50), st.none() | st.integers(0, 1 << 50))
procs = st.builds(ProcessInfo, pid=st.integers(1, 1 << 22), start_time=st.integers(0, 1 << 40),
                  comm=st.text(max_size=15), group=st.text(max_size=20), slot=st.integers(0, 63),
                  devices=st.dictionaries(st.integers(0, 15), usages, max_size=4),
                  launches=st.none() | st.integers(0, 1 << 40),
                  state=st.sampled_from(["running", "throttled", "stopped"]),
                  denied=st.integers(0, 1000), ns_pid=st.none() | st.integers(1, 1000))
groups = st.builds(GroupInfo, id=st.text(max_size=20), index=st.integers(0, 100),
                   proc_num=st.integers(0, 64),
                   slots=st.lists(st.builds(SlotInfo, st.integers(0, 63), st.integers(1, 1 << 22),
                                            st.integers(0, 1 << 40)), max_size=4).map(tuple),
                   devices=st.dictionaries(st.integers(0, 15), usages, max_size=4),
                   sm_limit=st.none() | st.integers(0, 100),
                   priority=st.integers(0, 10),
                   sm_lending=st.lists(st.integers(0, 15), max_size=3).map(tuple),
                   sm_turns=st.lists(st.integers(0, 15), max_size=3).map(tuple))


@given(st.lists(procs, max_size=5), st.lists(groups, max_size=3))
def test_roundtrip_property(ps, gs):
    snap = Snapshot(SCHEMA_VERSION, 1.0, False, {"memory": "uprobe"}, (), tuple(ps), tuple(gs),
                    {"events": 3})
    doc = json.loads(json.dumps(snap.to_json()))
    assert Snapshot.from_json(doc) == snap
    jsonschema.validate(ps_json(snap.processes), schema("ps"))
    jsonschema.validate(slots_json(snap.groups), schema("slots"))
