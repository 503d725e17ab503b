#!/bin/bash
# How steady is a launch-bound loop's own speed on the GPU VM, without
# hami-bpf? The small-kernel loop of sm_workload.py, pinned to CPU 2, alone,
# next to a busy loop on CPU 2's SMT sibling, and next to one on another core.
# Prints the CPU topology and each run's 0.25 s windows (thousand kernels/s).
# Usage (nvidia-h200): bash bench/gpu/host_speed.sh
set -u
lscpu | grep -iE "model name|thread|core|socket|MHz" | head -8
sib=$(cat /sys/devices/system/cpu/cpu2/topology/thread_siblings_list)
echo "cpu2 siblings: $sib"
other=$(echo "$sib" | tr ',-' '\n\n' | grep -vx 2 | head -1)
far=10
run() {
  taskset -c 2 python3 bench/gpu/sm_workload.py small --seconds ${SECS:-8} --settle 1 --label "$1" |
    python3 -c "
import json, sys
r = json.loads(sys.stdin.readline())
ws = [v / 1000 for _t, v in r['windows']]
print(f\"{r['label']:>14}: mean {sum(ws) / len(ws):.0f}k, min {min(ws):.0f}k, max {max(ws):.0f}k |\",
      ' '.join(f'{v:.0f}' for v in ws))"
}
run alone
if [ -n "$other" ] && [ "$other" != 2 ]; then
  taskset -c "$other" python3 -c "while True: pass" & H=$!
  run "sibling-busy"; kill $H
else
  echo "cpu2 has no SMT sibling"
fi
taskset -c $far python3 -c "while True: pass" & H=$!
run "cpu$far-busy"; kill $H
run alone-again
