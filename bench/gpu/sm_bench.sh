#!/bin/bash
# SM limiting on one GPU, one device run (nvidia-h200, carry .debs):
#   each workload uncapped, then capped at 25/50/75 (HAMi's CUDA_DEVICE_SM_LIMIT);
#   two groups at 30/70 side by side (matmul, then small kernels);
#   host time per launch: no probe vs launch probes attached (same process).
# Usage: [SECTIONS="single pair cost"] [KINDS="matmul small graph"] [PAIR_KINDS="matmul small"]
#        [PAIR_SKEW=S: the 70 group starts S seconds before the 30 one]
#        [DAEMON_ARGS=--no-sm-turns] bash bench/gpu/sm_bench.sh ; results in
# $OUT (sm.jsonl, launch.jsonl, daemon.log). A pair's "relative to uncapped"
# needs the single section's uncapped rows in the same sm.jsonl.
SECTIONS=${SECTIONS:-single pair cost}
want() { case " $SECTIONS " in *" $1 "*) return 0;; esac; return 1; }
. bench/gpu/prelude.sh
R="$OUT/sm.jsonl"; : > "$R"
t0=$(date +%s)
start_daemon --sm-limits -v ${DAEMON_ARGS:-}
echo "daemon ready after $(( $(date +%s) - t0 )) s: $(grep -m1 'launch_probe_cost\|probe' "$OUT/daemon.log" | head -1)"
W=bench/gpu/sm_workload.py
# Each workload on a fixed CPU: unpinned, the same host loop ran at ~82k or
# ~118k kernels/s depending on where it landed (and moved mid-run), which a
# comparison across processes cannot tell from the cap.
PIN="taskset -c 2"; PIN_B="taskset -c 6"
uncapped() {
  HAMI_GROUP=base-$1 $PIN python3 $W $1 --seconds 8 --settle 3 --label uncapped | tee -a "$R" | cut -c1-150
}
want single && for kind in ${KINDS:-matmul small graph}; do
  uncapped $kind
  for cap in 25 50 75; do
    HAMI_GROUP=cap$cap-$kind CUDA_DEVICE_SM_LIMIT=$cap $PIN python3 $W $kind --seconds 8 --settle 3 \
        --label cap$cap | tee -a "$R" | cut -c1-150
  done
done
PAIR_KINDS=${PAIR_KINDS:-matmul small}; SKEW=${PAIR_SKEW:-0}
want single || for kind in $PAIR_KINDS; do uncapped $kind; done   # the pairs' baselines
want pair && for kind in $PAIR_KINDS; do
  echo "== two groups 30/70 ($kind), the 30 one ${SKEW} s after the 70 one"
  # matmul synchronizes every ~2 s when shared: longer, to see it settle.
  [ $kind = matmul ] && s=16 st=8 || s=12 st=5
  T="--seconds $s --settle $st"
  # The first one's steady windows are the same stretch of time as the other's.
  T70="--seconds $(( s + SKEW )) --settle $(( st + SKEW ))"
  HAMI_GROUP=g70-$kind CUDA_DEVICE_SM_LIMIT=70 $PIN_B python3 $W $kind $T70 --label pair70 >> "$R" &
  B=$!
  sleep "$SKEW"
  HAMI_GROUP=g30-$kind CUDA_DEVICE_SM_LIMIT=30 $PIN python3 $W $kind $T --label pair30 >> "$R" &
  A=$!
  wait $A $B
done
if want cost; then
echo "== host time per launch, one process: no probe, then launch probes attached"
$PIN python3 bench/gpu/launch_cost.py --phases noprobe,probed,noprobe2 --dir "$OUT/ph" > "$OUT/launch.jsonl" &
L=$!
mkdir -p "$OUT/ph"; sleep 8
phase noprobe
HAMI_GROUP=keeper CUDA_DEVICE_SM_LIMIT=50 python3 -c "import torch,time; torch.zeros(1,device='cuda'); time.sleep(3600)" &
K=$!
for i in $(seq 1 100); do $H ps --socket /tmp/h.sock --json 2>/dev/null | grep -q '"keeper"' && break; sleep 0.2; done
sleep 2
phase probed
kill $K; wait $K 2>/dev/null
sleep 6       # the last cap left: launch probes detach in the background
phase noprobe2
wait $L
cat "$OUT/launch.jsonl"
fi
$H events --socket /tmp/h.sock > "$OUT/events.txt" 2>&1
grep -i "learned\|turns\|raised\|alone\|released" "$OUT/events.txt" | cut -c1-220
kill -TERM $DPID; wait $DPID; echo "daemon exit $? after $(( $(date +%s) - t0 )) s"
python3 bench/gpu/sm_summary.py "$R"
