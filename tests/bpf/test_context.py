"""Context memory: no allocation probe sees a CUDA context, so each process
using a device reserves --context-bytes of its group's limit there."""
from __future__ import annotations

import uuid

import pytest

from helpers import Daemon, Tracked, converge, finish_daemon, wait_registered, write_policy

pytestmark = pytest.mark.bpf

MiB = 1 << 20
LIMIT = 64 * MiB
CTX = 8 * MiB
OOM = 2


@pytest.fixture(scope="module")
def daemon(fakecuda, tmp_path_factory):
    path = write_policy(tmp_path_factory.mktemp("policy") / "policy.toml",
                        f'[[group]]\nmatch = "ctx*"\nmemory = {LIMIT}\n')
    d = Daemon(fakecuda, policy=path, extra=["--context-bytes", "8Mi"]).start()
    yield d
    finish_daemon(d)


def test_each_process_on_a_device_reserves_its_context(daemon, fakecuda):
    g = f"ctx-{uuid.uuid4().hex[:6]}"
    with Tracked.spawn(fakecuda, g) as a, Tracked.spawn(fakecuda, g) as b:
        wait_registered(daemon, [a, b])
        a.alloc("alloc 1M", 0)
        b.alloc("alloc 1M", 0)
        converge(daemon, [a, b])
        # Two contexts on device 0: 64 - 2*8 - 2*1 = 46 MiB left to allocate.
        a.alloc(f"alloc {46 * MiB}", 0)
        assert b.alloc("alloc 4096", 0, expect_rc=None)[0] == OOM
        rc, free, total = a.proc.meminfo()
        assert rc == 0 and total == LIMIT and free == 0
        # One process leaves: its context's reserve goes back to the group.
        b.proc.exit(0)
        converge(daemon, [a])
        rc, free, total = a.proc.meminfo()
        assert (rc, total) == (0, LIMIT)
        assert free == LIMIT - 47 * MiB - CTX
        a.alloc(f"alloc {free}", 0)
        assert a.alloc("alloc 4096", 0, expect_rc=None)[0] == OOM
