# Sourced by every bench/gpu/*.sh on the device machine: $OUT, bcc from the
# carried .deb files (carry .debs: bench/gpu/bcc/fetch-bcc-debs.sh), the real libcuda in $LIB, the
# CLI from this checkout in $H, and start_daemon/stop_daemon helpers.
set -u
OUT=${OUT:-$PWD/bench-out}; mkdir -p "$OUT"
bash bench/gpu/bcc/setup-bcc.sh .debs > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
. /tmp/bccroot/env.sh
LIB=$(ls /usr/local/nvidia/lib64/libcuda.so.*.* 2>/dev/null | head -1)
[ -n "$LIB" ] || LIB=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
H="python3 bench/hami.py"

# start_daemon [ARGS...]: the daemon on $LIB, grouping by $GROUP_BY (default
# env:HAMI_GROUP), serving /tmp/h.sock, stderr appended to $OUT/daemon.log;
# on the CPUs $DAEMON_CPUS lists (taskset form) where it is set; returns once
# it says "ready".
start_daemon() {
  local before
  before=$(grep -c "ready" "$OUT/daemon.log" 2>/dev/null)
  ${DAEMON_CPUS:+taskset -c "$DAEMON_CPUS"} $H run --libcuda "$LIB" --group-by "${GROUP_BY:-env:HAMI_GROUP}" --socket /tmp/h.sock --state-dir /tmp/hs \
      "$@" > /dev/null 2>> "$OUT/daemon.log" &
  DPID=$!
  for _ in $(seq 1 240); do
    [ "$(grep -c "ready" "$OUT/daemon.log" 2>/dev/null)" -gt "${before:-0}" ] && return
    kill -0 "$DPID" 2>/dev/null || { echo "daemon exited before ready"; tail -5 "$OUT/daemon.log"; exit 1; }
    sleep 0.25
  done
  echo "daemon not ready after 60 s"; tail -5 "$OUT/daemon.log"
}
stop_daemon() { kill -TERM "$DPID"; wait "$DPID"; echo "daemon exit $?"; }

# phase NAME: let bench/gpu/launch_cost.py (--dir $OUT/ph) measure one phase,
# and return once it has.
phase() {
  touch "$OUT/ph/go-$1"
  for _ in $(seq 1 600); do [ -e "$OUT/ph/done-$1" ] && return; sleep 0.1; done
  echo "phase $1 timed out"
}
