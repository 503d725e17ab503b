#!/bin/bash
# Real workloads under SM caps, one device run (nvidia-h200, carry .debs):
# the daemon once (--sm-limits), then bench/gpu/suite_run.py: each workload's
# uncapped reference, then one run per cap and workload, the service scenario
# (llm_decode capped while members of its group come and go), pairs of groups
# side by side.
# Every ratio is against the same invocation's uncapped reference.
# Usage: [QUICK=1] [WORKLOADS="cnn_train llm_decode ..."] [CAPS="25 50 75"]
#        [PAIRS="cnn_train:llm_decode llm_prefill:cnn_train"] [SPLITS="30:70 50:50"]
#        [SECTIONS="single service pair twin"] [TWINS=llm_decode] [SUITE_SECONDS=10] [SUITE_BUDGET=s]
#        [ORDER=refs-first|per-workload]
#        [DAEMON_ARGS=...] [DAEMON_CPUS=10-15] [PIN=0] bash bench/gpu/suite.sh
# Results in $OUT: suite.jsonl (raw, tagged lines), summary.md and summary.json
# (bench/gpu/suite_summary.py), events.json (the daemon's events, JSON lines),
# daemon.log, logs/ (each workload's stderr). The default selection takes
# about 9 minutes; a run that would end past SUITE_BUDGET is skipped and listed.
T0=$(date +%s)
. bench/gpu/prelude.sh
cleanup() {
  if [ -n "${DPID:-}" ] && kill -0 "$DPID" 2>/dev/null; then
    timeout 20 $H events --json --socket /tmp/h.sock > "$OUT/events.json" 2>&1
    timeout 30 bash -c "kill -TERM $DPID; while kill -0 $DPID 2>/dev/null; do sleep 0.2; done" \
      || kill -KILL "$DPID"
    wait "$DPID" 2>/dev/null; echo "daemon exit $?"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
echo "libcuda: $LIB; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
start_daemon --sm-limits -v ${DAEMON_ARGS:-}
kill -0 "$DPID" 2>/dev/null || { echo "daemon did not start"; tail -20 "$OUT/daemon.log"; exit 1; }
echo "daemon ready after $(( $(date +%s) - T0 )) s"
: > "$OUT/suite.jsonl"
BUDGET=${SUITE_BUDGET:-$(( 540 - ($(date +%s) - T0) ))}
DAEMON_PID=$DPID python3 bench/gpu/suite_run.py --out "$OUT" --budget "$BUDGET"
cleanup; trap - EXIT
python3 bench/gpu/suite_summary.py "$OUT/suite.jsonl" --json "$OUT/summary.json" | tee "$OUT/summary.md"
echo "suite done after $(( $(date +%s) - T0 )) s"
