"""A recorded workload read (sm.workload.from_obj) and the model fitted to it
(fit): units, the two table layouts, failed and nested synchronize calls, the
split of a launch bin around its thread's synchronize, and the GPU time per
launch from a synchronize that waited, from NVML, and from neither."""
from __future__ import annotations

import pytest

from hami_bpf.sm import workload as W

approx = pytest.approx


def rec(launches=(), syncs=(), nvml=(), **header):
    return W.from_obj({"header": {"workload": "w", **header}, "launches": list(launches),
                       "syncs": list(syncs), "nvml": list(nvml)})


def test_units_are_seconds_and_utilization_a_share():
    r = rec([[3, 1, 2, 5]], [[1, 1000, 1500, "cuCtxSynchronize"]], [[2_000_000, 150], [3e6, -5]],
            lost={"launch": 2, "sync": 3})
    assert r.launches == [(0.003, 1, 2, 5)]
    assert r.syncs == [(1, 0.001, 0.0015, "cuCtxSynchronize")]
    assert r.nvml == [(2.0, 1.0), (3.0, 0.0)]          # clipped to 0..1
    assert r.workload == "w" and W.fit(r).lost == 5


def test_tables_given_as_columns_read_as_rows():
    rows = W.from_obj({"launches": [[3, 1, 2, 5]], "syncs": [[1, 1000, 1500, "f"]],
                       "nvml": [[10, 50]]})
    cols = W.from_obj({"launches": {"t_ms": [3], "tid": [1], "n": [2], "cost": [5]},
                       "syncs": {"tid": [1], "t_enter_us": [1000], "t_return_us": [1500],
                                 "fn": ["f"]},
                       "nvml": {"t_us": [10], "util": [50]}})
    assert (cols.launches, cols.syncs, cols.nvml) == (rows.launches, rows.syncs, rows.nvml)


def test_failed_and_unfinished_synchronize_calls_are_dropped():
    r = W.from_obj({"syncs": {"tid": [1, 1, 1], "t_enter_us": [10, 20, 30],
                              "t_return_us": [15, None, 35], "fn": ["a", "b", "c"],
                              "rc": [0, 0, 700]}})
    assert [s[3] for s in r.syncs] == ["a"]


def test_the_timed_loop_comes_from_the_workloads_own_lines():
    lines = [{"t": 1.0, "dt": 1.0, "recv_us": 5_000_000}, {"t": 2.0, "dt": 1.0, "recv_us": 6_000_000}]
    r = W.from_obj({"rates": lines})
    assert (r.loop_start, r.loop_end) == (approx(3.0), approx(6.0))   # 5 s - t - dt; last line
    r = W.from_obj({"rates": lines, "header": {"workload_summary": "{'seconds': 10.0}"}})
    assert (r.loop_start, r.loop_end) == (approx(3.0), approx(13.0))
    r = W.from_obj({"rates": lines + [{"summary": True, "seconds": 4.0}]})
    assert r.loop_end == approx(7.0)
    assert W.from_obj({}).loop_start is None


def test_a_synchronize_that_waited_says_when_the_gpu_finished():
    # 10 cost units launched mid-bin at 0.5 ms; the call entered at 1 ms and
    # returned at 11 ms: the GPU finished at 11 ms less the call's own floor.
    w = W.fit(rec([[0, 1, 1, 10]], [[1, 1000, 11000, "cuStreamSynchronize"]]))
    assert w.floor == approx(W.FLOOR_MAX_S)
    (t,) = w.threads
    assert t.kinds == [W.LAUNCH, W.SYNC] and t.costs == [10, 0]
    assert sum(t.gpu) == approx(0.011 - W.FLOOR_MAX_S - 0.0005)
    assert t.gaps == [approx(0.0005), approx(0.0005)]
    assert t.at == [approx(0.0005), approx(0.011)]
    assert w.recorded_end == approx(0.011) and w.recorded_returns == [approx(0.011)]
    assert w.actions == 2 and w.nested == 0


def test_a_synchronize_that_did_not_wait_takes_the_gpu_time_from_nvml():
    launches, syncs = [[0, 1, 1, 10]], [[1, 10_000, 10_030, "cuCtxSynchronize"]]
    bound = W.fit(rec(launches, syncs))
    # Returned at once: the GPU was done by 10 ms (its floor is the call itself).
    assert bound.floor == approx(30e-6)
    assert sum(bound.threads[0].gpu) == approx(0.0095)
    half = W.fit(rec(launches, syncs, [[5000, 50], [10000, 50]]))
    assert sum(half.threads[0].gpu) == approx(0.5 * 0.0095)
    busy = W.fit(rec(launches, syncs, [[5000, 100], [10000, 100]]))
    assert sum(busy.threads[0].gpu) == approx(0.0095)    # never above the bound


def test_launches_after_the_last_synchronize_keep_the_gpu_busy_without_nvml():
    r = rec([[0, 1, 1, 10], [2, 1, 1, 30]], seconds=0.01)
    (t,) = W.fit(r).threads
    assert t.gpu == [approx(0.0095 * 10 / 40), approx(0.0095 * 30 / 40)]
    r = rec([[0, 1, 1, 10], [2, 1, 1, 30]], nvml=[[5000, 20], [10000, 20]], seconds=0.01)
    assert sum(W.fit(r).threads[0].gpu) == approx(0.2 * 0.0095)


def test_a_bin_is_split_around_its_threads_synchronize_not_anothers():
    r = rec([[0, 1, 4, 4], [0, 2, 4, 4]], [[1, 250, 750, "cuStreamSynchronize"]])
    a, b = W.fit(r).threads
    assert a.kinds == [W.LAUNCH, W.SYNC, W.LAUNCH] and a.costs == [2, 0, 2]
    assert a.gaps == [approx(0.000125)] * 3
    assert b.kinds == [W.LAUNCH] and b.costs == [4] and b.at == [approx(0.0005)]


def test_a_nested_synchronize_is_folded_into_the_outer_one():
    r = rec([[0, 1, 1, 10]], [[1, 1000, 5000, "cuStreamSynchronize"],
                              [1, 2000, 8000, "cuMemcpy"], [1, 3000, 4000, "x"],
                              [2, 2000, 2500, "other thread"]])
    w = W.fit(r)
    assert w.nested == 2
    assert w.recorded_returns == [approx(0.0025), approx(0.008)]
    assert [t.kinds.count(W.SYNC) for t in w.threads] == [1, 1]


def test_a_recording_round_trips_through_its_file(tmp_path):
    obj = {"header": {"workload": "resnet", "seconds": 2.0, "lost": 1},
           "launches": [[0, 1, 1, 10]], "syncs": [[1, 1000, 11000, "f"]], "nvml": []}
    W.dump(obj, tmp_path / "r.json.gz")
    assert W.load(tmp_path / "r.json.gz") == W.from_obj(obj)
