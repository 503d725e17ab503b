#!/bin/bash
# End-to-end throughput and allocation latency, one device run (nvidia-h200,
# carry .debs): a training step and an inference loop, bare (no
# daemon), observed (daemon, no limits), with a memory cap (32 GiB) and with an
# SM cap (50); and, in one process, allocation + launch host time with no
# daemon, with the daemon (memory cap in force), and with no daemon again.
# Usage: bash bench/gpu/e2e.sh ; results in $OUT (e2e.jsonl, alloc.jsonl)
. bench/gpu/prelude.sh
E="$OUT/e2e.jsonl"; : > "$E"
PIN="taskset -c 2"    # one CPU for every run: see sm_bench.sh
# Same process: allocation and launch host time, no daemon / daemon / no daemon.
mkdir -p "$OUT/ph"
HAMI_GROUP=alloc CUDA_DEVICE_MEMORY_LIMIT=64g $PIN python3 bench/gpu/launch_cost.py \
    --phases nodaemon,daemon,nodaemon2 --dir "$OUT/ph" > "$OUT/alloc.jsonl" &
L=$!
sleep 10
phase nodaemon
start_daemon --sm-limits
sleep 1
phase daemon
stop_daemon
phase nodaemon2
wait $L
cat "$OUT/alloc.jsonl"
for kind in train infer; do
  HAMI_GROUP=bare-$kind $PIN python3 bench/gpu/e2e.py $kind --label bare | tee -a "$E"
done
start_daemon --sm-limits
for kind in train infer; do
  HAMI_GROUP=obs-$kind $PIN python3 bench/gpu/e2e.py $kind --label observed | tee -a "$E"
  HAMI_GROUP=mem-$kind CUDA_DEVICE_MEMORY_LIMIT=32g $PIN python3 bench/gpu/e2e.py $kind --label memcap32g | tee -a "$E"
  HAMI_GROUP=sm-$kind CUDA_DEVICE_SM_LIMIT=50 $PIN python3 bench/gpu/e2e.py $kind --label smcap50 | tee -a "$E"
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
