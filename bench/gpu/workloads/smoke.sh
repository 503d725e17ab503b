#!/bin/bash
# Do the real workloads start and run? All at once, a few seconds each, no
# daemon and no bcc (rates side by side on one GPU mean nothing here).
# Usage: [WORKLOADS="cnn_train ..."] [SMOKE_SECONDS=3] bash bench/gpu/workloads/smoke.sh
# Prints each one's summary line, or its exit status and the end of its stderr.
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/smoke}; mkdir -p "$OUT"
ALL="cnn_train llm_decode llm_prefill graph_replay jax_train triton_loop phased compiled_train bert_infer gpt2_decode loader_train lstm_train t5_generate threaded_infer jax_decode unet_sample cupy_fluid"
declare -A P
for w in ${WORKLOADS:-$ALL}; do
  timeout -k 5 ${SMOKE_TIMEOUT:-180} python3 $w.py --seconds ${SMOKE_SECONDS:-3} > "$OUT/smoke-$w.out" 2> "$OUT/smoke-$w.err" &
  P[$w]=$!
done
rc_all=0
for w in ${WORKLOADS:-$ALL}; do
  wait ${P[$w]}; rc=$?
  if [ $rc = 0 ] && grep -q '"summary": true' "$OUT/smoke-$w.out"; then
    echo "ok   $w: $(grep '"summary": true' "$OUT/smoke-$w.out" | cut -c1-400)"
  else
    rc_all=1
    echo "FAIL $w: exit $rc"; tail -15 "$OUT/smoke-$w.err" | sed 's/^/     /'
  fi
done
exit $rc_all
