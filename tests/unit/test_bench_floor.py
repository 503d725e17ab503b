"""The GPU bench's judgement of a capped stretch (bench/gpu/suite_ab.py), on
workload lines built here: its fail-open floor measure (under_floor_s, the
longest time in a row it ran under cap - 10 of its free stretches), and how
far apart its free stretches were (ref_apart, steady)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import suite_ab  # noqa: E402 - a bench script, by path


def lines_of(rates, t0=0.0, dt=1.0, phase=None):
    """(arrived, line) pairs as the bench reads a workload's output."""
    out = []
    for i, r in enumerate(rates):
        rec = {"dt": dt, "n": r * dt, "rate": r}
        if phase is not None:
            rec["phase"] = phase[i] if isinstance(phase, list) else phase
        out.append((t0 + (i + 1) * dt, rec))
    return out


FREE = [(0.0, 5.0), (15.0, 20.0)]


def test_a_stretch_under_its_floor_is_measured_in_seconds_in_a_row():
    # free at 100 either side; capped at 50: 2 s dip, back, then 3 s under 40
    capped = [50, 30, 30, 50, 35, 20, 39, 50, 50, 50]
    lines = lines_of([100] * 5) + lines_of(capped, t0=5.0) + lines_of([100] * 5, t0=15.0)
    assert suite_ab.under_floor_s(lines, FREE, 5.0, 15.0, 50) == 3.0
    assert suite_ab.under_floor_s(lines, FREE, 5.0, 15.0, 30) == 0.0


def test_a_phase_is_held_to_the_free_rate_of_that_phase():
    # train runs at 10 free, eval at 40: capped at 50, 5 and 20 are on the cap
    free_a = lines_of([10, 10, 40, 40, 10], phase=["train", "train", "eval", "eval", "train"])
    capped = lines_of([5, 5, 20, 20, 5, 5], t0=5.0,
                      phase=["train", "train", "eval", "eval", "train", "train"])
    free_b = lines_of([10, 40, 40, 10, 10], t0=11.0, phase=["train", "eval", "eval", "train", "train"])
    lines = free_a + capped + free_b
    free = [(0.0, 5.0), (11.0, 16.0)]
    assert suite_ab.under_floor_s(lines, free, 5.0, 11.0, 50) == 0.0
    # the eval seconds at 5 are an eighth of eval's free rate: under
    slow = lines_of([5, 5, 5, 5, 5, 5], t0=5.0,
                    phase=["train", "train", "eval", "eval", "train", "train"])
    assert suite_ab.under_floor_s(free_a + slow + free_b, free, 5.0, 11.0, 50) == 2.0


def test_a_phase_change_remainder_neither_counts_nor_breaks_a_run():
    lines = lines_of([100] * 5) + lines_of([20, 20], t0=5.0)
    lines.append((7.01, {"dt": 0.01, "n": 0, "rate": 0.0}))
    lines += lines_of([20, 50], t0=7.01)
    assert suite_ab.under_floor_s(lines, [(0.0, 5.0)], 5.0, 10.0, 50) == 3.0


def test_no_free_rate_measures_nothing():
    assert suite_ab.under_floor_s(lines_of([20, 20], t0=5.0), [(0.0, 5.0)], 5.0, 7.0, 50) is None


def test_a_stretch_says_how_far_apart_its_free_stretches_are():
    capped = lines_of([50] * 10, t0=5.0)
    steady = lines_of([100] * 5) + capped + lines_of([110] * 5, t0=15.0)
    r = suite_ab.stretch(steady, 5.0, 15.0, 50, (1.0, 5.0), (16.0, 20.0), 3.0)
    assert r["ref_apart"] == 9.5 and r["steady"] and r["within5"]
    moved = lines_of([100] * 5) + capped + lines_of([60] * 5, t0=15.0)
    r = suite_ab.stretch(moved, 5.0, 15.0, 50, (1.0, 5.0), (16.0, 20.0), 3.0)
    assert r["ref_apart"] == 50.0 and not r["steady"]
    one = suite_ab.stretch(steady, 5.0, 15.0, 50, (1.0, 5.0), None, 3.0)
    assert one["ref_apart"] is None and not one["steady"]


def test_the_tally_counts_steady_references_apart():
    rows = [{"within5": True, "steady": True}, {"within5": False, "steady": False},
            {"within5": False, "steady": True}, {"within5": True, "steady": False}]
    assert suite_ab.tally(rows) == {"stretches": 4, "within5": 2, "steady": 2, "steady_within5": 1}


def test_the_table_marks_a_reference_that_moved_and_only_that():
    col = next(k for h, k, _a in suite_ab.stretch_columns("uncapped") if "apart" in h)
    assert col({"ref_apart": 50.0, "steady": False}) == "50.0 (moved)"
    assert col({"ref_apart": 9.5, "steady": True}) == 9.5
    assert col({"ref_apart": None, "steady": False}) is None
