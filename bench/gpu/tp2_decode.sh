#!/bin/bash
# Tensor-parallel decode on two GPUs (nvidia-h200-x2, carry .debs): both ranks
# of workloads/tp_decode.py in one hami-bpf group. For each mode (eager, CUDA
# graphs) and SM cap (50, 30): an uncapped reference run in its own group,
# then the capped run (CUDA_DEVICE_SM_LIMIT) while members of the same group
# start and leave around it (clean exit, SIGKILL, abort, segfault) so that
# each rank's slot moves. tp2_decode_run.py runs one of them and records;
# tp2_summary.py reads $OUT/tp.jsonl, slots.jsonl, events.jsonl.
# About 6 minutes; a run that would end past BUDGET_S (default 450 s after the
# script started, bcc set-up included) is skipped and listed, so the whole
# stays under 9 minutes.

# No NVLink multicast in any process started here (the daemon included);
# tp2_decode_run.py also sets these for each child explicitly.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. bench/gpu/prelude.sh
SECONDS_RUN=${SECONDS_RUN:-12}
BUDGET_S=${BUDGET_S:-450}
nvidia-smi -L
nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
rm -f "$OUT/tp.jsonl" "$OUT/slots.jsonl" "$OUT/events.jsonl"
start_daemon --sm-limits -v
port=29640
for mode in ${MODES:-eager graphs}; do
  flag=""; [ "$mode" = graphs ] && flag=--graphs
  for cap in ${CAPS:-50 30}; do
    for kind in ref capped; do
      # A run takes the timed loop plus ~20 s of start-up (torch, NCCL, model, capture).
      if [ $((SECONDS + SECONDS_RUN + 30)) -gt "$BUDGET_S" ]; then
        echo "{\"skipped\": \"$mode-$cap-$kind\"}" | tee -a "$OUT/tp.jsonl"
        continue
      fi
      port=$((port + 1))
      if [ $kind = ref ]; then
        args="--group free-$mode-$cap"
      else
        args="--group tp-$mode-$cap --cap $cap --churn"
      fi
      timeout $((SECONDS_RUN + 100)) python3 bench/gpu/tp2_decode_run.py --run "$mode-$cap-$kind" $args $flag \
          --seconds "$SECONDS_RUN" --port $port --socket /tmp/h.sock --out "$OUT" --limit $((SECONDS_RUN + 75))
      echo "$mode-$cap-$kind: exit $? at ${SECONDS} s"
    done
  done
done
$H events --json --socket /tmp/h.sock > "$OUT/events_all.jsonl" 2>&1
$H slots --json --socket /tmp/h.sock > "$OUT/slots_end.json" 2>&1
stop_daemon
python3 bench/gpu/tp2_summary.py "$OUT" --json "$OUT/tp2_summary.json" | tee "$OUT/tp2_summary.md"
echo "total ${SECONDS} s"
