#!/bin/bash
# SM caps against the same process's own uncapped rate, one device run
# (nvidia-h200, carry .debs): bench/gpu/suite_ab.py changes each workload's
# cap while it runs (policy file + SIGHUP): uncapped, 25, uncapped, 50,
# uncapped, 75, uncapped. Section pairab: bench/gpu/pair_ab.py runs each pair
# of PAIRS (a:b) together at each split of SPLITS, each side against its own
# stretches alone (the other stopped). Section pair: the pairs of
# bench/gpu/suite.sh (each side against a separate reference run).
# Usage: [DAEMON_ARGS="--sm-hold-ms 100"] [AB_WORKLOADS="llm_decode cnn_train jax_train phased"] [CAPS="25 50 75"]
#        [AB_REF_S=6] [AB_CAP_S=9] [PAIRS="cnn_train:llm_decode"] [SPLITS="30:70 50:50"]
#        [PAB_REF_S=8] [PAB_CAP_S=30] [SECTIONS="ab pair"] bash bench/gpu/suite_ab.sh
# Results in $OUT: ab.jsonl, ab.md, ab-<workload>.log, pab.jsonl, pab.md,
# pab-<pair>-<side>.log, daemon.log (+ the pair files).
T0=$(date +%s)
SECTIONS=${SECTIONS:-ab pair}
. bench/gpu/prelude.sh
# The daemon refuses a policy file in a directory others can write (/tmp).
mkdir -p -m 700 /run/hami-bench && P=/run/hami-bench/ab-policy.toml
(umask 077; printf '[[group]]\nmatch = "nobody"\nmemory = "1Gi"\n' > "$P"); chown root:root "$P"
case " $SECTIONS " in *" ab "*|*" pairab "*)
  start_daemon --sm-limits -v --policy "$P" ${DAEMON_ARGS:-}
  echo "daemon ready after $(( $(date +%s) - T0 )) s"
  case " $SECTIONS " in *" ab "*)
    python3 bench/gpu/suite_ab.py --policy "$P" --daemon-pid "$DPID" --out "$OUT" > "$OUT/ab.jsonl"
    sed -n '/^|/,$p' "$OUT/ab.jsonl" | tee "$OUT/ab.md"
    echo "in-process section done after $(( $(date +%s) - T0 )) s"
  esac
  case " $SECTIONS " in *" pairab "*)
    python3 bench/gpu/pair_ab.py --policy "$P" --daemon-pid "$DPID" --out "$OUT" > "$OUT/pab.jsonl"
    sed -n '/^|/,$p' "$OUT/pab.jsonl" | tee "$OUT/pab.md"
    echo "pairs against their own stretches alone done after $(( $(date +%s) - T0 )) s"
  esac
  timeout 20 $H events --json --socket /tmp/h.sock > "$OUT/ab-events.json" 2>&1
  stop_daemon
esac
case " $SECTIONS " in *" pair "*)
  SECTIONS=pair SUITE_BUDGET=$(( ${AB_TOTAL:-560} - ($(date +%s) - T0) )) bash bench/gpu/suite.sh
esac
