#!/usr/bin/env python3
"""The duty pacer against recorded workloads, over many capped stretches (no GPU).

Each recording's timed loop is repeated (--repeat) and capped at each cap from
several points in it (--offsets, seconds into the loop, as bench/gpu/suite_ab.sh
caps a running process), for each stretch length (--stretch), under each model
of what a stop costs the host program (--models: `held`, replay.HELD_MEASURED;
`cold`, replay.COLD_MEASURED; `none`). Every stretch is judged as the suite
judges a run on the GPU: its mean share of the uncapped replay's work from
replay.LOOP_SETTLE_S after the cap, against the cap; and the fail-open floor,
its longest run of 1 s windows under cap - 10 points.

`--set duty.REPAY_SHARE=1.0` (any module of hami_bpf.sm, any constant) runs
the same stretches with a constant changed, to compare one setting with
another on the same stretches in one invocation's output.

  python3 bench/replay_sweep.py                      # the launch-bound recordings
  python3 bench/replay_sweep.py tests/data/traces/*.json.gz --stretch 30 --rows
  python3 bench/replay_sweep.py --set progress.SAME_PHASE=0.3

Prints, per stretch length: stretches within +-5 points, mean absolute and
mean signed error (points), the stretches that spent more than 5 s in a
row under cap - 10, and the free samples that measured the loop's speed and
that were dropped; with --rows, every stretch (with its samples, and the
times its readings were forgotten for a new phase).
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import os
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hami_bpf.sm import duty, progress, replay, workload  # noqa: E402

TRACES = ROOT / "tests" / "data" / "traces"
# loops whose launching thread sets their pace: the ones the pacer samples
LAUNCH_BOUND = ("llm_decode", "bert_infer", "gpt2_decode", "loader_train")
MODELS = {"held": replay.HELD_MEASURED, "cold": replay.COLD_MEASURED, "none": None}
TOLERANCE_PTS = 5.0
FLOOR_PTS = 10.0
FLOOR_S = 5.0


def apply_settings(settings: list[str]) -> None:
    """`module.NAME=value` for modules of hami_bpf.sm; the value is parsed as
    the constant's own type."""
    for s in settings:
        name, _, value = s.partition("=")
        mod_name, _, const = name.rpartition(".")
        if not mod_name or not const or not value:
            raise SystemExit(f"--set {s!r}: expected module.NAME=value")
        mod = importlib.import_module(f"hami_bpf.sm.{mod_name}")
        if not hasattr(mod, const):
            raise SystemExit(f"--set {s!r}: hami_bpf.sm.{mod_name} has no {const}")
        old = getattr(mod, const)
        setattr(mod, const, type(old)(value))


_loaded: dict = {}


def _fitted(path: str, repeat: int):
    key = (path, repeat)
    if key not in _loaded:
        rec = workload.repeat_loop(workload.load(path), repeat)
        wl = workload.fit(rec)
        _loaded[key] = (rec, wl, replay.replay(wl))
    return _loaded[key]


def one(job: tuple) -> dict:
    path, repeat, model, cap, offset, stretch = job
    rec, wl, base = _fitted(path, repeat)
    start = rec.loop_start + offset
    # the pacer's arguments read now, so that --set reaches them too
    pacer = duty.DutyPacer(quantum_s=duty.QUANTUM_S, max_hold_s=duty.MAX_HOLD_S,
                           host_run_s=duty.HOST_RUN_S, host_stop_share=duty.HOST_STOP_SHARE,
                           sample_share=progress.SAMPLE_SHARE)
    run = replay.replay_capped(wl, cap, horizon=start + stretch, cold=MODELS[model],
                               start=start, pacer=pacer)
    r = replay.compare(run, base, (start, start + stretch))
    measured, dropped, forgotten = pacer.samples((0, 0))
    return {"workload": wl.name, "model": model, "cap": cap, "offset": offset,
            "stretch": stretch, "share": None if r.loop_mean is None else 100 * r.loop_mean,
            "below_s": r.loop_below_longest_s or 0.0, "measured": measured,
            "dropped": dropped, "forgotten": forgotten}


def summary(rows: list[dict]) -> str:
    errs = [r["share"] - r["cap"] for r in rows if r["share"] is not None]
    if not errs:
        return "no stretch measured"
    within = sum(abs(e) <= TOLERANCE_PTS for e in errs)
    floor = [r for r in rows if r["below_s"] > FLOOR_S]
    return (f"within +-{TOLERANCE_PTS:.0f}: {within} of {len(errs)}; "
            f"mean |error| {statistics.mean(abs(e) for e in errs):.2f} pts, "
            f"mean error {statistics.mean(errs):+.2f} pts (from {min(errs):+.1f} to "
            f"{max(errs):+.1f}); over {FLOOR_S:.0f} s under cap - {FLOOR_PTS:.0f}: "
            f"{len(floor)} (longest {max((r['below_s'] for r in rows), default=0):.0f} s); "
            f"samples {sum(r['measured'] for r in rows)} measured, "
            f"{sum(r['dropped'] for r in rows)} dropped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*",
                    help="recordings (.json.gz) with a timed loop; default: the launch-bound "
                         "ones of tests/data/traces")
    ap.add_argument("--caps", default="50,75", help="caps, comma-separated")
    ap.add_argument("--offsets", default="3,7,10,15,20,28,35,45",
                    help="seconds into the timed loop at which the cap is set")
    ap.add_argument("--stretch", default="30,90", help="seconds each cap lasts")
    ap.add_argument("--models", default="held,cold",
                    help="what a stop costs the host: " + ", ".join(MODELS))
    ap.add_argument("--repeat", type=int, default=8, help="the timed loop this many times over")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="change a constant of hami_bpf.sm.MODULE for this run")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rows", action="store_true", help="print every stretch")
    a = ap.parse_args(argv)
    apply_settings(a.set)
    paths = a.traces or [str(TRACES / f"{w}.json.gz") for w in LAUNCH_BOUND]
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: unknown model {m!r}")
    jobs = list(itertools.product(paths, [a.repeat], models,
                                  [float(c) for c in a.caps.split(",") if c],
                                  [float(o) for o in a.offsets.split(",") if o],
                                  [float(s) for s in a.stretch.split(",") if s]))
    with Pool(a.jobs, initializer=apply_settings, initargs=(a.set,)) as pool:
        rows = pool.map(one, jobs, chunksize=1)
    print(f"settings: {' '.join(a.set) or 'as shipped'}")
    for stretch in sorted({r["stretch"] for r in rows}):
        print(f"{stretch:.0f} s stretches: {summary([r for r in rows if r['stretch'] == stretch])}")
    if a.rows:
        for r in rows:
            share = "-" if r["share"] is None else f"{r['share']:5.1f}"
            print(f"  {r['workload']:<14} {r['model']:<5} cap {r['cap']:3.0f} from {r['offset']:4.0f} s"
                  f"  {r['stretch']:3.0f} s  share {share}  under cap-10 {r['below_s']:.0f} s"
                  f"  samples {r['measured']} measured {r['dropped']} dropped"
                  f" {r['forgotten']} forgotten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
