#!/bin/bash
# End-to-end throughput and allocation latency, one device run (nvidia-h200,
# carry .debs .device): a training step and an inference loop, bare (no
# daemon), observed (daemon, no limits), with a memory cap (32 GiB) and with an
# SM cap (50); and, in one process, allocation + launch host time with no
# daemon, with the daemon (memory cap in force), and with no daemon again.
# Usage: bash bench/gpu/e2e.sh ; results in $OUT (e2e.jsonl, alloc.jsonl)
set -u
OUT=${OUT:-$PWD/bench-out}; mkdir -p "$OUT"
bash .device/setup-bcc.sh .debs > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
. /tmp/bccroot/env.sh
LIB=$(ls /usr/local/nvidia/lib64/libcuda.so.*.* | head -1)
H="python3 bench/hami.py"
E="$OUT/e2e.jsonl"; : > "$E"
start_daemon() {
  : > "$OUT/daemon.log"
  $H run --libcuda "$LIB" --group-by env:HAMI_GROUP --socket /tmp/h.sock --state-dir /tmp/hs \
      --sm-limits > /dev/null 2>> "$OUT/daemon.log" &
  DPID=$!
  for i in $(seq 1 240); do grep -q "ready" "$OUT/daemon.log" && break; sleep 0.25; done
}
stop_daemon() { kill -TERM $DPID; wait $DPID; echo "daemon exit $?"; }
# Same process: allocation and launch host time, no daemon / daemon / no daemon.
mkdir -p "$OUT/ph"
HAMI_GROUP=alloc CUDA_DEVICE_MEMORY_LIMIT=64g python3 bench/gpu/launch_cost.py \
    --phases nodaemon,daemon,nodaemon2 --dir "$OUT/ph" > "$OUT/alloc.jsonl" &
L=$!
phase() {
  touch "$OUT/ph/go-$1"
  for i in $(seq 1 600); do [ -e "$OUT/ph/done-$1" ] && return; sleep 0.1; done
  echo "phase $1 timed out"
}
sleep 10
phase nodaemon
start_daemon
sleep 1
phase daemon
stop_daemon
phase nodaemon2
wait $L
cat "$OUT/alloc.jsonl"
for kind in train infer; do
  HAMI_GROUP=bare-$kind python3 bench/gpu/e2e.py $kind --label bare | tee -a "$E"
done
start_daemon
for kind in train infer; do
  HAMI_GROUP=obs-$kind python3 bench/gpu/e2e.py $kind --label observed | tee -a "$E"
  HAMI_GROUP=mem-$kind CUDA_DEVICE_MEMORY_LIMIT=32g python3 bench/gpu/e2e.py $kind --label memcap32g | tee -a "$E"
  HAMI_GROUP=sm-$kind CUDA_DEVICE_SM_LIMIT=50 python3 bench/gpu/e2e.py $kind --label smcap50 | tee -a "$E"
done
$H events --socket /tmp/h.sock 2>&1 | grep -i "learned\|deny\|error" | cut -c1-220
stop_daemon
python3 - "$E" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
base = {r["kind"]: r["steps_per_s"] for r in rows if r["label"] == "bare"}
print("| workload | configuration | steps/s | relative to bare |")
print("|---|---|---:|---:|")
for r in rows:
    print(f"| {r['kind']} | {r['label']} | {r['steps_per_s']} | {100 * r['steps_per_s'] / base[r['kind']]:.1f}% |")
PY
