#!/usr/bin/env python3
"""Which libcuda entry points does a program really call? Counts calls to every
exported cu* function matching a regex (default: synchronize, query, wait,
event and host-function calls), per symbol and thread, with the time spent
inside each (entry to return). Needs bcc (bench/gpu: setup-bcc) and root.

  python3 bench/gpu/which_calls.py [--regex RX]
      a PyTorch child runs matmuls, .item(), synchronize() and event waits
  python3 bench/gpu/which_calls.py [--regex RX] --cmd "python3 bench/gpu/workloads/jax_train.py --seconds 8"
      any program, counted from its start to its exit
  --heads prints each probed symbol's first bytes
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bcc import BPF  # noqa: E402

from hami_bpf import enforce, libcuda  # noqa: E402

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

# Keyed by (entry address, thread id): calls and nanoseconds inside them.
PROG = r'''
#include <uapi/linux/ptrace.h>
struct key_t { u64 ip; u32 tid; u32 pad; };
struct val_t { u64 n; u64 ns; };
struct at_t { u64 ip; u64 ts; };
BPF_HASH(counts, struct key_t, struct val_t, 65536);
BPF_HASH(at, u64, struct at_t, 65536);     /* pid_tgid -> the call that thread is in */
int enter(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct at_t a = { .ip = PT_REGS_IP(ctx), .ts = bpf_ktime_get_ns() };
    at.update(&id, &a);
    return 0;
}
int leave(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct at_t *a = at.lookup(&id);
    if (!a)
        return 0;
    struct key_t k = { .ip = a->ip, .tid = (u32)id };
    struct val_t z = {};
    struct val_t *v = counts.lookup_or_try_init(&k, &z);
    if (v) {
        __sync_fetch_and_add(&v->n, 1);
        __sync_fetch_and_add(&v->ns, bpf_ktime_get_ns() - a->ts);
    }
    at.delete(&id);
    return 0;
}
'''


def lib_base(pid: int, lib: str, offs: dict) -> int | None:
    """Where `lib` is loaded in `pid`: the address of file offset 0 of its
    text, from where one of its symbols (`offs`: name -> file offset) is
    mapped (hami_bpf.enforce.entry_address)."""
    off = next(iter(offs.values()), None)
    addr = None if off is None else enforce.entry_address(pid, lib, off)
    return None if addr is None else addr - off


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regex", default=r"(Synchron|Query|Wait|Event|HostFunc|Callback)",
                    help="exported cu* symbols to count (Python regex)")
    ap.add_argument("--cmd", help="program to run and count (default: the PyTorch child)")
    ap.add_argument("--heads", action="store_true",
                    help="print each probed symbol's first bytes (a probe on an instruction "
                         "the kernel cannot emulate is single-stepped: slower)")
    a = ap.parse_args()
    rx = re.compile(a.regex)
    lib = sorted(p for p in os.listdir("/usr/local/nvidia/lib64") if p.startswith("libcuda.so."))[-1]
    lib = os.path.join("/usr/local/nvidia/lib64", lib)
    offs = {n: o for n, o in libcuda.symbol_file_offsets(lib).items()
            if n.startswith("cu") and rx.search(n)}
    if a.heads:
        with open(lib, "rb") as f:
            for n, o in sorted(offs.items()):
                f.seek(o)
                print(f"head {n:32} {f.read(8).hex(' ')}", flush=True)
    b = BPF(text=PROG)
    for n in offs:
        try:
            b.attach_uprobe(name=lib, sym=n, fn_name="enter")
            b.attach_uretprobe(name=lib, sym=n, fn_name="leave")
        except Exception as e:  # noqa: BLE001
            print("attach", n, e)
    print(f"{len(offs)} symbols probed in {lib}", flush=True)
    base = None
    if a.cmd:
        child = subprocess.Popen(shlex.split(a.cmd), stdout=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        for line in child.stdout:
            if base is None:
                base = lib_base(child.pid, lib, offs)
            if '"summary"' in line:
                print(line.strip(), flush=True)
        child.wait()
        wall = time.monotonic() - t0
    else:
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        for _ in range(4):
            print(child.stdout.readline().strip(), flush=True)
        base = lib_base(child.pid, lib, offs)
        wall = None
    by_off = {o: n for n, o in offs.items()}
    rows = sorted(((by_off.get(k.ip - (base or 0), hex(k.ip)), k.tid, v.n, v.ns)
                   for k, v in b["counts"].items()), key=lambda r: -r[2])
    print(f"{'symbol':32} {'tid':>8} {'calls':>9} {'ms inside':>10}" + (f"  (wall {wall:.1f} s)" if wall else ""))
    for name, tid, n, ns in rows:
        print(f"{name:32} {tid:>8} {n:>9} {ns / 1e6:>10.1f}")
    if not a.cmd:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait()


if __name__ == "__main__":
    main()
