#!/usr/bin/env python3
"""Summarize bench/gpu/suite.sh's suite.jsonl: every capped run against the
same invocation's uncapped reference of the same workload.

  suite_summary.py SUITE.jsonl [--json OUT.json] [--skip 5] [--tol 5]

Per run and side (a pair has two):
  rate        mean rate over the intervals starting at or after --skip s
  % of ref    100 * rate / the reference's rate over the same stretch. For a
              workload with phases (phased: train/eval) each interval is
              weighed against the reference's rate in the same phase, so the
              figure is the share of the uncapped pace kept, whatever the mix
  within      |% of ref - cap| <= --tol points
  settle      end (s since the timed loop began) of the first 3 s window from
              which every later 3 s rolling mean is within --tol points of
              the cap; "never" if the last one is not
  below       the longest run of consecutive intervals (after --skip) whose
              own ratio is under cap - 10, in seconds
  GPU         NVML device utilization, mean over the run after --skip
  phases      per phase: % of the reference's rate in that phase
A twin run (two processes of one workload at once, side b uncapped) judges
side a against side b over the same seconds; the both-uncapped twin run
also gives the correlation of the two sides' 1 s rates. The service run's
twin, when it has one, gives "% of its uncapped twin" beside the reference.
A reference row shows its own spread instead (the coefficient of variation of
its 1 s rates after --skip): a cap cannot be judged closer than that.
Prints a markdown table, then the per-second series of the run furthest from
its cap; --json writes all of it.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def load(path):
    series = defaultdict(list)        # (run, side) -> [line]
    meta, summaries, nvml = {}, {}, defaultdict(list)
    suite = {}
    skipped, exits, churn, ends = [], [], {}, {}
    stopped = {}                      # (run, side) -> share of each second spent stopped
    for raw in open(path):
        raw = raw.strip()
        if not raw.startswith("{"):
            continue
        try:
            o = json.loads(raw)
        except ValueError:
            continue
        if o.get("suite"):
            suite = o
        elif o.get("nvml"):
            if "run" in o:
                nvml[o["run"]].append(o)
        elif "skipped" in o:
            skipped.append(o)
        elif "exit" in o:
            exits.append(o)
        elif "churners" in o:
            churn[o["run"]] = o
        elif "stopped" in o:
            stopped[(o["stopped"], o["side"])] = o["share"]
        elif "run_end" in o:
            ends[o["run_end"]] = o
        elif o.get("summary"):
            summaries[(o["run"], o["side"])] = o
        elif "dt" in o and "run" in o:
            series[(o["run"], o["side"])].append(o)
            meta[(o["run"], o["side"])] = {k: o.get(k) for k in ("run", "kind", "cap", "group", "side", "ref", "w",
                                                                   "unit")}
    return series, meta, summaries, nvml, skipped, exits, churn, ends, suite, stopped


def phase_rates(lines, skip):
    """Rate per phase (None: no phase) over intervals starting at or after skip,
    and the overall rate."""
    n, dt = defaultdict(float), defaultdict(float)
    for o in lines:
        if o["t"] >= skip:
            n[o.get("phase")] += o["n"]
            dt[o.get("phase")] += o["dt"]
    per = {p: n[p] / dt[p] for p in n if dt[p] > 0}
    total_dt = sum(dt.values())
    return per, (sum(n.values()) / total_dt if total_dt > 0 else None)


def analyze(lines, ref_lines, cap, skip, tol):
    ref_phase, ref_all = phase_rates(ref_lines, skip)
    own_phase, own_all = phase_rates(lines, skip)
    target = float(cap) if cap is not None else 100.0
    if not ref_all or not lines:
        return {"rate": own_all, "ratio": None}

    def ref_rate(o):
        return ref_phase.get(o.get("phase")) or ref_all

    # per interval: share of the reference's pace, in percent
    # (an interval under 0.1 s, the loop's last moments, says too little)
    pts = [(o["t"], o["dt"], 100.0 * o["n"] / (o["dt"] * ref_rate(o)), o) for o in lines if o["dt"] >= 0.1]
    after = [p for p in pts if p[0] >= skip]
    dt_after = sum(p[1] for p in after)
    ratio = sum(p[2] * p[1] for p in after) / dt_after if dt_after > 0 else None
    # 3 s rolling means, one per interval end
    rolling = []
    for i, (t, dt, _r, _o) in enumerate(pts):
        end = t + dt
        if end < 3.0 - 1e-6:
            continue
        win = [q for q in pts[: i + 1] if q[0] >= end - 3.0 - 1e-6]
        wdt = sum(q[1] for q in win)
        if wdt > 0:
            rolling.append((end, sum(q[2] * q[1] for q in win) / wdt))
    settle = None
    for j in range(len(rolling)):
        if all(abs(r - target) <= tol for _e, r in rolling[j:]):
            settle = rolling[j][0]
            break
    longest = cur = 0.0
    for _t, dt, r, _o in after:
        if r < target - 10:
            cur += dt
            longest = max(longest, cur)
        else:
            cur = 0.0
    phases = {}
    for p, rate in own_phase.items():
        if p is not None and ref_phase.get(p):
            phases[p] = round(100.0 * rate / ref_phase[p], 1)
    rates = [o["rate"] for o in lines if o["t"] >= skip and o["dt"] >= 0.5]   # whole seconds
    return {
        "rate": own_all, "ref_rate": ref_all, "ratio": ratio, "target": target,
        "within": ratio is not None and abs(ratio - target) <= tol,
        "settle_s": round(settle, 2) if settle is not None else "never",
        "longest_below_s": round(longest, 2), "phases": phases,
        "cv": round(statistics.pstdev(rates) / statistics.mean(rates), 3) if len(rates) > 1 and statistics.mean(rates) else None,
        "series": [{"t": round(t, 2), "dt": round(dt, 2), "rate": o["rate"], "ratio": round(r, 1),
                    **({"phase": o["phase"]} if "phase" in o else {})} for t, dt, r, o in pts],
    }


def correlation(xs, ys, skip):
    """Pearson coefficient of two processes' 1 s rates, interval by interval:
    how far their speeds drift together."""
    a = [o["rate"] for o in xs if o["t"] >= skip and o["dt"] >= 0.5]
    b = [o["rate"] for o in ys if o["t"] >= skip and o["dt"] >= 0.5]
    n = min(len(a), len(b))
    if n < 3 or statistics.pstdev(a[:n]) == 0 or statistics.pstdev(b[:n]) == 0:
        return None
    return round(statistics.correlation(a[:n], b[:n]), 3)


def fmt(v, spec="{:.1f}"):
    return "-" if v is None else (spec.format(v) if isinstance(v, (int, float)) else str(v))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", type=float, default=5.0)
    ap.add_argument("--tol", type=float, default=5.0)
    a = ap.parse_args()
    series, meta, summaries, nvml, skipped, exits, churn, ends, suite, stopped = load(a.jsonl)
    run_s = suite.get("seconds", 1e9)
    ref_of = {}                       # reference label -> its lines (side a)
    for (run, side), m in meta.items():
        if m["kind"] == "ref":
            ref_of[run] = series[(run, side)]
    rows = []
    order = list(dict.fromkeys(run for run, _side in meta))
    for key in sorted(series, key=lambda k: (order.index(k[0]), k[1])):
        m = meta[key]
        lines = series[key]
        ref_lines = ref_of.get(m["ref"]) if m["ref"] else lines
        twin = series.get((m["run"], "b")) if m["side"] == "a" and m["kind"] in ("twin", "service") else None
        if m["kind"] == "twin":
            ref_lines = twin if m["side"] == "a" else lines
        skip = a.skip
        if not any(o["t"] >= skip for o in lines) or not any(o["t"] >= skip for o in (ref_lines or [])):
            skip = 0.0            # a run shorter than --skip: all of it
        res = analyze(lines, ref_lines or [], m["cap"], skip, a.tol)
        res["skip_s"] = skip
        if twin and m["kind"] == "service":
            res["vs_twin"] = analyze(lines, twin, m["cap"], skip, a.tol)["ratio"]
        if twin and m["cap"] is None:
            res["twin_corr"] = correlation(lines, twin, skip)
        samples = [o for o in nvml.get(m["run"], []) if a.skip <= o.get("rt", 0) <= run_s]
        util = [o["gpu"] for o in samples]
        mhz = [o["sm_mhz"] for o in samples if o.get("sm_mhz")]
        summ = summaries.get(key, {})
        row = {**m, **res, "gpu_util": round(statistics.mean(util), 1) if util else None,
               "sm_mhz": round(statistics.mean(mhz)) if mhz else None,
               "gpu_setup_s": summ.get("gpu_setup_s"), "import_s": summ.get("import_s")}
        share = [v for v in stopped.get(key, [])[int(skip):int(run_s)] if v is not None]
        if share:
            row["stopped"] = round(100 * statistics.mean(share), 1)
            if res.get("ratio") is not None and row["stopped"] < 100:
                # progress per second it was let run, against the reference's
                row["per_running_s"] = round(100 * res["ratio"] / (100 - row["stopped"]), 1)
        cpu = ends.get(m["run"], {}).get("cpu", {})
        row["cpu"], row["daemon_cpu"] = cpu.get(m["side"]), cpu.get("daemon")
        if m["kind"] == "service" and m["run"] in churn:
            row["churners"] = churn[m["run"]]["churners"]
        rows.append(row)
    # pairs: the two sides' shares added up
    pair_sum = defaultdict(float)
    for r in rows:
        if r["kind"] == "pair" and r["ratio"] is not None:
            pair_sum[r["run"]] += r["ratio"]

    print(f"Rates over intervals from {a.skip:g} s on; % of the same invocation's uncapped reference; "
          f"within: ±{a.tol:g} points of the cap; settle: end of the first 3 s window from which every "
          f"3 s mean stays within ±{a.tol:g}; below: longest stretch under cap−10 after {a.skip:g} s.\n")
    print(f"| run | workload | cap | rate | unit | % of uncapped | within ±{a.tol:g} | settle | below cap−10 "
          "| GPU util | notes |")
    print("|---|---|---:|---:|---|---:|:---:|---:|---:|---:|---|")
    for r in rows:
        notes = []
        ref_row = r["kind"] == "ref" or (r["kind"] == "twin" and r["side"] == "b")
        if r.get("vs_twin") is not None:
            notes.append(f"{r['vs_twin']:.1f}% of its uncapped twin over the same seconds")
        if r.get("twin_corr") is not None:
            notes.append(f"1 s rates' correlation with the twin {r['twin_corr']:.2f}")
        if ref_row:
            notes.append(f"spread (CV) {fmt(r.get('cv'), '{:.3f}')}")
        if r.get("phases"):
            notes.append(", ".join(f"{p} {v:.1f}%" for p, v in sorted(r["phases"].items())))
        if r["kind"] == "pair" and r["run"] in pair_sum:
            notes.append(f"pair sum {pair_sum[r['run']]:.1f}%")
        if r.get("churners"):
            notes.append("churners " + " ".join(f"{k} {v}" for k, v in r["churners"].items()))
        if r["kind"] == "service":
            alone = [x for x in rows if x["kind"] == "cap" and x["w"] == r["w"] and x["cap"] == r["cap"]]
            if alone and alone[0].get("ratio") is not None:
                notes.append(f"alone at the same cap {alone[0]['ratio']:.1f}%")
        if r.get("skip_s") != a.skip:
            notes.append("short: every interval counted")
        if r.get("stopped") is not None:
            notes.append(f"stopped {r['stopped']:.1f}% of the time"
                         + (f", {r['per_running_s']:.0f}% speed while running" if r.get("per_running_s") else ""))
        if r.get("cpu") is not None:
            notes.append(f"CPU {100 * r['cpu']:.0f}%"
                         + (f", daemon's {100 * r['daemon_cpu']:.0f}%" if r.get("daemon_cpu") is not None else ""))
        if r.get("sm_mhz") is not None:
            notes.append(f"SM clock {r['sm_mhz']} MHz")
        if r.get("gpu_setup_s") is not None:
            notes.append(f"set-up {r['gpu_setup_s']:.1f} s")
        print(f"| {r['run']}{'' if r['kind'] not in ('pair', 'twin') and r['side'] == 'a' else ' (' + r['side'] + ')'} | {r['w']} "
              f"| {r['cap'] if r['cap'] is not None else '-'} | {fmt(r['rate'], '{:.2f}')} | {r['unit']} "
              f"| {'-' if ref_row else fmt(r['ratio'])} | {'' if ref_row else ('yes' if r.get('within') else 'no')} "
              f"| {'-' if ref_row else fmt(r.get('settle_s'))} | {'-' if ref_row else fmt(r.get('longest_below_s'))} "
              f"| {fmt(r['gpu_util'])} | {'; '.join(notes)} |")
    for s in skipped:
        print(f"\nskipped: {s['skipped']} ({s.get('why')})", end="")
    bad = [e for e in exits if e.get("rc")]
    for e in bad:
        print(f"\nexit status {e['rc']}: {e['exit']} ({e.get('w')})", end="")
    for run, e in ends.items():
        if not e.get("ok", True):
            print(f"\nnot started: {run} (set-up failed after {e.get('setup_s')} s)", end="")
    print()
    capped = [r for r in rows if r["kind"] != "ref" and r.get("ratio") is not None and r["cap"] is not None]
    worst = max(capped, key=lambda r: abs(r["ratio"] - r["target"]), default=None)
    if worst:
        print(f"\nFurthest from its cap: {worst['run']} ({worst['w']}, cap {worst['cap']}): "
              f"{worst['ratio']:.1f}% of uncapped; per interval:")
        print("| t (s) | dt | rate | % of uncapped | phase |")
        print("|---:|---:|---:|---:|---|")
        for p in worst["series"]:
            print(f"| {p['t']:.2f} | {p['dt']:.2f} | {p['rate']:.2f} | {p['ratio']:.1f} | {p.get('phase', '')} |")
    if a.json:
        out = {"skip_s": a.skip, "tol": a.tol,
               "runs": [{k: v for k, v in r.items()} for r in rows],
               "pair_sums": dict(pair_sum), "worst": worst and {"run": worst["run"], "side": worst["side"]},
               "skipped": skipped, "failed_exits": bad,
               "not_started": [k for k, e in ends.items() if not e.get("ok", True)]}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
