#!/usr/bin/env python3
"""Memory limit on a real GPU, HAMi-style: run with CUDA_DEVICE_MEMORY_LIMIT set
(e.g. 8g) under a hami-bpf daemon. Shows what the workload sees: the virtual
total from mem_get_info, a catchable torch.OutOfMemoryError when filling, and
that the process goes on after del + empty_cache. Prints one JSON object.
"""
import json
import os
import time

import torch


def main() -> None:
    out = {"limit_env": os.environ.get("CUDA_DEVICE_MEMORY_LIMIT"),
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")}
    torch.empty(1, device="cuda")
    time.sleep(0.5)  # the daemon registers the process and sets its group's limit
    free, total = torch.cuda.mem_get_info()
    out["mem_get_info_gib"] = [round(free / 2**30, 3), round(total / 2**30, 3)]
    chunks, oom = [], None
    t0 = time.monotonic()
    try:
        for _ in range(200):
            chunks.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        oom = type(e).__name__ + ": " + str(e).splitlines()[0][:160]
    out["filled_gib_before_oom"] = len(chunks)
    out["oom"] = oom
    out["fill_seconds"] = round(time.monotonic() - t0, 3)
    del chunks
    torch.cuda.empty_cache()
    x = torch.randn(4096, 4096, device="cuda")
    y = (x @ x).sum().item()
    out["after_oom_matmul_ok"] = bool(y == y)
    free, total = torch.cuda.mem_get_info()
    out["mem_get_info_after_gib"] = [round(free / 2**30, 3), round(total / 2**30, 3)]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
