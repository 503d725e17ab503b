#!/opt/hami-bpf/venv/bin/python
"""Exit-to-compaction latency of `hami-bpf run` (root; needs bcc).

Starts the daemon on a private socket and state dir, with the fakecuda
stand-in libcuda and --group-by env:HAMI_GROUP; starts M cudaprog processes
(in batches) spread over a few groups, each of which registers and allocates;
then kills them one at a time in random order (SIGKILL, `exit 0` or `crash`).
For each exit it measures the time from the process's death (its pidfd
becoming readable) until the control socket first shows a snapshot without
the pid and with a contiguous slot table (the reply's arrival time: an upper
bound, which includes one socket round trip).

Prints one line with p50/p99 (and max) and writes nothing else: the daemon's
stderr and the built library live in a temporary directory that is removed.
Exit status 1 when the daemon cannot start or a process is never removed.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "bpf"))

from helpers import (  # noqa: E402
    Daemon,
    DaemonError,
    Tracked,
    kill_and_time_removal,
    percentile,
    wait_registered,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Example: sudo /opt/hami-bpf/venv/bin/python bench/compaction_latency.py -m 200")
    ap.add_argument("-m", "--processes", type=int, default=200, metavar="M",
                    help="processes to start and kill (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=20,
                    help="processes started at a time (default: %(default)s)")
    ap.add_argument("--groups", type=int, default=4,
                    help="groups the processes are spread over (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=None,
                    help="random seed for the kill order (default: random)")
    ap.add_argument("--exits", default="kill,exit,crash",
                    help="comma-separated ways to die, chosen at random per process "
                         "(kill, exit, crash; default: %(default)s)")
    args = ap.parse_args(argv)
    if args.processes < 1 or args.batch < 1 or args.groups < 1:
        ap.error("--processes, --batch and --groups must be >= 1")
    ways = [w.strip() for w in args.exits.split(",") if w.strip()]
    if not ways or any(w not in ("kill", "exit", "crash") for w in ways):
        ap.error("--exits takes kill, exit and/or crash")

    from hami_bpf.fakecuda import build

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="hami-bench-") as tmp:
        fake = build(Path(tmp) / "fakecuda")
        daemon = Daemon(fake, workdir=Path(tmp) / "d")
        (Path(tmp) / "d").mkdir()
        try:
            daemon.start()
        except DaemonError as e:
            print(f"compaction_latency: {e}", file=sys.stderr)
            return 1
        procs: list[Tracked] = []
        try:
            for start in range(0, args.processes, args.batch):
                n = min(args.batch, args.processes - start)
                new = [Tracked.spawn(fake, f"bench{(start + i) % args.groups}", init=False)
                       for i in range(n)]
                procs += new
                for line in ("init", "device 0", f"alloc {1 << 20}"):
                    for t in new:
                        t.proc.send(line)
                    for t in new:
                        t.proc.reply()
                wait_registered(daemon, new, timeout=30)
            rng.shuffle(procs)
            latencies = []
            for t in procs:
                lat, _ = kill_and_time_removal(daemon, t, rng.choice(ways), timeout=10)
                latencies.append(lat)
        except AssertionError as e:
            print(f"compaction_latency: {e}", file=sys.stderr)
            return 1
        finally:
            for t in procs:
                t.close()
            rc = daemon.stop()
            if rc != 0:
                print(f"compaction_latency: daemon exited {rc}:\n{daemon.log()[-2000:]}",
                      file=sys.stderr)
    ms = [x * 1000 for x in latencies]
    print(f"exit-to-compaction over {len(ms)} exits: p50 {percentile(ms, 50):.1f} ms, "
          f"p99 {percentile(ms, 99):.1f} ms, max {max(ms):.1f} ms")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
