#!/bin/bash
# The reported failure in kind, on nvidia-h200-x2 (carry .debs): a TP=2
# NCCL decode loop (matmul + all-reduce + a host sync per step), eager and
# with CUDA graphs; each first uncapped (its own group, no churn: the
# reference rate), then in group `tp` with a 40 GiB memory cap and
# CUDA_DEVICE_SM_LIMIT=50 while other members of `tp` start and exit
# (clean, SIGKILL, crash). See tp2_churn.py for what is recorded.
. bench/gpu/prelude.sh
nvidia-smi -L
start_daemon --sm-limits -v
port=29533
for mode in ${MODES:-eager graph}; do
  port=$((port + 1))
  mkdir -p "$OUT/free-$mode" "$OUT/tp-$mode"
  HAMI_GROUP=free-$mode MASTER_PORT=$port timeout 120 python3 bench/gpu/tp2_churn.py --mode $mode \
      --seconds 10 --no-churn --socket /tmp/h.sock --out "$OUT/free-$mode" | tee -a "$OUT/tp2.jsonl"
  port=$((port + 1))
  HAMI_GROUP=tp CUDA_DEVICE_MEMORY_LIMIT=40g CUDA_DEVICE_SM_LIMIT=50 MASTER_PORT=$port \
    timeout 150 python3 bench/gpu/tp2_churn.py --mode $mode --seconds 25 --socket /tmp/h.sock \
      --out "$OUT/tp-$mode" | tee -a "$OUT/tp2.jsonl"
done
python3 bench/hami.py events --socket /tmp/h.sock > "$OUT/events.txt" 2>&1
grep -i "learned" "$OUT/events.txt" | cut -c1-220
echo "compactions: $(grep -c "compact" "$OUT/events.txt")"
kill -TERM $DPID; wait $DPID; echo "daemon exit $?"
python3 - "$OUT/tp2.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
free = {r["mode"]: r["steps_per_s"] for r in rows if not r.get("sm_limit")}
print("| mode | SM cap | steps/s per rank | relative to uncapped | longest gap | p99 gap | churners | slots contiguous | rank slot moves |")
print("|---|---:|---|---|---:|---:|---:|---|---|")
for r in rows:
    f = free.get(r["mode"])
    rel = ", ".join(f"{100 * s / b:.0f}%" for s, b in zip(r["steps_per_s"], f)) if f else "-"
    print(f"| {r['mode']} | {r.get('sm_limit') or '-'} | {', '.join(f'{s:.1f}' for s in r['steps_per_s'])} | "
          f"{rel} | {r['max_gap_s']:.3f} s | {max(r['step_gap_p99_s']):.3f} s | {r['churners']} | "
          f"{r['slots_contiguous']} | {r['rank_moves']} |")
    print("  accounting:", r["accounting"], "graph_error:", r.get("graph_error"))
PY
