#!/bin/bash
# What stops cost a workload with the daemon's probes on it, one device run
# (nvidia-h200, carry .debs): bench/gpu/stopcont.py's plan of free and duty
# stretches (SIGSTOP/SIGCONT from the script), run once with no daemon, then
# with the daemon attached and the workload's group capped at 99 (launch and
# synchronize probes on every call, the pacer's own holds ~1% of the time).
# If probes and stops together cost more than each alone, the second run's
# duty stretches fall further below its free stretches than the first's.
# Usage: [SC_WORKLOAD=llm_decode] [SC_PERIOD=0.4] [SC_PLAN="free:5 d50:6 free:5 d50:6 free:5"]
#        [SC_REPEAT=2] bash bench/gpu/stopcont.sh ; results in $OUT/stopcont.jsonl
#        (one line per stopcont invocation, "label" nodaemon or probes).
T0=$(date +%s)
. bench/gpu/prelude.sh
W=${SC_WORKLOAD:-llm_decode}
PLAN=${SC_PLAN:-free:5 d50:6 free:5 d50:6 free:5}
sc() {
  timeout 120 python3 bench/gpu/stopcont.py --workload "$W" --period "${SC_PERIOD:-0.4}" --pin 2 \
      --plan "$PLAN" --label "$1" --json "$OUT/stopcont.jsonl" 2>> "$OUT/stopcont.err" | grep -v '^|---'
}
for _ in $(seq 1 "${SC_REPEAT:-2}"); do
  sc nodaemon
  start_daemon --sm-limits -v
  HAMI_GROUP=stopcont CUDA_DEVICE_SM_LIMIT=99 sc probes
  stop_daemon
done
echo "stopcont done after $(( $(date +%s) - T0 )) s"
