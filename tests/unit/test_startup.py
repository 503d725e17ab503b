"""Start-up's decisions that need no root, BPF or GPU: which OOM action and
memory-info mechanism a kernel's features allow, the config flags BPF is
given, the daemon's CPU priority, where libnvidia-ml is found, and what each
says in `mechanisms` and the event log."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from hami_bpf import abi, probes, startup
from hami_bpf.bpfhost import Features
from hami_bpf.config import DaemonConfig
from hami_bpf.counters import Counters
from hami_bpf.eventlog import EventLog
from hami_bpf.policyfile import DaemonError


def feats(ringbuf=True, send_signal=True, probe_write_user=True, reg_write=True, atomics=True,
          errors=None):
    return Features(ringbuf, send_signal, probe_write_user, reg_write, atomics, errors or {})


class World:
    def __init__(self, tmp_path, **cfg):
        self.log = EventLog()
        self.counters = Counters()
        self.mechanisms: dict = {}
        cfg.setdefault("state_dir", str(tmp_path / "state"))
        self.s = startup.Startup(DaemonConfig(**cfg), mechanisms=self.mechanisms,
                                 record=self.log.record, counters=self.counters)

    def events(self):
        return [(e.kind, e.what, dict(e.data)) for e in self.log]


class Maps:
    """The probes as config_flags calls them."""

    def __init__(self, open_gate=True, error=""):
        self.open_gate, self.open_gate_error = open_gate, error
        self.config = self.graph_cost = None

    def set_config(self, **kw):
        self.config = kw

    def set_graph_cost(self, cost):
        self.graph_cost = cost


@pytest.mark.parametrize("f, oom, meminfo", [
    (feats(), "return-oom", "probe-write-user"),
    (feats(reg_write=False), "stop-rewrite", "probe-write-user"),
    (feats(reg_write=False, probe_write_user=False), "stop-rewrite", "stop-write"),
    (feats(reg_write=False, send_signal=False), "observe", "probe-write-user"),
    (feats(reg_write=False, send_signal=False, probe_write_user=False), "observe", "off"),
])
def test_auto_takes_the_best_mechanisms_the_kernel_allows(f, oom, meminfo):
    assert startup.choose_mechanisms(f, "auto") == (oom, meminfo)


def test_an_explicit_oom_action_is_kept():
    for want in ("kill", "observe", "stop-rewrite", "return-oom"):
        assert startup.choose_mechanisms(feats(), want)[0] == want
    assert set(startup.OOM_ACTIONS) == {"return-oom", "stop-rewrite", "kill", "observe"}
    assert len(set(startup.OOM_ACTIONS.values())) == 4


def test_sm_caps_are_off_without_bpf_send_signal():
    assert startup.sm_mechanism(feats(send_signal=False)).startswith("off")
    assert not startup.sm_mechanism(feats()).startswith("off")


def test_features_fill_the_mechanisms_and_give_the_oom_action(tmp_path, monkeypatch):
    w = World(tmp_path, count_launches=True)
    monkeypatch.setattr(probes, "probe_features", lambda: feats(ringbuf=False))
    f, action, reg_write, pwu = w.s.features()
    assert (action, reg_write, pwu) == (abi.ACT_RETURN_OOM, True, True)
    m = w.mechanisms
    assert (m["oom"], m["meminfo"], m["events"], m["launch"]) == (
        "return-oom", "probe-write-user", "none", "counting uprobes")
    w = World(tmp_path, oom_action="observe")
    monkeypatch.setattr(probes, "probe_features", lambda: feats())
    _f, action, reg_write, _ = w.s.features()
    assert (action, reg_write) == (abi.ACT_OBSERVE, False)      # registers not written
    assert w.mechanisms["launch"] == "off" and w.mechanisms["events"] == "ringbuf"


@pytest.mark.parametrize("want, f", [
    ("return-oom", feats(reg_write=False, errors={"reg_write": "R0 !read_ok"})),
    ("stop-rewrite", feats(send_signal=False)),
    ("kill", feats(send_signal=False)),
])
def test_an_oom_action_the_kernel_refuses_stops_the_start(tmp_path, monkeypatch, want, f):
    w = World(tmp_path, oom_action=want)
    monkeypatch.setattr(probes, "probe_features", lambda: f)
    with pytest.raises(DaemonError, match=want):
        w.s.features()


def config_flags(w, maps, f=feats(), gate_missing=None, gate_init=True):
    w.mechanisms.setdefault("meminfo", "probe-write-user")
    w.s.config_flags(maps, feats=f, gate_missing=gate_missing, gate_init=gate_init,
                     oom_action=abi.ACT_KILL)
    return maps.config["flags"]


def test_config_flags_follow_the_mechanisms(tmp_path):
    w, maps = World(tmp_path), Maps()
    flags = config_flags(w, maps)
    assert flags == (abi.CFG_ENFORCE_MEM | abi.CFG_VIRT_MEMINFO | abi.CFG_GATE_INIT
                     | abi.CFG_GATE_LIBS)
    assert maps.config["oom_action"] == abi.ACT_KILL
    assert maps.config["stale_ns"] == startup.HEARTBEAT_STALE_NS
    assert maps.graph_cost == startup.GRAPH_COST
    assert w.mechanisms["admission"] == "gated at cuInit"
    assert w.mechanisms["private_libs"] == "held at open until probed"
    assert not w.events()


def test_no_gate_at_cuinit_without_send_signal_and_no_meminfo_when_off(tmp_path):
    w, maps = World(tmp_path), Maps()
    w.mechanisms["meminfo"] = "off"
    flags = config_flags(w, maps, f=feats(send_signal=False))
    assert flags == abi.CFG_ENFORCE_MEM | abi.CFG_GATE_LIBS
    assert w.mechanisms["admission"] == "from first classified call"
    w2, maps2 = World(tmp_path), Maps()
    assert not config_flags(w2, maps2, gate_init=False) & abi.CFG_GATE_INIT


def test_the_open_gate_refused_by_the_kernel_falls_back_to_scanning(tmp_path):
    w, maps = World(tmp_path), Maps(open_gate=False, error="EINVAL")
    flags = config_flags(w, maps)
    assert not flags & abi.CFG_GATE_LIBS
    ((kind, what, data),) = w.events()
    assert (kind, what) == ("fallback", "open_gate") and "EINVAL" in data["reason"]
    assert w.mechanisms["private_libs"].startswith("found by scanning /proc")
    w2, maps2 = World(tmp_path), Maps()
    flags = config_flags(w2, maps2, gate_missing="no tracepoint x")
    assert not flags & abi.CFG_GATE_LIBS and not w2.events()     # said where it was found
    assert "no tracepoint x" in w2.mechanisms["private_libs"]


def test_the_daemons_priority_is_raised_and_a_refusal_is_said(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(os, "setpriority", lambda which, who, prio: asked.append(prio))
    monkeypatch.setattr(os, "getpriority", lambda which, who: startup.CONTROL_NICE)
    w = World(tmp_path)
    w.s.raise_priority()
    assert asked == [startup.CONTROL_NICE]
    assert w.mechanisms["control_priority"] == f"nice {startup.CONTROL_NICE}" and not w.events()

    def refuse(which, who, prio):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(os, "setpriority", refuse)
    monkeypatch.setattr(os, "getpriority", lambda which, who: 0)
    w = World(tmp_path)
    w.s.raise_priority()
    assert w.mechanisms["control_priority"] == "nice 0"
    ((kind, what, data),) = w.events()
    assert (kind, what, data["nice"]) == ("config", "nice", startup.CONTROL_NICE)
    assert data["error"]


def test_a_state_write_failure_is_counted_and_recorded(tmp_path):
    w = World(tmp_path)
    w.s.state_write_failed("writing the stop record", errno.ENOSPC)
    assert w.counters["state_write_errors"] == 1
    ((kind, what, data),) = w.events()
    assert (kind, what) == ("error", "state_write_failed")
    assert (data["path"], data["errno"], data["state_write_failed"]) == (
        str(tmp_path / "state"), errno.ENOSPC, True)


def test_without_a_pin_dir_state_is_kept_in_this_process(tmp_path):
    w = World(tmp_path, pin_dir=None)
    assert w.s.prepare_kept_state() is None and not w.s.adopting
    assert w.mechanisms["state"].startswith("in this process only")


def test_the_launch_probes_cost_is_measured_only_with_sm_limits(tmp_path, monkeypatch):
    w = World(tmp_path, sm_limits=False)
    assert w.s.measure_probe_cost(None, [Path("/lib/libcuda.so.1")]) == 0.0
    assert "launch_probe_cost" not in w.mechanisms

    class Failing:
        def measure_launch_probe_cost(self, lib):
            raise RuntimeError("no uprobe")
    w = World(tmp_path, sm_limits=True)
    assert w.s.measure_probe_cost(Failing(), [Path("/lib/libcuda.so.1")]) == 0.0
    ((kind, what, data),) = w.events()
    assert (kind, what, data["lib"]) == ("fallback", "probe_cost", "/lib/libcuda.so.1")
    assert w.mechanisms["launch_probe_cost"].startswith("unknown")


def test_libnvml_is_found_beside_libcuda_else_through_ld_so(tmp_path, monkeypatch):
    beside = tmp_path / "drv"
    beside.mkdir()
    (beside / "libcuda.so.1").touch()
    (beside / "libnvidia-ml.so.1").touch()
    assert startup.find_libnvml(beside / "libcuda.so.1") == (beside / "libnvidia-ml.so.1").resolve()
    compat = tmp_path / "compat"
    compat.mkdir()
    cache = ("\tlibnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1\n"
             "\tlibnvidia-ml.so (libc6,x86-64) => /elsewhere/libnvidia-ml.so\n")
    monkeypatch.setattr(subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=cache))
    assert startup.find_libnvml(compat / "libcuda.so.1") == Path(
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").resolve()
    monkeypatch.setattr(subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=""))
    assert startup.find_libnvml(compat / "libcuda.so.1") is None

    def missing(*a, **k):
        raise FileNotFoundError("ldconfig")
    monkeypatch.setattr(subprocess, "run", missing)
    assert startup.find_libnvml(compat / "libcuda.so.1") is None
