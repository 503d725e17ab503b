"""`hami-bpf run`: validate options, build a DaemonConfig, hand over to the daemon."""
from __future__ import annotations

import os
import sys

import click

from hami_bpf.config import (DEFAULT_FALLBACK_DEVICES, DEFAULT_FALLBACK_TOTAL_MEM, DEFAULT_LIB_GRACE_S,
                             DEFAULT_PIN_DIR, DEFAULT_SM_GIVEBACK_PCT, DEFAULT_SM_SAMPLE_PCT, DEFAULT_SM_HOLD_MS, DEFAULT_SM_HOST_RUN_MS, DEFAULT_SM_TURN_RUN_MS, DEFAULT_SM_TURN_MS, DEFAULT_SOCKET, DEFAULT_STATE_DIR, OOM_ACTIONS,
                             DaemonConfig, parse_group_by, parse_host_port)

from .common import CliError


class GroupByType(click.ParamType):
    name = "cgroup|env:NAME|pid"

    def convert(self, value, param, ctx):
        try:
            return parse_group_by(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class HostPortType(click.ParamType):
    name = "HOST:PORT"

    def convert(self, value, param, ctx):
        try:
            parse_host_port(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        from hami_bpf.limits import LimitError, parse_size
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except LimitError as e:
            self.fail(str(e), param, ctx)


class UnixGroupType(click.ParamType):
    name = "GROUP"

    def convert(self, value, param, ctx):
        import grp
        try:
            grp.getgrnam(value)
        except KeyError:
            if not value.isdigit():
                self.fail(f"no such group {value!r}", param, ctx)
        return value


@click.command()
@click.option("--libcuda", multiple=True, metavar="PATH",
              type=click.Path(exists=True, dir_okay=False),
              help="libcuda.so to probe (repeatable; default: discover).")
@click.option("--group-by", type=GroupByType(), default="cgroup", show_default=True,
              metavar="cgroup|env:NAME|pid",
              help="How processes share a slot table: by cgroup (container), by an "
                   "environment variable's value, or one group per pid.")
@click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True,
              metavar="PATH", help="Control socket to create.")
@click.option("--count-launches", is_flag=True, help="Count kernel launches per process.")
@click.option("--policy", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="Policy file with per-group limits.")
@click.option("--no-env-limits", "env_limits", is_flag=True, flag_value=False, default=True,
              help="Ignore CUDA_DEVICE_MEMORY_LIMIT & co. in processes' environments.")
@click.option("--oom-action", type=click.Choice(OOM_ACTIONS), default="auto", show_default=True,
              help="What to do with an allocation over the limit.")
@click.option("--metrics-addr", type=HostPortType(), default=None,
              help="Serve Prometheus metrics on HOST:PORT.")
@click.option("--socket-group", type=UnixGroupType(), default=None,
              help="Let this group use the control socket (mode 0660).")
@click.option("--demo/--no-demo", default=None,
              help="Use the simulated driver [default: only when no libcuda is found].")
@click.option("--state-dir", default=DEFAULT_STATE_DIR, show_default=True, metavar="DIR",
              type=click.Path(file_okay=False), help="Where runtime state lives.")
@click.option("--bpf-pin-dir", "pin_dir", default=DEFAULT_PIN_DIR, show_default=True,
              metavar="DIR", type=click.Path(file_okay=False),
              help="bpffs directory where the kernel-side accounting (usage, allocations, "
                   "limits, group membership) is kept, so that a restarted or upgraded daemon "
                   "adopts it with the processes that hold it.")
@click.option("--no-keep-state", "keep_state", is_flag=True, flag_value=False, default=True,
              help="Keep the accounting in this process only: a restart starts from zero.")
@click.option("--fresh", is_flag=True,
              help="Discard the kept accounting (of any daemon version) instead of adopting it.")
@click.option("--context-bytes", type=SizeType(), default=None, metavar="SIZE",
              help="Device memory each process's CUDA context holds, charged against its "
                   "group's limit per device it uses [default: 528Mi on a GPU (measured on "
                   "an H200), 0 in the demo].")
@click.option("--unseen-memory/--no-unseen-memory", "unseen_memory", default=True,
              show_default=True,
              help="Count against a group's limit the device memory the driver reports for "
                   "a member beyond what its allocations were charged (NVML's per-process "
                   "list, bare-metal hosts).")
@click.option("--sm-limits/--no-sm-limits", default=True, show_default=True,
              help="Enforce SM caps (CUDA_DEVICE_SM_LIMIT, policy `sm`) by throttling launches. "
                   "With --no-sm-limits caps are shown but not enforced and no launch probe "
                   "is ever attached.")
@click.option("--sm-lend-idle", is_flag=True,
              help="Let a capped group use compute its device's other groups leave idle: it is "
                   "held to its cap only while a group of higher or equal priority "
                   "(CUDA_TASK_PRIORITY, policy `priority`; 0 is highest) is busy on the device. "
                   "GPU_CORE_UTILIZATION_POLICY=force keeps a group at its cap regardless.")
@click.option("--sm-turns/--no-sm-turns", default=True, show_default=True,
              help="Let groups capped on one GPU take turns: each gets a slot of every "
                   "period (--sm-turn-ms) as long as its cap, so their kernels do not "
                   "time-slice the GPU (two processes time-slicing a GPU finish less than "
                   "one alone).")
@click.option("--sm-turn-ms", "sm_turn_ms", type=click.IntRange(20, 1000),
              default=DEFAULT_SM_TURN_MS, show_default=True,
              help="The turns' period: a group capped at 30 waits up to 70% of it for its slot; "
                   "a longer one hands the GPU over less often, and loses less at each handover.")
@click.option("--sm-hold-ms", "sm_hold_ms", type=click.IntRange(10, 500),
              default=DEFAULT_SM_HOLD_MS, show_default=True,
              help="A capped group that synchronizes often is held, at a synchronize's return, "
                   "once it owes this much running time; a longer one holds it less often and "
                   "for longer (each hold lasts at most the larger of 250 ms and twice this).")
@click.option("--sm-host-run-ms", "sm_host_run_ms", type=click.IntRange(0, 1000),
              default=DEFAULT_SM_HOST_RUN_MS, show_default=True,
              help="A capped group whose launching thread sets its pace (under half its running "
                   "time inside synchronize calls) runs at least this long between holds, each "
                   "hold as long as its cap asks (at most 400 ms): such a loop runs slower for "
                   "a while after every stop, so fewer stops let it keep its share. 0: held "
                   "as any other group.")
@click.option("--sm-turn-run-ms", "sm_turn_run_ms", type=click.IntRange(0, 1000),
              default=DEFAULT_SM_TURN_RUN_MS, show_default=True,
              help="Such a group runs at least this long between holds while it takes turns "
                   "with a capped neighbour on its GPU (never less than --sm-host-run-ms): "
                   "each turn also hands the GPU over, so longer runs mean fewer handovers.")
@click.option("--sm-giveback-pct", "sm_giveback_pct", type=click.IntRange(0, 50),
              default=DEFAULT_SM_GIVEBACK_PCT, show_default=True,
              help="A capped group whose GPU has finished its work by the time it synchronizes "
                   "(under 5% of its running time inside synchronize calls, as an LLM decode "
                   "loop) runs this share of its running time more, alone on its GPU or beside "
                   "uncapped groups only, or beside other capped groups as far as the time their "
                   "caps leave unclaimed goes: being held slows such a loop by about that much. "
                   "0: held for its cap alone. Used until the group's speed is measured "
                   "(--sm-sample-pct).")
@click.option("--sm-sample-pct", "sm_sample_pct", type=click.IntRange(0, 25),
              default=DEFAULT_SM_SAMPLE_PCT, show_default=True,
              help="A capped group paced by time, alone on its GPU or beside uncapped groups "
                   "only, runs free this share of its running time, 1.5 s (up to cap 60) to "
                   "2 s at a time, to measure how much it does per second of running while "
                   "paced against free; it then runs its cap "
                   "divided by that speed of the time (within 0.87x-1.43x its cap). What a "
                   "free run owes is held over the seconds after it. 0: never measured.")
@click.option("--sm-learn-alone/--no-sm-learn-alone", default=True, show_default=True,
              help="Let a newly capped group learn its full rate with the other capped groups "
                   "on its GPU held (at most 2 s; never an uncapped or higher-priority group): "
                   "learned side by side, rates come out short by what time-slicing loses.")
@click.option("--open-gate/--no-open-gate", default=True, show_default=True,
              help="Hold a process that opens a file named libcuda until that file is probed, "
                   "so a private copy of the driver library is probed before its first call "
                   "(needs the openat syscall tracepoints). Without it such copies are found "
                   "by scanning /proc about every second.")
@click.option("--hami-regions", "hami_regions", default=None, metavar="DIR",
              type=click.Path(file_okay=False),
              help="Publish one HAMi shared-region file per group under DIR, for HAMi's node "
                   "monitor (HAMi's is /usr/local/vgpu/containers) [default: off].")
@click.option("--fallback-devices", type=click.IntRange(1, 64), default=DEFAULT_FALLBACK_DEVICES,
              show_default=True, hidden=True,
              help="Devices to assume where NVML does not answer (the stand-in libcuda).")
@click.option("--fallback-total-mem", type=SizeType(), default=DEFAULT_FALLBACK_TOTAL_MEM,
              hidden=True, help="Memory of each of those devices.")
@click.option("--sim-gpu", "sim_gpu", default=None, metavar="PATH", hidden=True,
              help="The stand-in libcuda's simulated GPU (its shared file), whose "
                   "utilization stands for NVML's.")
@click.option("--sim-proc-mem", "sim_proc_mem", default=None, metavar="PATH", hidden=True,
              help="The stand-in libcuda's per-process memory table (its shared file), "
                   "which stands for NVML's per-process list.")
@click.option("--lib-grace-s", "lib_grace_s", type=click.FloatRange(0.1, 3600),
              default=DEFAULT_LIB_GRACE_S, show_default=True, hidden=True,
              help="Seconds a discovered driver library nobody uses stays attached.")
@click.option("-v", "--verbose", is_flag=True, help="Log debug details.")
def run(libcuda, group_by, socket_path, count_launches, policy, env_limits, oom_action,
        metrics_addr, socket_group, demo, state_dir, pin_dir, keep_state, fresh, context_bytes,
        unseen_memory,
        sm_limits, sm_lend_idle, sm_turns, sm_turn_ms, sm_hold_ms, sm_host_run_ms, sm_turn_run_ms, sm_giveback_pct, sm_sample_pct,
        sm_learn_alone, open_gate,
        hami_regions, fallback_devices, fallback_total_mem, sim_gpu, sim_proc_mem, lib_grace_s,
        verbose):
    """Start the daemon: attach probes, keep the slot table, serve the socket."""
    if os.geteuid() != 0:
        raise CliError("run needs root (CAP_BPF, CAP_PERFMON)")
    cfg = DaemonConfig(libcuda=tuple(libcuda), group_by=group_by, socket=socket_path,
                       count_launches=count_launches, policy=policy, env_limits=env_limits,
                       oom_action=oom_action, metrics_addr=metrics_addr,
                       socket_group=socket_group, demo=demo, state_dir=state_dir,
                       verbose=verbose, context_bytes=context_bytes, sm_limits=sm_limits,
                       unseen_memory=unseen_memory,
                       sm_lend_idle=sm_lend_idle, sm_turns=sm_turns,
                       sm_turn_ms=sm_turn_ms, sm_hold_ms=sm_hold_ms,
                       sm_host_run_ms=sm_host_run_ms, sm_turn_run_ms=sm_turn_run_ms,
                       sm_giveback_pct=sm_giveback_pct,
                       sm_sample_pct=sm_sample_pct,
                       sm_learn_alone=sm_learn_alone, open_gate=open_gate,
                       hami_regions=hami_regions, pin_dir=pin_dir if keep_state else None,
                       fresh=fresh, fallback_devices=fallback_devices,
                       fallback_total_mem=fallback_total_mem, sim_gpu=sim_gpu,
                       sim_proc_mem=sim_proc_mem,
                       lib_grace_s=lib_grace_s)
    # Imported here: the daemon pulls in bcc, which the other commands must not need.
    from hami_bpf import daemon
    try:
        rc = daemon.run(cfg)
    except daemon.DaemonError as e:
        raise CliError(" ".join(str(e).split())) from None
    if rc:
        sys.exit(rc)
