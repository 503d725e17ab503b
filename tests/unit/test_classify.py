"""Registration reads what a workload controls (its environment, cgroup and
comm): every value is parsed within bounds, and a process whose
classification fails is still tracked, with its group's policy limits.

Unit level: the pure parsers, and the registry of a daemon that was never
started (a stand-in for the BPF maps records what would be written)."""
from __future__ import annotations

import os
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import FakeProbes
from hami_bpf import abi, classify as classify_mod, grouplimits
from hami_bpf.config import DaemonConfig
from hami_bpf.classify import bounded_name, parse_environ
from hami_bpf.daemon import Daemon
from hami_bpf.devices import Devices
from hami_bpf.limits import (MEM_ENV, SM_ENV, LimitError, effective_limits, load_policy,
                             parse_env_limits, parse_size, physical_to_visible,
                             visible_to_physical)

GiB = 1 << 30
HUGE = "9" * 5000          # past Python's 4300-digit int() limit


def make_daemon(policy_text: str | None, group_by: str = "env:G", tmp=None) -> Daemon:
    d = Daemon(DaemonConfig(group_by=group_by, state_dir=str(tmp or "/nonexistent")))
    d.probes = FakeProbes()
    d.devices = Devices(2, True)
    d.limits.ctx_bytes = 0
    d.policy.current = load_policy(policy_text, "policy.toml") if policy_text else None
    return d


@pytest.fixture(scope="module")
def sleeper():
    p = subprocess.Popen(["sleep", "600"])
    yield p.pid
    p.kill()
    p.wait()


POLICY = '[default]\nmemory = "1Gi"\nsm = 50\n'


# ---------------------------------------------------------------- parsers

@pytest.mark.parametrize("name", [MEM_ENV, f"{MEM_ENV}_0", SM_ENV, f"{SM_ENV}_1",
                                  "CUDA_TASK_PRIORITY", "CUDA_VISIBLE_DEVICES"])
def test_a_5000_digit_value_is_malformed_not_an_error(name):
    limits, problems = parse_env_limits({name: HUGE})
    if name != "CUDA_VISIBLE_DEVICES":
        p = problems[0]
        assert len(problems) == 1 and len(f"{p.name}={p.value}: {p.reason}") < 300
        assert problems[0].name == name
    assert limits.memory is None and not limits.memory_per_device
    assert limits.sm is None and not limits.sm_per_device
    assert limits.priority is None


def test_a_5000_digit_device_suffix_is_not_a_device_index():
    limits, problems = parse_env_limits({f"{MEM_ENV}_{HUGE}": "1Gi", f"{SM_ENV}_{HUGE}": "10"})
    assert not limits.memory_per_device and not limits.sm_per_device
    assert len(problems) == 2


def test_sizes_past_the_bound_are_refused():
    with pytest.raises(LimitError):
        parse_size(HUGE)
    with pytest.raises(LimitError):
        parse_size("0x" + "f" * 5000)
    assert parse_size("  " * 10000 + "8Gi") == 8 * GiB   # blanks are not counted


def test_visible_devices_with_a_huge_entry_cut_the_list():
    cvd = f"1,{HUGE},0"
    assert visible_to_physical(0, cvd, {}) == 1
    assert visible_to_physical(1, cvd, {}) is None
    assert physical_to_visible(0, cvd, {}) is None


def test_visible_devices_read_at_most_a_bounded_list():
    cvd = ",".join(str(i) for i in range(200000))
    assert visible_to_physical(5, cvd, {}) == 5
    assert physical_to_visible(100000, cvd, {}) is None


def test_environ_parsing_drops_a_cut_last_item():
    raw = b"A=1\0B=2\0" + MEM_ENV.encode() + b"=10"
    assert parse_environ(raw) == {"A": "1", "B": "2", MEM_ENV: "10"}
    assert parse_environ(raw, truncated=True) == {"A": "1", "B": "2"}
    assert parse_environ(b"\xff\xfe=\x80\0=x\0novalue\0") == {"\ufffd\ufffd": "\ufffd", "": "x"}


def test_long_group_names_stay_distinct_and_bounded():
    a, b = "g" * 5000 + "a", "g" * 5000 + "b"
    assert len(bounded_name(a)) <= classify_mod.GROUP_NAME_MAX
    assert bounded_name(a) != bounded_name(b)
    assert bounded_name("short") == "short"


env_names = st.one_of(
    st.sampled_from([MEM_ENV, SM_ENV, "CUDA_TASK_PRIORITY", "CUDA_VISIBLE_DEVICES",
                     "GPU_CORE_UTILIZATION_POLICY", "CUDA_DEVICE_MEMORY_SHARED_CACHE", "G"]),
    st.builds(lambda p, s: p + "_" + s, st.sampled_from([MEM_ENV, SM_ENV]),
              st.one_of(st.text(max_size=8), st.just(HUGE), st.integers(0, 99).map(str))),
    st.text(max_size=20))
env_values = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="0123456789xXkKmMgGiB ,-+", max_size=60),
    st.integers(0, 10).map(lambda n: "9" * (4000 + 500 * n)),
    st.just(HUGE + "Gi"), st.just("0x" + "f" * 5000),
    st.just(",".join(["0"] * 3000)), st.just("GPU-" + "a" * 5000))
environments = st.dictionaries(env_names, env_values, max_size=8)


@given(environments)
def test_env_parsing_never_raises_and_only_lowers_the_policy(env):
    limits, problems = parse_env_limits(env)
    assert all(len(p.name) + len(p.value) < 1000 and p.reason for p in problems)
    policy = load_policy(POLICY, "p")
    for dev in range(2):
        vis = physical_to_visible(dev, env.get("CUDA_VISIBLE_DEVICES"), {})
        mem, sm = effective_limits(policy, "g", limits, dev, visible_index=vis)
        assert mem is not None and mem <= GiB
        assert sm is not None and sm <= 50


@given(st.binary(max_size=2000), st.booleans())
def test_environ_bytes_of_any_encoding_parse(raw, cut):
    env = parse_environ(raw, cut)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    parse_env_limits(env)


# ----------------------------------------------------------- registration

@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
          max_examples=int(os.environ.get("HAMI_HYPOTHESIS_EXAMPLES", "100")) // 10 or 10)
@given(environments)
def test_any_environment_registers_within_the_policy(sleeper, monkeypatch, env):
    monkeypatch.setattr(classify_mod, "read_environ", lambda pid: (dict(env), False))
    d = make_daemon(POLICY)
    d.registry.register(sleeper, 0, comm="w")
    view = d.registry.table.process(sleeper)
    assert view is not None, "a process must be tracked whatever its environment"
    assert sleeper in d.probes.proc_cfg
    for dev in range(2):
        lim = d.registry.table.limits(view.group).get(dev)
        assert lim is not None and lim <= GiB
    assert all(cap <= 50 for cap in d.sm.caps(view.group).values())


@pytest.mark.parametrize("stage", ["environment", "limits", "group", "pod"])
def test_a_failing_classification_step_keeps_the_process_tracked_with_policy_limits(
        sleeper, monkeypatch, stage):
    def boom(*_a, **_k):
        raise RuntimeError("injected")
    env = {"G": "grp", MEM_ENV: "4Gi", "CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setattr(classify_mod, "read_environ",
                        boom if stage == "environment" else (lambda pid: (dict(env), False)))
    if stage == "limits":
        monkeypatch.setattr(classify_mod, "parse_env_limits", boom)
    if stage == "group":
        monkeypatch.setattr(classify_mod, "group_of", boom)
    if stage == "pod":
        monkeypatch.setattr(classify_mod.containers, "describe", boom)
    d = make_daemon(POLICY)
    d.registry.register(sleeper, 0, comm="w")
    view = d.registry.table.process(sleeper)
    assert view is not None and sleeper in d.probes.proc_cfg
    # Both devices limited (a failed step's input, CUDA_VISIBLE_DEVICES
    # included, is not used, so every device counts as visible).
    if stage in ("environment", "limits"):
        assert d.registry.table.limits(view.group) == {0: GiB, 1: GiB}
    failed = [e for e in d.log if e.kind == "error" and "classify_failed" in e.data]
    assert [list(e.data["classify_failed"]) for e in failed] == [[stage]]
    assert failed[0].data["pid"] == sleeper


def test_failing_limits_fall_back_to_the_policy(sleeper, monkeypatch):
    monkeypatch.setattr(classify_mod, "read_environ",
                        lambda pid: ({"G": "grp", MEM_ENV: "2Gi"}, False))
    d = make_daemon(POLICY)
    real = grouplimits.effective_limits
    calls = []

    def flaky(policy, group, env, dev, **kw):
        calls.append(env)
        if env is not None:
            raise RuntimeError("injected")
        return real(policy, group, env, dev, **kw)
    monkeypatch.setattr(grouplimits, "effective_limits", flaky)
    d.registry.register(sleeper, 0, comm="w")
    view = d.registry.table.process(sleeper)
    assert d.registry.table.limits(view.group) == {0: GiB, 1: GiB}
    assert [list(e.data["classify_failed"]) for e in d.log
            if "classify_failed" in e.data] == [["limits"]]


def test_a_cut_environment_is_reported(sleeper, monkeypatch):
    monkeypatch.setattr(classify_mod, "read_environ", lambda pid: ({"G": "g"}, True))
    d = make_daemon(POLICY)
    d.registry.register(sleeper, 0)
    assert any(e.kind == "config" and e.data.get("pid") == sleeper for e in d.log)


def test_many_malformed_variables_are_recorded_a_bounded_number_of_times(sleeper, monkeypatch):
    env = {f"{MEM_ENV}_x{i}": "1" for i in range(1000)}
    monkeypatch.setattr(classify_mod, "read_environ", lambda pid: (env, False))
    d = make_daemon(None)
    d.registry.register(sleeper, 0)
    configs = [e for e in d.log if e.kind == "config"]
    assert len(configs) == classify_mod.PROBLEMS_SHOWN + 1
    assert abi.MAX_DEVS == len(d.registry.info[sleeper].phys)


# ------------------------------------------------------------------- exec

def _event(kind, pid, flags=0):
    e = abi.Event()
    e.kind, e.tgid, e.tid, e.flags = kind, pid, pid, flags
    return e


def test_an_exec_event_releases_the_process(sleeper, monkeypatch, tmp_path):
    from hami_bpf import enforce
    monkeypatch.setattr(classify_mod, "read_environ", lambda pid: ({"G": "g"}, False))
    d = make_daemon(POLICY)
    d.stopped = enforce.StoppedSet(str(tmp_path))
    d.registry.register(sleeper, 0)
    assert d.registry.table.process(sleeper) is not None
    d._route(_event(abi.EV_EXEC, sleeper))
    assert d.registry.table.process(sleeper) is None
    assert [e.data["pid"] for e in d.log if e.kind == "exec"] == [sleeper]


def test_a_registered_process_held_at_cuinit_is_a_new_image(sleeper, monkeypatch, tmp_path):
    # Its exec event was lost: BPF held it at cuInit because it has no
    # proc_cfg. It is registered again (its proc_cfg written) and resumed.
    from hami_bpf import enforce
    monkeypatch.setattr(classify_mod, "read_environ", lambda pid: ({"G": "g"}, False))
    d = make_daemon(POLICY)
    d.stopped = enforce.StoppedSet(str(tmp_path))
    d.registry.register(sleeper, 0)
    d.probes.proc_cfg.clear()            # what the exec program did
    d.probes.gate_wait.add(sleeper)      # what the cuInit probe did
    d._route(_event(abi.EV_INIT, sleeper, abi.F_STOPPED))
    assert d.registry.table.process(sleeper) is not None
    assert sleeper in d.probes.proc_cfg
    assert [e.data["pid"] for e in d.log if e.kind == "exec"] == [sleeper]
    assert sleeper not in d.stopped


def test_a_hold_at_cuinit_whose_event_was_lost_is_released_by_the_scan(sleeper, monkeypatch,
                                                                      tmp_path):
    """The ring buffer was full: no INIT event. The tick's scan of gate_wait
    registers and resumes the process; its event, should it come late,
    resumes nothing a second time."""
    from hami_bpf import enforce
    resumed = []
    monkeypatch.setattr(enforce, "resume", resumed.append)
    monkeypatch.setattr(classify_mod, "read_environ", lambda pid: ({"G": "g"}, False))
    d = make_daemon(POLICY)
    d.stopped = enforce.StoppedSet(str(tmp_path))
    d.probes.gate_wait.add(sleeper)
    d.registry.release_gated()
    assert d.registry.table.process(sleeper) is not None and sleeper in d.probes.proc_cfg
    assert resumed == [sleeper] and sleeper not in d.stopped
    assert d.counters["gate_scan_claims"] == 1
    d._route(_event(abi.EV_INIT, sleeper, abi.F_STOPPED))
    d.registry.release_gated()
    assert resumed == [sleeper]
