#!/usr/bin/env python3
"""Host-side cost of hami-bpf's probes, measured in the calling process.

  alloc   cuMemAlloc_v2 + cuMemFree_v2 of 1 MiB through ctypes on the real
          libcuda (allocation probes: entry + return + free)
  torchop a small PyTorch op (x.add_(1) on 1024 floats): launch path; no launch
          probe is attached unless SM limits or --count-launches ask for one

Prints one JSON line: microseconds per call (median of 5 batches).
"""
import ctypes
import json
import statistics
import sys
import time


def lib():
    for name in ("libcuda.so.1",):
        return ctypes.CDLL(name)


def bench_alloc(cu, n=2000):
    ptr = ctypes.c_uint64()
    out = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
            cu.cuMemFree_v2(ptr)
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def bench_torch(n=20000):
    import torch
    x = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    cu = lib()
    assert cu.cuInit(0) == 0
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    print(json.dumps({"label": label, "alloc_free_us": round(bench_alloc(cu), 3),
                      "torch_small_op_us": round(bench_torch(), 3)}), flush=True)


if __name__ == "__main__":
    main()
