#!/usr/bin/env python3
"""Accounting accuracy on a real GPU: hami-bpf's per-process usage against
PyTorch's own view (memory_reserved) and the device's (NVML used).

Run by bench/gpu/run.sh with a daemon already serving --socket. Prints one JSON
object per checkpoint; the allocator is chosen with PYTORCH_CUDA_ALLOC_CONF.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from hami_bpf.server import fetch_snapshot  # noqa: E402


def hami_used(sock: str, pid: int, settle: float = 0.3) -> int | None:
    time.sleep(settle)
    snap = fetch_snapshot(sock)
    p = snap.process(pid)
    return None if p is None else sum(d.used_bytes for d in p.devices.values())
    return None


def nvml_used() -> int | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--label", default=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"))
    a = ap.parse_args()
    pid = os.getpid()
    base_nvml = nvml_used()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    ctx_nvml = nvml_used()
    keep = []
    steps = [("256MiB", [256 << 20]), ("1GiB", [1 << 30]), ("3GiB", [3 << 30]),
             ("100x8MiB", [8 << 20] * 100), ("1000x64KiB", [64 << 10] * 1000),
             ("matmul 8192^2 bf16", None)]
    for name, sizes in steps:
        if sizes is None:
            x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            keep.append(x @ x)
        else:
            keep.extend(torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes)
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        used = hami_used(a.socket, pid)
        nv = nvml_used()
        row = {"allocator": a.label, "step": name, "torch_reserved": reserved, "hami_used": used,
               "error_vs_reserved_pct": None if not used else round(100.0 * (used - reserved) / reserved, 3),
               "nvml_used_minus_baseline": None if nv is None or base_nvml is None else nv - base_nvml,
               "context_estimate": None if ctx_nvml is None or base_nvml is None else ctx_nvml - base_nvml}
        print(json.dumps(row), flush=True)
    del keep
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    print(json.dumps({"allocator": a.label, "step": "after empty_cache",
                      "torch_reserved": torch.cuda.memory_reserved(),
                      "hami_used": hami_used(a.socket, pid)}), flush=True)


if __name__ == "__main__":
    main()
