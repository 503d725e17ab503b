"""The shipped image and DaemonSet, for real: the agent in a podman container
with the DaemonSet's privileges, workloads in other podman containers (each
its own PID, mount and cgroup namespace... and its own copy of the stand-in
libcuda), and a rollout to a new image while they run.

Every wait is on a state (a log line, the socket's answer, a snapshot, a
process state), bounded by deadlines scaled from the agent's own start
(tests/bpf/helpers.py, Deadlines); nothing asserts how long anything took.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from hami_bpf.enforce import proc_state
from hami_bpf.fakecuda import FakeCuda

from helpers import (DEADLINES, Sampled, ScaledCudaProc, Tracked, accounting_problems,
                     hami_bpf_bin, wait_for)
import podkit
from podkit import podman

MiB = 1 << 20
LIMIT = 64 * MiB
OOM = 2   # CUDA_ERROR_OUT_OF_MEMORY


class Workload(Tracked):
    """cudaprog as pid 1 of its own podman container.

    ``own_lib``: a private copy of the stand-in's directory, bind-mounted at
    the path cudaprog's rpath names (an image that brings its own driver
    library); else the node's directory itself (what the NVIDIA container
    toolkit does with the host's driver)."""

    host_pid: int
    cid: str

    @classmethod
    def start(cls, fake: FakeCuda, image: str, *, env: dict[str, str] | None = None,
              own_lib: Path | None = None, workdir: Path) -> "Workload":
        name = f"hami-ct-w-{uuid.uuid4().hex[:8]}"
        lib = own_lib if own_lib is not None else fake.lib_dir
        args = ["run", "--interactive", "--rm", "--name", name, *podkit.ulimit_args(),
                "--network", "none", "--env", "FAKECUDA_DEVICES=2",
                "--volume", f"{lib}:{fake.lib_dir}:ro"]
        for k, v in (env or {}).items():
            args += ["--env", f"{k}={v}"]
        args += [image, str(fake.cudaprog)]
        launcher = FakeCuda(fake.lib_dir, fake.libcuda, Path(shutil.which("podman")))
        err = open(workdir / f"{name}.stderr", "wb")
        try:
            proc = ScaledCudaProc(launcher, args=args, stderr=err)
        finally:
            err.close()
        w = cls(proc, name)
        w.name = name

        def find(t: "Workload") -> None:
            r = t.proc.cmd("pid", timeout=120)   # an image's first start is slow
            assert r["pid"] == "1", r
            info = json.loads(podman("inspect", "--format",
                                     '{"id": "{{.Id}}", "pid": {{.State.Pid}}}', name).stdout)
            t.cid, t.host_pid = info["id"], int(info["pid"])
            assert t.host_pid > 1

        return w.started(True, 0, first=find)

    @property
    def pid(self) -> int:  # type: ignore[override]
        return self.host_pid

    def close(self) -> None:
        podman("rm", "--force", "--ignore", "--time", "0", self.name, check=False)
        self.proc.close()


@pytest.fixture
def workdir(tmp_path) -> Path:
    return tmp_path


@pytest.fixture(scope="module")
def own_lib(fakecuda, tmp_path_factory):
    """Returns a function making one private copy of the stand-in per call."""
    base = tmp_path_factory.mktemp("libs")

    def copy() -> Path:
        d = base / uuid.uuid4().hex[:8]
        shutil.copytree(fakecuda.lib_dir, d, symlinks=True)
        return d
    return copy


def converge(agent, procs, **kw) -> dict:
    box: dict = {}

    def check():
        box["snap"] = agent.snapshot()
        return accounting_problems(box["snap"], procs, **kw)
    wait_for(check, 5, what="accounting")
    return box["snap"]


def group_of(snap: dict, pid: int) -> dict:
    rec = next(p for p in snap["processes"] if p["pid"] == pid)
    return next(g for g in snap["groups"] if g["id"] == rec["group"])


def not_stopped(*ws: Workload) -> None:
    def check():
        return [f"pid {w.pid} stopped" for w in ws if proc_state(w.pid) in ("T", "t")]
    wait_for(check, 5, what="no workload left stopped")


# ---------------------------------------------------------------------------

def test_agent_runs_with_the_daemonsets_grants(agent):
    logs = agent.logs()
    assert "kernel headers: the node's" in logs, logs[-2000:]
    snap = agent.snapshot()
    assert "processes" in snap and "groups" in snap
    args = " ".join(podkit.daemon_args(name="x", image="i", remap=agent.remap,
                                       configmap_dir=agent.cm_dir))
    assert "--privileged" not in args and "--cap-drop=ALL" in args and "--pid=host" in args


def test_memory_accounted_limited_denied_and_virtualized(agent, fakecuda, images, own_lib, workdir):
    env = {"CUDA_DEVICE_MEMORY_LIMIT": str(LIMIT)}
    with Workload.start(fakecuda, images["base"], env=env, own_lib=own_lib(), workdir=workdir) as w:
        w.alloc(f"alloc {40 * MiB}", 0)
        _, small = w.alloc("alloc 1M", 0)
        snap = converge(agent, [w])
        g = group_of(snap, w.pid)
        assert int(g["devices"]["0"]["used_bytes"]) == 41 * MiB
        # over the limit: refused gracefully, the process lives on
        rc, _ = w.alloc(f"alloc {30 * MiB}", 0, expect_rc=OOM)
        assert rc == OOM
        rc, free, total = w.proc.meminfo()
        assert (rc, total, free) == (0, LIMIT, LIMIT - 41 * MiB)
        w.free(small)
        w.alloc(f"alloc {20 * MiB}", 0)
        converge(agent, [w])
        not_stopped(w)


def test_two_containers_are_two_groups_named_by_container(agent, fakecuda, images, own_lib, workdir):
    env = {"CUDA_DEVICE_MEMORY_LIMIT": str(LIMIT)}
    with Workload.start(fakecuda, images["base"], env=env, own_lib=own_lib(), workdir=workdir) as a, \
         Workload.start(fakecuda, images["base"], env=env, own_lib=own_lib(), workdir=workdir) as b:
        a.alloc(f"alloc {50 * MiB}", 0)
        b.alloc(f"alloc {50 * MiB}", 0)      # its own 64 MiB, not a's
        snap = converge(agent, [a, b])
        ga, gb = group_of(snap, a.pid), group_of(snap, b.pid)
        assert ga["id"] != gb["id"]
        assert a.cid in ga["id"] and b.cid in gb["id"], (ga["id"], gb["id"])
        b.alloc(f"alloc {20 * MiB}", 0, expect_rc=OOM)

        # `hami-bpf ps` in the agent's container, and on the node through the socket
        inside = podman("exec", agent.name, "hami-bpf", "ps", "--json",
                        "--socket", "/run/hami-bpf/hami-bpf.sock").stdout
        host = subprocess.run([hami_bpf_bin(), "ps", "--json", "--socket", agent.socket],
                              capture_output=True, text=True, check=True,
                              timeout=DEADLINES.timeout(60)).stdout
        for out in (inside, host):
            pids = {p["pid"] for p in json.loads(out)["processes"]}
            assert {a.pid, b.pid} <= pids, out[:2000]
        table = podman("exec", agent.name, "hami-bpf", "ps",
                       "--socket", "/run/hami-bpf/hami-bpf.sock").stdout
        assert str(a.pid) in table and str(b.pid) in table, table


def test_sm_cap_throttles_a_container(agent, fakecuda, images, own_lib, workdir):
    env = {"CUDA_DEVICE_SM_LIMIT": "30", "FAKECUDA_LAUNCH_NS": "3000"}
    with Workload.start(fakecuda, images["base"], env=env, own_lib=own_lib(), workdir=workdir) as w:
        def probes():
            return None if int(agent.snapshot()["counters"].get("launch_probes", 0)) > 0 \
                else "no launch probe yet"
        wait_for(probes, 10, what="launch probes for the capped container")
        # Launches for a set time, not a set count: a count takes as long as
        # the cap and the host's load make it; 12 s is long enough for the
        # budget to learn and hold it. A synchronize every 2 s: it stays with
        # the launch budget.
        run = Sampled(w.proc, "bench launch 1 12 0 2000", watch=(w.pid,))
        samples = run.sample_until_done()
        assert run.reply.get("rc") == "0", run.reply
        assert any(s[1] == "T" for s in samples), "the capped container was never stopped"
        not_stopped(w)
        g = group_of(agent.snapshot(), w.pid)
        assert g["sm_limit"] == 30
        assert agent.snapshot()["counters"].get("throttle_episodes", 0) > 0


@pytest.mark.parametrize("cmd", ["nvmlmem", "nvmlmem2"])
def test_nvml_query_in_a_capped_container_reports_the_cap(agent, fakecuda, images, workdir, cmd):
    # The node's driver directory (libcuda + libnvidia-ml), as the NVIDIA
    # toolkit mounts it: the agent probes the libnvidia-ml beside its --libcuda.
    env = {"CUDA_DEVICE_MEMORY_LIMIT": str(LIMIT)}
    with Workload.start(fakecuda, images["base"], env=env, workdir=workdir) as w:
        w.alloc("alloc 10M", 0)
        converge(agent, [w])
        r = w.cmd(f"{cmd} 0")
        assert int(r["rc"]) == 0
        assert (int(r["total"]), int(r["used"]), int(r["free"])) == \
            (LIMIT, 10 * MiB, LIMIT - 10 * MiB)


def test_rollout_to_a_new_image_keeps_everything(agent, fakecuda, images, own_lib, workdir):
    env = {"CUDA_DEVICE_MEMORY_LIMIT": str(LIMIT)}
    with Workload.start(fakecuda, images["base"], env=env, own_lib=own_lib(), workdir=workdir) as a, \
         Workload.start(fakecuda, images["base"], env=env, workdir=workdir) as b:
        _, big = a.alloc(f"alloc {40 * MiB}", 0)
        a.alloc("alloc 1M", 0)
        b.alloc(f"alloc {10 * MiB}", 0)
        before = converge(agent, [a, b])
        groups_before = {w.pid: group_of(before, w.pid)["id"] for w in (a, b)}

        # The DaemonSet's RollingUpdate: the old pod goes (SIGTERM), the new one comes.
        rc = agent.stop()
        assert rc == 0, agent.logs()[-3000:]
        not_stopped(a, b)
        agent.remove()
        agent.start(images["next"])
        assert podman("inspect", "--format", "{{.ImageName}}", agent.name).stdout.strip() \
            == images["next"]

        after = converge(agent, [a, b])
        assert {w.pid: group_of(after, w.pid)["id"] for w in (a, b)} == groups_before
        assert int(group_of(after, a.pid)["devices"]["0"]["used_bytes"]) == 41 * MiB
        # still limited against what was held before the rollout
        a.alloc(f"alloc {30 * MiB}", 0, expect_rc=OOM)
        # a free of an allocation made under the old agent is seen by the new
        a.free(big)
        a.alloc(f"alloc {30 * MiB}", 0)
        converge(agent, [a, b])
        not_stopped(a, b)
        events = subprocess.run([hami_bpf_bin(), "events", "--json", "--socket", agent.socket],
                                capture_output=True, text=True, check=True,
                                timeout=DEADLINES.timeout(60)).stdout
        kinds = {json.loads(x)["kind"] for x in events.splitlines() if x.strip()}
        assert "adopt" in kinds, sorted(kinds)
