"""Fixtures of the container tests: the image (built once), the agent's
container started the way deploy/daemonset.yaml says, and workload
containers running the stand-in libcuda.

Needs root, podman and mmdebstrap (`make install-test` installs them) and
what tests/bpf needs (bcc on the host is not used; the image brings its
own).  Outside CI a missing piece skips; under CI (CI=true) it fails.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bpf"))

from hami_bpf.server import ServerError, query  # noqa: E402

from helpers import DEADLINES, remove_pin_dir, wait_for  # noqa: E402
import podkit  # noqa: E402
from podkit import podman  # noqa: E402

REPO = podkit.REPO
IMAGE = os.environ.get("HAMI_BPF_IMAGE", "localhost/hami-bpf")
TAG = "0.1.0"
NEXT_TAG = "0.1.0-rollout"
BASE_IMAGE = "localhost/hami-bpf-base:bookworm"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("podman", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} not found (make install-test installs it)"
    if not os.path.isdir("/sys/kernel/tracing/events"):
        return "tracefs is not mounted at /sys/kernel/tracing"
    return None


def pytest_collection_modifyitems(config, items):
    why = _missing()
    if why is None:
        return
    if _in_ci():
        pytest.exit(f"container tests: {why}", returncode=1)
    for item in items:
        item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """The agent's image (deploy/build-image.sh; cached base and layers) and a
    second tag of it with another layer, what a rollout replaces it with."""
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "deploy" / "build-image.sh"), TAG],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise AssertionError(f"deploy/build-image.sh exited {r.returncode}:\n"
                             f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    first = f"{IMAGE}:{TAG}"
    nxt = f"{IMAGE}:{NEXT_TAG}"
    old = podman("image", "inspect", "--format", "{{.Id}}", nxt, check=False).stdout.strip()
    proc = subprocess.run(
        ["podman", "build", "--network", "none", "--pull=never", *podkit.ulimit_args(),
         "-t", nxt, "-f", "-", str(REPO / "tests" / "containers")],
        input=f"FROM {first}\nLABEL io.hami-bpf.rollout=\"{TAG} -> {NEXT_TAG}\"\n",
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = podman("image", "inspect", "--format", "{{.Id}}", nxt).stdout.strip()
    if old and old != new:   # the previous run's, unless something else still names it
        podman("rmi", old, check=False)
    print(f"images built in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return {"first": first, "next": nxt, "base": BASE_IMAGE}


@pytest.fixture(scope="session")
def workspace():
    """Host directories of this run, only root can reach (policy files must
    sit under such a chain)."""
    d = Path(f"/run/hami-bpf-ct-{uuid.uuid4().hex[:6]}")
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Agent:
    """The agent's container, started with deploy/daemonset.yaml's grants."""

    def __init__(self, workspace: Path, fake, image: str, name: str):
        self.ws = workspace
        self.name = name
        self.image = image
        self.run_dir = workspace / "run"
        self.socket = str(self.run_dir / "hami-bpf.sock")
        self.regions = workspace / "vgpu"
        self.cm_dir = podkit.write_configmap(workspace / "policy")
        # Kept maps of this run only (the node's default pin directory may be
        # some other daemon's); the DaemonSet leaves --bpf-pin-dir at its
        # default on the same hostPath.
        self.pin_dir = f"/sys/fs/bpf/hami-bpf-ct-{workspace.name[-6:]}"
        self.remap = {
            "/run/hami-bpf": str(self.run_dir),
            "/usr/local/vgpu/containers": str(self.regions),
            # the node's driver directory: the stand-in's
            "/usr/lib/x86_64-linux-gnu": str(fake.lib_dir),
        }
        self.ready_after: float | None = None

    def argv(self, image: str) -> list[str]:
        return podkit.daemon_args(name=self.name, image=image, remap=self.remap,
                                  configmap_dir=self.cm_dir,
                                  extra_args=[f"--bpf-pin-dir={self.pin_dir}"])

    def start(self, image: str | None = None) -> "Agent":
        if image:
            self.image = image
        podman("rm", "--force", "--ignore", self.name)
        podman("run", *self.argv(self.image))
        t0 = time.monotonic()
        limit, why = DEADLINES.ready_timeout()
        while True:
            logs = self.logs()
            if "ready" in logs and self._pings():
                break
            st = self.state()
            if st.get("Status") not in ("running", "created", "configured"):
                raise AssertionError(f"agent container {st.get('Status')} (exit "
                                     f"{st.get('ExitCode')}) before it was ready:\n{logs[-4000:]}")
            if time.monotonic() - t0 > limit:
                raise AssertionError(f"agent container not ready within {limit:.0f} s ({why}):\n"
                                     f"{logs[-4000:]}")
            time.sleep(0.5)
        self.ready_after = time.monotonic() - t0
        DEADLINES.saw_ready(self.ready_after)
        return self

    def _pings(self) -> bool:
        try:
            query(self.socket, "ping", timeout=2)
            return True
        except ServerError:
            return False

    def state(self) -> dict:
        r = podman("inspect", "--format", "{{json .State}}", self.name, check=False)
        return json.loads(r.stdout) if r.returncode == 0 else {}

    def logs(self) -> str:
        r = podman("logs", self.name, check=False)
        return r.stdout + r.stderr

    def snapshot(self) -> dict:
        return query(self.socket, "snapshot", timeout=DEADLINES.timeout(5))

    def stop(self) -> int:
        """SIGTERM, as the kubelet does, with the pod's grace period."""
        grace = podkit.pod_spec().get("terminationGracePeriodSeconds", 30)
        podman("stop", "--time", str(int(DEADLINES.timeout(grace))), self.name, check=False)
        return int(self.state().get("ExitCode", -1))

    def remove(self) -> None:
        podman("rm", "--force", "--ignore", "--time", "60", self.name, check=False)


@pytest.fixture(scope="module")
def agent(images, workspace, fakecuda):
    a = Agent(workspace, fakecuda, images["first"], f"hami-bpf-agent-{workspace.name[-6:]}")
    a.start()
    yield a
    rc = a.stop()
    logs = a.logs()
    a.remove()
    remove_pin_dir(a.pin_dir)
    assert rc == 0, f"agent exited {rc} on SIGTERM:\n{logs[-3000:]}"

