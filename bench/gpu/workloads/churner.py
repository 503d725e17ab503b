#!/usr/bin/env python3
"""A short-lived member of a group, for the suite's service scenario.

Straight on the driver API (ctypes, no framework, so it starts in a fraction
of a second): creates a context, allocates --mib MiB, launches a few empty
kernels (PTX loaded at run time) and synchronizes, lives --life seconds (or,
with --until-signal, until it gets SIGUSR1) and leaves: cleanly (exit), by
SIGKILL from the suite (hang), by a segfault (crash) or by abort() (abort).
--device picks the GPU. Prints nothing; its exit status says how far it got
(0 for a clean exit; 4 when the kernel could not be loaded, which leaves
allocation only).
"""
import argparse
import ctypes
import os
import signal
import time

PTX = b"""
.version 7.0
.target sm_75
.address_size 64
.visible .entry noop()
{
    ret;
}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["exit", "hang", "crash", "abort"], default="exit")
    ap.add_argument("--life", type=float, default=0.5)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--launches", type=int, default=16)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--until-signal", action="store_true",
                    help="instead of --life, stay until SIGUSR1 (so a harness picks the moment)")
    a = ap.parse_args()
    if a.until_signal:
        # Blocked from the start: a signal sent early stays pending instead of
        # killing the process by SIGUSR1's default action.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    cu = ctypes.CDLL("libcuda.so.1")
    if cu.cuInit(0) != 0:
        os._exit(2)
    dev = ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), a.device)
    ctx = ctypes.c_void_p()
    if cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        os._exit(2)
    cu.cuCtxSetCurrent(ctx)
    p = ctypes.c_uint64()
    cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(a.mib << 20))
    rc = 0
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    if (cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX)) == 0
            and cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"noop") == 0):
        u = ctypes.c_uint
        for _ in range(a.launches):
            cu.cuLaunchKernel(fn, u(1), u(1), u(1), u(32), u(1), u(1), u(0), ctypes.c_void_p(0),
                              ctypes.c_void_p(0), ctypes.c_void_p(0))
        cu.cuCtxSynchronize()
    else:
        rc = 4
    if a.until_signal:
        signal.sigwait({signal.SIGUSR1})
    else:
        time.sleep(a.life)
    if a.mode == "crash":
        ctypes.string_at(0)
    if a.mode == "abort":
        os.abort()
    if a.mode == "hang":
        time.sleep(3600)
    os._exit(rc)


if __name__ == "__main__":
    main()
