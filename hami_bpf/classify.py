"""What registration reads of a process from /proc (through procfs): its
group, environment limits, CUDA_VISIBLE_DEVICES map, pod labels and pid in
its own namespace.

Everything here comes from the workload: each step is bounded, and a step that
fails is named in ``Classified.failed`` and its input dropped, so the process
is still registered (with its group's policy limits), never left untracked.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from . import abi, containers, procfs
from .limits import EnvLimits, EnvProblem, clipped, parse_env_limits, visible_entries, visible_to_physical

# Longest group name kept as is; a longer one (an env:NAME value, say) is cut
# and made unique again by a hash of the whole.
GROUP_NAME_MAX = 1024
LABEL_MAX = 253            # a Kubernetes name's limit
PROBLEMS_SHOWN = 8         # malformed variables recorded per process
# Bytes of /proc/PID/environ read: the variables that matter come from the
# container spec, a few KiB. Past this the environment is cut and the cut is
# reported.
ENVIRON_MAX = procfs.ENVIRON_MAX
parse_environ = procfs.parse_environ

UNCLASSIFIED = "(unclassified)"   # the group of a process whose group could not be read


def read_environ(pid: int) -> tuple[dict[str, str], bool]:
    """(environment of ``pid``, whether it was cut at ENVIRON_MAX bytes)."""
    return procfs.environ(pid, limit=ENVIRON_MAX)


def proc_environ(pid: int) -> dict[str, str]:
    return read_environ(pid)[0]


def bounded_name(name: str, limit: int = GROUP_NAME_MAX) -> str:
    """``name`` if it is at most ``limit`` characters, else a prefix and a
    hash of the whole: still one name per distinct input."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode(errors="surrogatepass")).hexdigest()[:16]
    return f"{name[:limit - 20]}...{digest}"


def proc_cgroup(pid: int) -> str | None:
    """The cgroup path ``--group-by cgroup`` groups by (see
    :func:`hami_bpf.procfs.parse_cgroup` for v1 and hybrid hosts)."""
    return procfs.cgroup_path(pid)


def proc_comm(pid: int) -> str:
    return procfs.comm(pid)


def ns_pid(pid: int) -> int | None:
    """The pid as the process's own pid namespace sees it (NSpid's last field)."""
    v = procfs.status_field(pid, "NSpid")
    parts = v.split() if v else []
    return int(parts[-1]) if parts else None


def group_of(pid: int, group_by: str, env: dict[str, str] | None,
             cgroup: str | None = None) -> str:
    """The group of ``pid``. ``cgroup``, when given, is its already read
    cgroup path (so its group and its pod labels come from one reading)."""
    if group_by == "pid":
        return str(pid)
    if group_by.startswith("env:"):
        name = group_by[4:]
        e = env if env is not None else proc_environ(pid)
        return bounded_name(e.get(name) or f"{name}(unset)")
    return bounded_name(cgroup or proc_cgroup(pid) or "(exited)")


@dataclass
class Classified:
    """What registration read of a process (classify)."""
    group: str
    env: EnvLimits | None = None
    cvd: str | None = None
    phys: list[int] = field(default_factory=lambda: list(range(abi.MAX_DEVS)))
    labels: dict[str, str] = field(default_factory=dict)
    ns_pid: int | None = None
    problems: list[EnvProblem] = field(default_factory=list)    # malformed values, ignored
    environ_cut: bool = False    # its environment was read up to ENVIRON_MAX bytes only
    failed: list[str] = field(default_factory=list)      # steps that raised: inputs not used
    reasons: list[str] = field(default_factory=list)


def classify(pid: int, alive: bool, *, group_by: str, env_limits: bool,
             uuid_to_index, pod_names: containers.PodNames | None) -> Classified:
    """Group, limits and device map of ``pid`` from its /proc entries. Each
    step that fails (whatever the workload put there) is named in
    ``failed`` and its input is not used: no environment limits, every
    device visible, the fallback group. So the process is still tracked,
    and with no more than its group's policy allows."""
    c = Classified(group="(exited)" if not alive else UNCLASSIFIED)
    if not alive:
        return c

    def step(what, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a workload's input must not untrack it
            c.failed.append(what)
            c.reasons.append(f"{what}: {type(e).__name__}: {clipped(str(e))}")
            return None

    got = step("environment", lambda: read_environ(pid))
    env, cut = got if got is not None else ({}, False)
    c.environ_cut = cut
    if env_limits and env and "environment" not in c.failed:
        parsed = step("limits", lambda: parse_env_limits(env))
        if parsed is not None:
            c.env, problems = parsed
            c.problems += problems
    cvd = env.get("CUDA_VISIBLE_DEVICES") if "environment" not in c.failed else None
    if cvd is not None:
        def visible():
            norm = ",".join(visible_entries(cvd))
            return norm, [visible_to_physical(i, norm, uuid_to_index())
                          for i in range(abi.MAX_DEVS)]
        got = step("devices", visible)
        if got is not None:
            c.cvd, mapped = got
            c.phys = [i if p is None else p for i, p in enumerate(mapped)]
    # One reading of the cgroup file names the group and gives the pod labels.
    cg = step("cgroup", lambda: proc_cgroup(pid))
    group = step("group", lambda: group_of(pid, group_by, env, cg))
    if group is not None:
        c.group = group
    pod = step("pod", lambda: containers.describe(pid, names=pod_names, env=env,
                                                  cgroup=cg).pod)
    if pod is not None:
        c.labels = {clipped(str(k), LABEL_MAX): clipped(str(v), LABEL_MAX)
                    for k, v in pod.labels().items()}
    c.ns_pid = step("pid namespace", lambda: ns_pid(pid))
    if c.failed and ("environment" in c.failed or "limits" in c.failed):
        c.env = None
    return c
