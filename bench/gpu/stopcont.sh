#!/bin/bash
# Where a hold's cost comes from, one device run (nvidia-h200, carry .debs):
# bench/gpu/stopcont.py runs each workload once on a plan that mixes free
# stretches, stretches the script stops itself (dC: SIGSTOP/SIGCONT at
# SC_PERIOD, no cap), and stretches the daemon caps (capC: its policy file
# rewritten, then SIGHUP). Every stretch is read the same way: its rate per
# second of running against the free stretches beside it, and that rate by
# time since the last resume (units placed against the stops /proc showed),
# so a stop that costs a warm-up and a hold that slows the loop throughout
# look different.
# Usage: [SC_WORKLOADS="llm_decode phased"] [SC_PERIOD=0.4] [SC_PINS="2-5 2"]
#        [SC_PLAN="free:5 cap50:8 free:5 d50:8 free:5 cap99:8 free:5 cap50:8 free:5"]
#        [DAEMON_ARGS=...] bash bench/gpu/stopcont.sh
# Results: $OUT/stopcont.jsonl (one line per invocation), stopcont.md, events.json, daemon.log.
T0=$(date +%s)
. bench/gpu/prelude.sh
# The daemon refuses a policy file in a directory others can write (/tmp).
mkdir -p -m 700 /run/hami-bench && P=/run/hami-bench/sc-policy.toml
(umask 077; printf '[[group]]\nmatch = "nobody"\nmemory = "1Gi"\n' > "$P"); chown root:root "$P"
DAEMON_CPUS=${DAEMON_CPUS-10-15} start_daemon --sm-limits -v --policy "$P" ${DAEMON_ARGS:-}
echo "daemon ready after $(( $(date +%s) - T0 )) s"
PLAN=${SC_PLAN:-free:5 cap50:8 free:5 d50:8 free:5 cap99:8 free:5 cap50:8 free:5}
for W in ${SC_WORKLOADS:-llm_decode phased}; do
  for PIN in ${SC_PINS:-2-5}; do
    timeout 200 taskset -c 10-15 python3 bench/gpu/stopcont.py --workload "$W" --period "${SC_PERIOD:-0.4}" \
        --pin "$PIN" --plan "$PLAN" --policy "$P" --daemon-pid "$DPID" --label "pin $PIN" \
        --json "$OUT/stopcont.jsonl" 2>> "$OUT/stopcont.err" | grep -v '^|---' | tee -a "$OUT/stopcont.md"
  done
done
timeout 20 $H events --json --socket /tmp/h.sock > "$OUT/events.json" 2>&1
stop_daemon
echo "stopcont done after $(( $(date +%s) - T0 )) s"
