"""Two recorded workloads replayed side by side on one modelled GPU, each its
own group under one duty pacer (pairs.replay_pair), as the daemon paces a
pair of containers.

Each recording's timed loop is repeated (workload.repeat_loop) so that the
two run together for a minute or more; each side is judged against its own
unthrottled replay alone, over the seconds in which both timed loops ran
(pairs.compare_pair). The modelled GPU runs both processes' work in launch
order, so two groups running at once slow each other as time-slicing does.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from hami_bpf.sm import duty, pairs, replay, workload

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
REPEAT = 6
HORIZON_S = 140.0
TOLERANCE_PTS = 5.0
FAIL_OPEN_PTS = 10.0
FAIL_OPEN_S = 5.0
SPLITS = ((30, 70), (50, 50), (70, 30))
# pairs of different kinds: GPU-bound training beside a launch-bound decode
# loop, a prefill beside training, a prefill beside decoding, and a loop
# that changes phase beside a decode loop
PAIRS = (("cnn_train", "llm_decode"), ("llm_prefill", "cnn_train"),
         ("llm_prefill", "llm_decode"), ("phased", "llm_decode"))
HELD_LOSS = replay.Cold(seconds=1.0, speed=0.85)   # as replay.HELD_MEASURED


@functools.lru_cache(maxsize=None)
def _load(name: str):
    path = TRACES / f"{name}.json.gz"
    if not path.exists():
        pytest.skip(f"no recording {name}")
    rec = workload.repeat_loop(replay.load(path), REPEAT)
    wl = replay.fit(rec)
    return rec, wl, replay.replay(wl)


@functools.lru_cache(maxsize=None)
def _pair(a: str, b: str, caps: tuple, losses: tuple = (None, None)):
    (ra, wa, ba), (rb, wb, bb) = _load(a), _load(b)
    runs = pairs.replay_pair([wa, wb], list(caps), horizon=HORIZON_S, colds=list(losses))
    sides = pairs.compare_pair(runs, [ba, bb], [(ra.loop_start, ra.loop_end),
                                                 (rb.loop_start, rb.loop_end)])
    return runs, sides


def _line(sides) -> str:
    return " | ".join(f"{s.workload}@{s.cap}: {100 * s.mean:.1f} (below {s.below_longest_s:.0f} s)"
                      for s in sides)


def _running(run: replay.Run, lo: float, hi: float) -> list:
    """The intervals of [lo, hi] in which the run's process was not held."""
    out, t = [], lo
    for a, b in sorted(run.holds):
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if a > t:
            out.append((t, a))
        t = max(t, b)
    return out + ([(t, hi)] if t < hi else [])


def _overlap(xs: list, ys: list) -> float:
    total = i = j = 0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


@pytest.mark.parametrize("a,b", PAIRS)
@pytest.mark.parametrize("caps", SPLITS)
def test_each_side_of_a_pair_gets_its_cap(a, b, caps):
    runs, sides = _pair(a, b, caps)
    lo, hi = sides[0].window
    assert hi - lo >= 40.0, _line(sides)      # judged over a long stretch side by side
    for s, cap in zip(sides, caps):
        assert abs(100 * s.mean - cap) <= TOLERANCE_PTS, _line(sides)
        assert s.below_longest_s <= FAIL_OPEN_S, _line(sides)


@pytest.mark.parametrize("caps", SPLITS)
def test_paced_neighbours_take_turns(caps):
    """Their running times do not overlap: two processes time-slicing a GPU
    get less done than either alone."""
    runs, sides = _pair("cnn_train", "llm_decode", caps)
    lo, hi = sides[0].window
    both = _overlap(_running(runs[0], lo, hi), _running(runs[1], lo, hi))
    assert both / (hi - lo) < 0.02, (both, _line(sides))
    for run, cap in zip(runs, caps):
        ran = sum(b - a for a, b in _running(run, lo, hi))
        assert abs(100 * ran / (hi - lo) - cap) <= TOLERANCE_PTS, _line(sides)


@pytest.mark.parametrize("caps", SPLITS)
def test_beside_a_neighbour_a_loop_slowed_by_its_holds_keeps_its_share_not_more(caps):
    """A launch-bound decode loop that runs 15% slower whenever it is held
    is given nothing back beside a neighbour (the time would be the
    neighbour's, whose cap holds): it runs its cap's share of the time, lands
    under its cap by about what holds cost it, and is never stopped."""
    runs, sides = _pair("cnn_train", "llm_decode", caps, (None, HELD_LOSS))
    cnn, decode = sides
    assert abs(100 * cnn.mean - caps[0]) <= TOLERANCE_PTS, _line(sides)
    lo, hi = decode.window
    ran = sum(b - a for a, b in _running(runs[1], lo, hi)) / (hi - lo)
    assert abs(100 * ran - caps[1]) <= TOLERANCE_PTS, _line(sides)
    assert caps[1] - 15 <= 100 * decode.mean < caps[1], _line(sides)
    for s in sides:
        assert s.below_longest_s <= FAIL_OPEN_S, _line(sides)


@pytest.mark.parametrize("caps", ((30, 50), (20, 50), (30, 30)))
def test_beside_a_neighbour_a_loop_slowed_by_its_holds_is_given_back_time_no_cap_claims(caps):
    """Where the caps leave part of the device's time unclaimed, that part
    is no one's: the decode loop that runs 15% slower whenever it is held
    is given back what that costs it out of it, and lands on its cap; the
    neighbour keeps its own, and the two still take turns."""
    runs, sides = _pair("cnn_train", "llm_decode", caps, (None, HELD_LOSS))
    for s, cap in zip(sides, caps):
        assert abs(100 * s.mean - cap) <= TOLERANCE_PTS, _line(sides)
        assert s.below_longest_s <= FAIL_OPEN_S, _line(sides)
    lo, hi = sides[0].window
    ran = sum(b - a for a, b in _running(runs[1], lo, hi)) / (hi - lo)
    assert caps[1] + TOLERANCE_PTS < 100 * ran <= caps[1] + (100 - sum(caps)) + 2, _line(sides)
    both = _overlap(_running(runs[0], lo, hi), _running(runs[1], lo, hi))
    assert both / (hi - lo) < 0.02, (both, _line(sides))


@pytest.mark.parametrize("loss", (None, HELD_LOSS, replay.Cold(seconds=1.0, speed=0.75)))
def test_beside_an_uncapped_neighbour_a_launch_bound_loop_measures_what_holds_cost_it(loss):
    """An uncapped group is promised nothing and takes no turns: beside it
    only, a capped decode loop runs free samples as alone, and is given back
    what its holds are measured to cost it. Whether a hold costs it nothing,
    15% or 25% of its speed for a second after, it makes its cap's share of
    its rate; a fixed first guess (duty.HOST_STOP_SHARE, 58.8% of the time at
    cap 50) would land it 9 over where a hold costs nothing and 6 under at
    25%. Its neighbour, another decode loop so that it stays launch-bound,
    is never held."""
    (_ra, wa, ba), (rb, wb, bb) = _load("gpt2_decode"), _load("llm_decode")
    pacer = duty.DutyPacer()
    runs = pairs.replay_pair([wa, wb], [None, 50], horizon=HORIZON_S, colds=[None, loss],
                             pacer=pacer)
    sides = pairs.compare_pair(runs, [ba, bb], [(_ra.loop_start, _ra.loop_end),
                                                 (rb.loop_start, rb.loop_end)])
    assert abs(100 * sides[1].mean - 50) <= TOLERANCE_PTS, _line(sides)
    assert sides[1].below_longest_s <= FAIL_OPEN_S, _line(sides)
    assert pacer.samples((1, 0))[0] >= 2
    assert runs[0].holds == []


@pytest.mark.parametrize("name", ("bert_infer", "gpt2_decode", "threaded_infer"))
@pytest.mark.parametrize("loss", (None, HELD_LOSS))
def test_beside_an_uncapped_neighbour_a_launch_bound_loop_does_as_alone(name, loss):
    """Loops the measuring was not set on, capped at 50 beside an uncapped
    decode loop: each makes what it makes alone at that cap, within 3
    points, where a hold costs it nothing and where it costs 15%."""
    side = _pair("llm_decode", name, (None, 50), (None, loss))[1][1]
    rb, wb, bb = _load(name)
    one = pairs.replay_pair([wb], [50], horizon=HORIZON_S, colds=[loss])[0]
    alone = replay.compare(one, bb, (rb.loop_start, rb.loop_end))
    assert abs(side.mean - alone.loop_mean) <= 0.03, (100 * side.mean, alone.line())


def test_an_uncapped_neighbour_is_never_held_and_the_capped_side_keeps_its_share():
    runs, sides = _pair("llm_prefill", "cnn_train", (None, 50))
    assert runs[0].holds == [] and runs[0].stops == {"sync": 0, "launch": 0}
    lo, hi = sides[1].window
    ran = sum(b - a for a, b in _running(runs[1], lo, hi)) / (hi - lo)
    assert abs(100 * ran - 50) <= TOLERANCE_PTS, _line(sides)


def test_a_pair_replay_of_one_workload_is_the_single_replay():
    rec, wl, base = _load("llm_decode")
    one = replay.replay_capped(wl, 50, horizon=60.0)
    pair = pairs.replay_pair([wl], [50], horizon=60.0)[0]
    assert pair.holds == one.holds and pair.done_at == one.done_at
    assert pair.stops == one.stops and duty.Mode.DUTY in {m for _, m in pair.modes}


def test_the_pair_command_slows_the_side_it_is_told_and_takes_uncapped_sides(capsys, monkeypatch):
    a, b = (str(TRACES / f"{n}.json.gz") for n in ("cnn_train", "llm_decode"))
    if not all(Path(p).exists() for p in (a, b)):
        pytest.skip("no recordings")
    colds, real = [], pairs.replay_pair

    def replay_pair(wls, caps, **kw):
        colds.append(kw.get("colds"))
        return real(wls, caps, **kw)
    monkeypatch.setattr(pairs, "replay_pair", replay_pair)
    args = [a, b, "--held", "--repeat", "3", "--horizon", "60", "--pair", "none:50,30:50"]
    assert replay.main(args + ["--slowed", "second"]) == 0
    lines = capsys.readouterr().out.splitlines()[-2:]
    assert "cnn_train cap -:" in lines[0] and "llm_decode cap 50:" in lines[0]
    assert "cnn_train cap 30:" in lines[1] and "llm_decode cap 50:" in lines[1]
    # each split replays both sides together, only the side named slowed by a stop
    together = [c for c in colds if c is not None and len(c) == 2]
    assert together and all(c == [None, replay.HELD_MEASURED] for c in together)
    colds.clear()
    assert replay.main(args + ["--slowed", "first"]) == 0
    together = [c for c in colds if c is not None and len(c) == 2]
    assert together and all(c == [replay.HELD_MEASURED, None] for c in together)


@pytest.mark.parametrize("a,b,caps", (("bert_infer", "llm_decode", (30, 70)),
                                      ("bert_infer", "llm_decode", (50, 50)),
                                      ("gpt2_decode", "loader_train", (50, 50))))
def test_launch_bound_pairs_that_a_hold_slows_run_beside_each_other_at_their_caps(a, b, caps):
    """Each leaves the modelled GPU idle most of the time and runs 15%
    slower whenever held: taking turns, each would land under by that; run
    beside each other (sm.handoff) and given it back, each lands on its cap."""
    runs, sides = _pair(a, b, caps, (HELD_LOSS, HELD_LOSS))
    lo, hi = sides[0].window
    assert hi - lo >= 40.0, _line(sides)
    for s, cap in zip(sides, caps):
        assert abs(100 * s.mean - cap) <= TOLERANCE_PTS, _line(sides)
        assert s.below_longest_s <= FAIL_OPEN_S, _line(sides)
    assert _overlap(_running(runs[0], lo, hi), _running(runs[1], lo, hi)) >= 0.1 * (hi - lo)
