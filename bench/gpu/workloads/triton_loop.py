#!/usr/bin/env python3
"""triton_loop: a hand-written Triton kernel launched in a loop, synchronized
every --sync-every launches (torch.cuda.synchronize()).

The kernel reads --n floats, runs --iters multiply-adds on each and writes
them back: (n / 1024) blocks per launch, memory- and ALU-heavy, tens of
microseconds each. --backend cupy runs the same arithmetic as a CuPy
ElementwiseKernel instead (no Triton); so does the default when Triton cannot
compile (its launcher needs a C compiler), and the summary line says which ran.
Unit: launches/s.
"""
import sys

import torch

from common import Reporter, parser, ready_start, wait_go


def make_triton(n, iters, block):
    import triton
    import triton.language as tl

    @triton.jit
    def busy(x_ptr, y_ptr, n, ITERS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        acc = tl.load(x_ptr + offs, mask=m, other=0.0)
        for _ in range(ITERS):
            acc = acc * 0.999 + 0.001
        tl.store(y_ptr + offs, acc, mask=m)

    x = torch.rand(n, device="cuda")
    y = torch.empty_like(x)
    grid = (triton.cdiv(n, block),)

    def launch():
        busy[grid](x, y, n, ITERS=iters, BLOCK=block)
    return launch


def make_cupy(n, iters):
    import cupy as cp
    k = cp.ElementwiseKernel("float32 x", "float32 y",
                             f"float a = x; for (int i = 0; i < {iters}; ++i) a = a * 0.999f + 0.001f; y = a;",
                             "busy")
    x = cp.random.rand(n, dtype=cp.float32)
    y = cp.empty_like(x)

    def launch():
        k(x, y)
    return launch


def main():
    ap = parser(__doc__)
    ap.add_argument("--backend", choices=["triton", "cupy"], default="triton")
    ap.add_argument("--no-fallback", action="store_true", help="fail rather than fall back to CuPy")
    ap.add_argument("--n", type=int, default=1 << 24)
    ap.add_argument("--iters", type=int, default=64)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--sync-every", type=int, default=32)
    a = ap.parse_args()
    wait_go(a)
    fallback = None
    if a.backend == "triton":
        try:
            launch = make_triton(a.n, a.iters, a.block)
            launch()            # compiles
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - say so and fall back
            if a.no_fallback:
                raise
            fallback = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"triton_loop: Triton failed ({fallback}); CuPy instead", file=sys.stderr, flush=True)
            a.backend = "cupy"
    if a.backend == "triton":
        def sync():
            torch.cuda.synchronize()
    else:
        import cupy as cp
        launch = make_cupy(a.n, a.iters)

        def sync():
            cp.cuda.Device().synchronize()
    for _ in range(3):
        launch()
    sync()
    ready_start(a)
    rep = Reporter("triton_loop", "launches/s", a.seconds)
    rep.begin()
    k = max(1, a.sync_every)
    while not rep.done():
        for _ in range(k):
            launch()
        sync()
        rep.add(k)
    rep.finish(backend=a.backend, triton_error=fallback, n=a.n, iters=a.iters, sync_every=k)


if __name__ == "__main__":
    main()
