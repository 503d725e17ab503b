#!/usr/bin/env python3
"""Summarize bench/gpu/tp2_decode.sh: DIR/tp.jsonl, slots.jsonl, events.jsonl.

  tp2_summary.py DIR [--json OUT.json] [--skip 2]

Per mode (eager, graphs) and SM cap, for the capped run against the same
invocation's uncapped reference:
  % of uncapped    each rank's tokens/s over the intervals starting at or after
                   --skip s, as a share of the reference's rank over the same
                   stretch
  longest gap      the longest time between two consecutive tokens, per rank
                   (capped run; the reference's in brackets)
  contiguous       at every poll the group's slot indices were 0..proc_num-1,
                   each pid held one slot, and (socket polls: slots and ps from
                   one snapshot) every process's own slot number named the slot
                   that holds it; CLI polls check slots and ps each on its own.
                   "no" gives the first violation
  group sums       at every socket poll the group's used bytes per device were
                   the sum of its processes'
  slot moves       per rank, each move seen by the polls: from->to, and the
                   daemon's used bytes for the rank before (last poll on the old
                   slot) and after (first poll on the new one); the moves the
                   daemon's compaction events name, for comparison
  compactions      compaction events in the group during the run, and the
                   daemon counter's increase over the run
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict


def lines(path):
    if not os.path.exists(path):
        return
    for raw in open(path):
        raw = raw.strip()
        if raw.startswith("{"):
            try:
                yield json.loads(raw)
            except ValueError:
                pass


def rate_after(series, skip):
    n = sum(o["n"] for o in series if o["t"] >= skip)
    dt = sum(o["dt"] for o in series if o["t"] >= skip)
    return n / dt if dt > 0 else None


def check_slots(doc):
    """Problems in one `slots --json` document (a list of strings)."""
    bad = []
    for g in doc.get("groups", []):
        idx = [s["index"] for s in g["slots"]]
        pids = [s["pid"] for s in g["slots"]]
        if idx != list(range(g["proc_num"])):
            bad.append(f"group {g['id']}: slot indices {idx} with proc_num {g['proc_num']}")
        if len(set(pids)) != len(pids):
            bad.append(f"group {g['id']}: a pid in two slots {pids}")
    return bad


def check_ps(doc):
    """Problems in one `ps --json` document: the slots its processes claim,
    per group, must be 0..n-1 (n processes in the group)."""
    bad = []
    by_group = defaultdict(list)
    for p in doc.get("processes", []):
        by_group[p["group"]].append(p["slot"])
    for g, sl in by_group.items():
        if sorted(sl) != list(range(len(sl))):
            bad.append(f"group {g}: ps slots {sorted(sl)}")
    return bad


def check_both(slots_doc, ps_doc):
    """slots and ps from one snapshot: each process's slot names the slot holding it."""
    bad = []
    holder = {(g["id"], s["index"]): s["pid"] for g in slots_doc.get("groups", []) for s in g["slots"]}
    in_slots = set(holder.values())
    for p in ps_doc.get("processes", []):
        if holder.get((p["group"], p["slot"])) != p["pid"]:
            bad.append(f"pid {p['pid']} says slot {p['slot']}, which holds {holder.get((p['group'], p['slot']))}")
    missing = in_slots - {p["pid"] for p in ps_doc.get("processes", [])}
    if missing:
        bad.append(f"pids in slots but not in ps: {sorted(missing)}")
    return bad


def check_sums(slots_doc, ps_doc):
    bad = []
    for g in slots_doc.get("groups", []):
        tot = defaultdict(int)
        for p in ps_doc.get("processes", []):
            if p["group"] == g["id"]:
                for d, u in p["devices"].items():
                    tot[d] += u["used_bytes"]
        for d, u in g["devices"].items():
            if u["used_bytes"] != tot.get(d, 0):
                bad.append(f"group {g['id']} device {d}: {u['used_bytes']} used, processes sum {tot.get(d, 0)}")
    return bad


def used(ps_doc, pid):
    for p in ps_doc.get("processes", []):
        if p["pid"] == pid:
            return {d: u["used_bytes"] for d, u in p["devices"].items()}
    return None


def mib(d):
    if d is None:
        return "-"
    return "{" + ", ".join(f"dev {k}: {v / 2**20:.1f} MiB" for k, v in sorted(d.items())) + "}"


def analyse_run(rec, polls, events):
    pids = {r["pid"]: r["rank"] for r in rec["ranks"]} if rec else {}
    first_bad, n_polls, sums_bad = None, defaultdict(int), None
    last = {}                       # pid -> (slot, used, t)
    moves = defaultdict(list)
    for o in polls:
        src = o.get("src")
        if "error" in o:
            continue
        n_polls[src] += 1
        if src == "sock":
            bad = check_slots(o["slots"]) + check_ps(o["ps"]) + check_both(o["slots"], o["ps"])
            sb = check_sums(o["slots"], o["ps"])
            if sb and sums_bad is None:
                sums_bad = {"t": o.get("t"), "what": sb[0]}
            for p in o["ps"].get("processes", []):
                if p["pid"] not in pids:
                    continue
                u = {d: v["used_bytes"] for d, v in p["devices"].items()}
                prev = last.get(p["pid"])
                if prev and prev[0] != p["slot"]:
                    moves[pids[p["pid"]]].append({"from": prev[0], "to": p["slot"], "t": o.get("t"),
                                                  "before": prev[1], "after": u,
                                                  "same": prev[1] == u})
                last[p["pid"]] = (p["slot"], u, o.get("t"))
        elif src == "cli-slots":
            bad = check_slots(o.get("slots", {}))
        elif src == "cli-ps":
            bad = check_ps(o.get("ps", {}))
        else:
            bad = []
        if bad and first_bad is None:
            first_bad = {"src": src, "t": o.get("t"), "what": bad[0]}
    ev_moves = defaultdict(list)
    compactions = 0
    for e in events:
        ev = e["event"]
        if ev["kind"] == "compact" and ev["data"].get("group") == e.get("group"):
            compactions += 1
            for m in ev["data"].get("moves", []):
                if m["pid"] in pids:
                    ev_moves[pids[m["pid"]]].append(f"{m['from']}->{m['to']}")
    cnt = None
    if rec and "compactions" in rec.get("counters_after", {}):
        cnt = rec["counters_after"]["compactions"] - rec.get("counters_before", {}).get("compactions", 0)
    final = {pids[p]: {"slot": v[0], "used": v[1], "t": v[2]} for p, v in last.items()}
    return {"polls": dict(n_polls), "contiguous": first_bad is None and sum(n_polls.values()) > 0,
            "first_violation": first_bad, "group_sums_ok": sums_bad is None, "first_sum_violation": sums_bad,
            "moves": {r: moves.get(r, []) for r in (0, 1)},
            "event_moves": {r: ev_moves.get(r, []) for r in (0, 1)},
            "compact_events": compactions, "compactions_counter": cnt, "final": final}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", type=float, default=2.0)
    a = ap.parse_args()
    series, summ, recs, skipped = defaultdict(list), {}, {}, []
    for o in lines(os.path.join(a.dir, "tp.jsonl")):
        if "skipped" in o:
            skipped.append(o["skipped"])
        elif o.get("run_record"):
            recs[o["run"]] = o
        elif o.get("summary"):
            summ[(o["run"], o["rank"])] = o
        elif "dt" in o and "rank" in o:
            series[(o["run"], o["rank"])].append(o)
    polls, events = defaultdict(list), defaultdict(list)
    for o in lines(os.path.join(a.dir, "slots.jsonl")):
        polls[o["run"]].append(o)
    for o in lines(os.path.join(a.dir, "events.jsonl")):
        events[o["run"]].append(o)

    runs = list(recs) + sorted({r for r, _ in series} - set(recs))     # in the order they ran
    pairs = []
    for run in runs:
        if not run.endswith("-capped"):
            continue
        ref = run[:-len("-capped")] + "-ref"
        mode, cap = run.split("-")[0], run.split("-")[1]
        row = {"mode": mode, "cap": int(cap), "run": run, "ref": ref, "ranks": {}}
        for r in (0, 1):
            c, b = rate_after(series[(run, r)], a.skip), rate_after(series[(ref, r)], a.skip)
            sc, sb = summ.get((run, r), {}), summ.get((ref, r), {})
            row["ranks"][r] = {
                "rate": c, "ref_rate": b, "pct": 100 * c / b if c and b else None,
                "max_gap_ms": sc.get("max_gap_ms"), "p99_gap_ms": sc.get("p99_gap_ms"),
                "ref_max_gap_ms": sb.get("max_gap_ms"), "ref_p99_gap_ms": sb.get("p99_gap_ms"),
                "graph_error": sc.get("graph_error"), "graph": sc.get("graph"),
                "torch_reserved": sc.get("torch_reserved"),
            }
        row["slots"] = analyse_run(recs.get(run), polls[run], events[run])
        row["ref_slots"] = analyse_run(recs.get(ref), polls[ref], events[ref])
        rec = recs.get(run) or {}
        row["rank_rc"] = [x["rc"] for x in rec.get("ranks", [])]
        ch = defaultdict(list)
        for c in rec.get("churners", []):
            ch[("early " if c["early"] else "") + c["mode"]].append(c["rc"])
        row["churners"] = {k: v for k, v in ch.items()}
        pairs.append(row)

    def f(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    print(f"TP=2 decode, % of the same invocation's uncapped run (intervals from {a.skip:g} s)\n")
    print("| mode | SM cap | rank 0 | rank 1 | tokens/s capped (ref) | longest gap ms, capped (ref) "
          "| p99 gap ms | slots contiguous | group sums | compactions (counter) | rank slot moves (events) |")
    print("|---|---:|---:|---:|---|---|---|---|---|---|---|")
    for row in pairs:
        rk, s = row["ranks"], row["slots"]
        cont = "yes" if s["contiguous"] else ("no polls" if not s["polls"] else
                                              f"NO: t={s['first_violation']['t']} {s['first_violation']['src']}: "
                                              f"{s['first_violation']['what']}")
        if not row["ref_slots"]["contiguous"] and row["ref_slots"]["polls"]:
            cont += f"; reference run: NO ({row['ref_slots']['first_violation']['what']})"
        sums = "yes" if s["group_sums_ok"] else f"NO: {s['first_sum_violation']}"
        mv = "; ".join(f"r{r}: {' '.join(str(m['from']) + '->' + str(m['to']) for m in s['moves'][r]) or 'none'}"
                       f" ({' '.join(s['event_moves'][r]) or 'none'})" for r in (0, 1))
        print(f"| {row['mode']} | {row['cap']}% | {f(rk[0]['pct'])}% | {f(rk[1]['pct'])}% | "
              f"{f(rk[0]['rate'], '.1f')}, {f(rk[1]['rate'], '.1f')} ({f(rk[0]['ref_rate'], '.1f')}, "
              f"{f(rk[1]['ref_rate'], '.1f')}) | {f(rk[0]['max_gap_ms'], '.1f')}, {f(rk[1]['max_gap_ms'], '.1f')} "
              f"({f(rk[0]['ref_max_gap_ms'], '.1f')}, {f(rk[1]['ref_max_gap_ms'], '.1f')}) | "
              f"{f(rk[0]['p99_gap_ms'], '.1f')}, {f(rk[1]['p99_gap_ms'], '.1f')} | {cont} | {sums} | "
              f"{s['compact_events']} ({f(s['compactions_counter'], 'd')}) | {mv} |")
    print("\nDaemon accounting of each rank around its slot moves (socket polls: last poll on the old slot, "
          "first on the new one):\n")
    for row in pairs:
        s = row["slots"]
        for r in (0, 1):
            for m in s["moves"][r]:
                print(f"- {row['mode']} cap {row['cap']}% rank {r}: slot {m['from']}->{m['to']} at t={m['t']} s: "
                      f"{mib(m['before'])} -> {mib(m['after'])} ({'unchanged' if m['same'] else 'CHANGED'})")
            if not s["moves"][r]:
                print(f"- {row['mode']} cap {row['cap']}% rank {r}: no slot move seen by the polls")
            fin = s["final"].get(r)
            if fin:
                print(f"  last poll: slot {fin['slot']}, {mib(fin['used'])}; torch reserved "
                      f"{f((row['ranks'][r]['torch_reserved'] or 0) / 2**20, '.1f')} MiB")
    print()
    for row in pairs:
        errs = [row["ranks"][r]["graph_error"] for r in (0, 1) if row["ranks"][r]["graph_error"]]
        print(f"{row['mode']} cap {row['cap']}%: ranks exit {row['rank_rc']}, churners (mode: exit codes) "
              f"{row['churners']}, polls {row['slots']['polls']}"
              + (f", graph capture FAILED (ran eager): {errs[0]}" if errs else ""))
    if skipped:
        print(f"skipped (time budget): {', '.join(skipped)}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"skip": a.skip, "pairs": pairs, "skipped": skipped}, fh, indent=1)


if __name__ == "__main__":
    main()
