#!/usr/bin/env python3
"""Which libcuda entry points does PyTorch really call? Counts calls to every
exported cu* function matching a regex (default: synchronize, query, wait and
event calls) while a PyTorch child runs matmuls, .item(), synchronize() and
event waits. Needs bcc (bench/gpu: setup-bcc) and root.

  python3 bench/gpu/which_calls.py [REGEX]
"""
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bcc import BPF  # noqa: E402

from hami_bpf import libcuda  # noqa: E402

CHILD = r'''
import torch, time, sys
x = torch.randn(4096, 4096, device="cuda")
for _ in range(3):
    y = x @ x
torch.cuda.synchronize()
print("T sync", flush=True)
for _ in range(5):
    y = x @ x
    y.sum().item()
print("T item", flush=True)
e = torch.cuda.Event(); y = x @ x; e.record(); e.synchronize()
print("T event", flush=True)
torch.cuda.current_stream().synchronize()
print("T stream", flush=True)
sys.stdin.readline()
'''

PROG = r'''
#include <uapi/linux/ptrace.h>
BPF_HASH(counts, u64, u64);
int count(struct pt_regs *ctx) {
    u64 ip = PT_REGS_IP(ctx), z = 0;
    u64 *v = counts.lookup_or_try_init(&ip, &z);
    if (v) __sync_fetch_and_add(v, 1);
    return 0;
}
'''


def main():
    rx = re.compile(sys.argv[1] if len(sys.argv) > 1 else r"(Synchron|Query|Wait|Event)")
    lib = sorted(p for p in os.listdir("/usr/local/nvidia/lib64") if p.startswith("libcuda.so."))[-1]
    lib = os.path.join("/usr/local/nvidia/lib64", lib)
    offs = {n: o for n, o in libcuda.symbol_file_offsets(lib).items()
            if n.startswith("cu") and rx.search(n)}
    b = BPF(text=PROG)
    for n in offs:
        try:
            b.attach_uprobe(name=lib, sym=n, fn_name="count")
        except Exception as e:  # noqa: BLE001
            print("attach", n, e)
    print(f"{len(offs)} symbols probed in {lib}", flush=True)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    for _ in range(4):
        print(child.stdout.readline().strip(), flush=True)
    base = None
    for line in open(f"/proc/{child.pid}/maps"):
        parts = line.split()
        if (len(parts) >= 6 and "x" in parts[1]
                and os.path.realpath(parts[5]) == os.path.realpath(lib)):
            base = int(parts[0].split("-")[0], 16) - int(parts[2], 16)
    by_off = {o: n for n, o in offs.items()}
    for k, v in sorted(b["counts"].items(), key=lambda kv: -kv[1].value):
        print(f"{by_off.get(k.value - base, hex(k.value))}: {v.value}")
    child.stdin.write("\n")
    child.stdin.flush()
    child.wait()


if __name__ == "__main__":
    main()
