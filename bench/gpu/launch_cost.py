#!/usr/bin/env python3
"""Host time per launch in one process, phase by phase (same-process A/B).

The caller (sm_bench.sh, e2e.sh) changes what hami-bpf does between phases
(starts or stops the daemon, makes launch probes attach) and touches
DIR/go-PHASE; this process then measures and touches DIR/done-PHASE.
Per phase, one JSON line, microseconds per call (best of 5 batches):
  cupy_raw     a CuPy RawKernel on 1024 floats
  torch_op     x.add_(1) on 1024 floats
  triton       a Triton kernel on 1024 floats
  alloc_free   cuMemAlloc_v2 + cuMemFree_v2 of 1 MiB through ctypes
"""
import argparse
import ctypes
import json
import os
import time


def best_of(fn, n, batches=5, sync=None):
    best = float("inf")
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if sync:
            sync()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return round(best, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", required=True)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    import torch
    x = torch.zeros(1024, device="cuda")
    sync = torch.cuda.synchronize
    kinds = {"torch_op": lambda: x.add_(1)}
    try:
        import cupy as cp
        k = cp.RawKernel(r'''extern "C" __global__ void inc(float* a) {
            a[blockIdx.x * blockDim.x + threadIdx.x] += 1.0f; }''', "inc")
        y = cp.zeros(1024, dtype=cp.float32)
        kinds["cupy_raw"] = lambda: k((4,), (256,), (y,))
    except Exception as e:  # noqa: BLE001 - report and go on
        print(json.dumps({"cupy_error": str(e)[:200]}), flush=True)
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def inc_kernel(p, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = i < n
            tl.store(p + i, tl.load(p + i, mask=m) + 1.0, mask=m)

        z = torch.zeros(1024, device="cuda")
        kinds["triton"] = lambda: inc_kernel[(4,)](z, 1024, BLOCK=256)
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"triton_error": str(e)[:200]}), flush=True)
    cu = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.c_uint64()

    def alloc_free():
        cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
        cu.cuMemFree_v2(ptr)

    for f in kinds.values():   # warm up (Triton compiles here)
        for _ in range(100):
            f()
    sync()
    for ph in a.phases.split(","):
        go = os.path.join(a.dir, f"go-{ph}")
        while not os.path.exists(go):
            time.sleep(0.05)
        row = {"phase": ph, "pid": os.getpid()}
        for name, f in kinds.items():
            row[name] = best_of(f, 20000, sync=sync)
        row["alloc_free"] = best_of(alloc_free, 2000)
        print(json.dumps(row), flush=True)
        open(os.path.join(a.dir, f"done-{ph}"), "w").close()


if __name__ == "__main__":
    main()
