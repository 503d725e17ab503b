#!/bin/bash
# SM caps against the same process's own uncapped rate, one device run
# (nvidia-h200, carry .debs). Each workload runs in its own group with
# no cap; after MARK seconds of windows it touches a file, the script gives the
# group a cap in the policy file and the daemon re-reads it (SIGHUP). The
# uncapped reference is the same process's windows before that (no launch
# probe), the capped figure its windows from MARK + SETTLE on. Launch-bound
# Python loops run ±25% apart from one process to the next on the VM
# (docs/facts.md), which a comparison across processes cannot tell from the cap.
# Usage: [KINDS="small matmul graph"] [CAPS="25 50 75"] bash bench/gpu/sm_inproc.sh
. bench/gpu/prelude.sh
MARK=${MARK:-4}; SETTLE=${SETTLE:-3}; SECONDS_RUN=${SECONDS_RUN:-12}
# The daemon refuses a policy file in a directory others can write (/tmp).
mkdir -p -m 700 /run/hami-bench && P=/run/hami-bench/inproc-policy.toml
policy() {   # root-owned, 0600: the daemon refuses anything else
  (umask 077; printf '%s\n' "$1" > "$P"); chown root:root "$P"; chmod 600 "$P"
}
policy '[[group]]
match = "nobody"
memory = "1Gi"'
start_daemon --policy "$P"
R="$OUT/inproc.jsonl"; : > "$R"
for kind in ${KINDS:-small matmul graph}; do
  for cap in ${CAPS:-25 50 75}; do
    g=ip-$kind-$cap; m=/tmp/mark-$g; rm -f "$m"
    HAMI_GROUP=$g taskset -c 2 python3 bench/gpu/sm_workload.py $kind --seconds $SECONDS_RUN \
        --settle $((MARK + SETTLE)) --mark-at $MARK --mark-file "$m" --label "inproc$cap" >> "$R" &
    W=$!
    for _ in $(seq 1 600); do [ -e "$m" ] && break; sleep 0.05; done
    policy "[[group]]
match = \"$g\"
sm = $cap"
    kill -HUP $DPID
    wait $W
  done
done
$H events --socket /tmp/h.sock > "$OUT/events.txt" 2>&1
grep -i "learned\|reload" "$OUT/events.txt" | cut -c1-220
stop_daemon
python3 - "$R" "$MARK" "$SETTLE" <<'PY'
import json, sys
sys.path.insert(0, "bench/gpu")
from sm_summary import settled
mark, settle = float(sys.argv[2]), float(sys.argv[3])
print("| workload | cap | uncapped (own, before the cap) | capped (from cap + settle) | relative | target | settled after the cap |")
print("|---|---:|---:|---:|---:|---:|---:|")
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    cap = int(r["label"].removeprefix("inproc"))
    before = [v for t, v in r["windows"] if 0.5 <= t < mark - 0.25]
    after = [v for t, v in r["windows"] if t >= mark + settle]
    if not before or not after:
        print(f"| {r['kind']} | {cap} | too few windows | | | |")
        continue
    b, a = sum(before) / len(before), sum(after) / len(after)
    print(f"| {r['kind']} | {cap} | {b:.1f} | {a:.1f} | {100 * a / b:.1f}% | {cap}% "
          f"| {settled(r['windows'], b, cap, start=mark)} |")
PY
