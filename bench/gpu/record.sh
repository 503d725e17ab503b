#!/bin/bash
# Record real workloads' libcuda launches and synchronizes (and NVML's view of
# the GPU) for offline replay tests, one device run (nvidia-h200, carry
# .debs); no daemon, nothing capped. bench/gpu/record.py's own small uprobe
# program, one workload at a time, each for REC_SECONDS of its timed loop
# (plus its start-up, which is recorded too).
# Usage: [RECORD="cnn_train llm_decode llm_prefill phased graph_replay"] [REC_SECONDS=10]
#        bash bench/gpu/record.sh ; results in $OUT/traces/<workload>.json.gz
#        (format: bench/gpu/record.py's docstring) and record.jsonl (one line each).
T0=$(date +%s)
. bench/gpu/prelude.sh
mkdir -p "$OUT/traces"
echo "libcuda: $LIB; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
timeout -k 10 ${REC_TIMEOUT:-560} python3 bench/gpu/record.py --lib "$LIB" --out "$OUT/traces" \
    --seconds "${REC_SECONDS:-10}" ${RECORD:-cnn_train llm_decode llm_prefill phased graph_replay} \
    | tee "$OUT/record.jsonl"
echo "record exit ${PIPESTATUS[0]}"
ls -l "$OUT/traces"
echo "record done after $(( $(date +%s) - T0 )) s"
