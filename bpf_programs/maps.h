/* SPDX-License-Identifier: Apache-2.0 */
/*
 * maps.h: every map of hami-bpf, with who writes it, who reads it and how
 * long an entry lives. Sizes come in as -D flags from hami_bpf/probes.py.
 */
#ifndef HAMI_MAPS_H
#define HAMI_MAPS_H

#ifndef HAMI_MAX_PROCS
#define HAMI_MAX_PROCS 4096
#endif
#ifndef HAMI_MAX_ALLOCS
#define HAMI_MAX_ALLOCS 262144
#endif
#ifndef HAMI_MAX_GROUPS
#define HAMI_MAX_GROUPS 4096
#endif
#ifndef HAMI_RINGBUF_PAGES
#define HAMI_RINGBUF_PAGES 256
#endif

/* Kept maps outlive the daemon: with -DHAMI_PIN_DIR="\"/sys/fs/bpf/...\"" each
 * is pinned there (created on first load, adopted by every later load), so a
 * restarted or upgraded daemon finds the usage, allocations, limits and
 * group membership of running processes where its predecessor left them.
 * The directory's name carries the layout's fingerprint (hami_bpf/probes.py):
 * bcc adopts a pinned map without comparing sizes. */
#ifdef HAMI_PIN_DIR
#define HAMI_KEPT_HASH(_name, _key, _leaf, _max) \
	BPF_TABLE_PINNED("hash", _key, _leaf, _name, _max, HAMI_PIN_DIR "/" #_name)
#else
#define HAMI_KEPT_HASH(_name, _key, _leaf, _max) BPF_HASH(_name, _key, _leaf, _max)
#endif

/* events: every hami_event, in the order the probes reserved them.
 * Writer: all programs. Reader: the controller's poll loop. Lost events are
 * counted in stats[HAMI_STAT_RB_DROPS]; the controller's /proc reaper repairs
 * a lost exit. */
BPF_RINGBUF_OUTPUT(events, HAMI_RINGBUF_PAGES);

/* procs: key __u32 tgid -> struct hami_proc. Owned by BPF.
 * Created by the first libcuda probe a process hits (charged = NONE); the
 * first probe after the controller assigned a group moves the process's bytes
 * into it (cmpxchg on charged, so exactly once); deleted by the
 * sched_process_exit program when the leader exits, and by the
 * sched_process_exec program when the process replaces its image (the next
 * probe creates a new entry, with a new `image`). Also the set of pids whose
 * exit and exec we report. */
HAMI_KEPT_HASH(procs, __u32, struct hami_proc, HAMI_MAX_PROCS);

/* proc_cfg: key __u32 tgid -> struct hami_pcfg. Owned by the controller:
 * written at registration and whenever compaction moves the slot, deleted at
 * release; the exit program deletes it too, so a reused pid starts clean. */
HAMI_KEPT_HASH(proc_cfg, __u32, struct hami_pcfg, HAMI_MAX_PROCS);

/* pmem: key hami_pkey (tgid, physical device) -> __u64 bytes held.
 * Atomic adds/subs by the allocation and free probes; at the leader's exit
 * the exit program subtracts it from the group and deletes it. */
HAMI_KEPT_HASH(pmem, struct hami_pkey, __u64, HAMI_MAX_PROCS * 4);

/* grp_mem: key hami_gkey (group index, physical device) -> hami_gmem.
 * Created by the first charge (lookup-or-init), changed only by BPF atomics:
 * admission at allocation entry, frees, adoption and the exit program.
 * Deleted by the controller when it deletes the group. */
HAMI_KEPT_HASH(grp_mem, struct hami_gkey, struct hami_gmem, HAMI_MAX_GROUPS * 8);

/* grp_lim: key hami_gkey -> hami_glim. Written and deleted by the controller
 * only (limits); read by admission and the memory-info probes. No entry:
 * unlimited. */
HAMI_KEPT_HASH(grp_lim, struct hami_gkey, struct hami_glim, HAMI_MAX_GROUPS * 8);

/* allocs: key hami_akey (tgid, kind, pointer or handle) -> hami_alloc.
 * Inserted by an allocation's return probe, deleted by the matching free.
 * Records of exited processes, and of images an exec replaced (their `image`
 * is not the process's), are swept by the controller; a free ignores the
 * latter. */
HAMI_KEPT_HASH(allocs, struct hami_akey, struct hami_alloc, HAMI_MAX_ALLOCS);

/* inflight: key __u32 tid -> hami_call: arguments an entry probe saves for its
 * return probe. Deleted by the return probe, or at the thread's exit (which
 * also gives back a reservation whose return never came). */
HAMI_KEPT_HASH(inflight, __u32, struct hami_call, 16384);

/* ctx_dev: key hami_ckey (tgid, CUcontext) -> __s32 device. Written by the
 * return probes of cuDevicePrimaryCtxRetain and cuCtxCreate*, deleted by
 * cuCtxDestroy_v2; the controller sweeps exited processes. */
HAMI_KEPT_HASH(ctx_dev, struct hami_ckey, __s32, 65536);

/* nvml_dev: key hami_ckey (tgid, nvmlDevice_t) -> __s32 NVML (physical)
 * index. Written by the return of nvmlDeviceGetHandleByIndex[_v2]; the
 * controller sweeps exited processes. */
HAMI_KEPT_HASH(nvml_dev, struct hami_ckey, __s32, 16384);

/* cur_ctx: key __u32 tid -> hami_tctx: the thread's context stack, as
 * devices. Written by cuCtxSetCurrent/Push/Pop/Create, deleted at thread exit. */
HAMI_KEPT_HASH(cur_ctx, __u32, struct hami_tctx, 16384);

/* launches: key __u32 tgid -> __u64 kernel launches. Incremented by the launch
 * probes (attached only on demand), deleted at the leader's exit. */
BPF_HASH(launches, __u32, __u64, HAMI_MAX_PROCS);

/* sm_grant: key hami_gkey (group, physical device) -> hami_smgrant. Written
 * by the controller on every throttle tick for groups with an SM limit
 * (granted only grows, but for one BPF write: a learning checkpoint at a
 * synchronize's return lowers it to consumed); deleted with the group. Read
 * by the launch probes. */
BPF_HASH(sm_grant, struct hami_gkey, struct hami_smgrant, HAMI_MAX_GROUPS * 8);

/* sm_use: key hami_gkey -> hami_smuse. Created by the first launch of a group
 * on a device, atomically advanced by the launch probes, deleted by the
 * controller with the group. The controller reads it to measure rates. */
BPF_HASH(sm_use, struct hami_gkey, struct hami_smuse, HAMI_MAX_GROUPS * 8);

/* sync_at: key __u32 tid -> hami_syncat. Written by the entry of a
 * synchronize call, consumed and deleted by its return (or the thread's exit).
 * Attached with the launch probes. */
BPF_HASH(sync_at, __u32, struct hami_syncat, 16384);

/* gate_wait: key __u32 tgid -> __u64 ktime of the hold. A process the cuInit
 * probe stopped until the controller classifies it. Written by that probe
 * before the stop; the controller reads it every tick and deletes an entry to
 * claim it (the one that deleted it resumes the process, exactly once), so a
 * hold never depends on its event getting through a full ring buffer. Deleted
 * too when the image goes (exit, exec). Not kept: a restarted controller
 * finds such processes stopped at cuInit's entry and resumes them. */
BPF_HASH(gate_wait, __u32, __u64, HAMI_MAX_PROCS);

/* no_priv_stack: an empty program array, never written. Every uprobe program
 * begins with a tail call into it, which misses and returns at once. From 6.13
 * the kernel runs a kprobe-type program whose stack is 64 bytes or more on a
 * per-CPU private stack, assuming it cannot be preempted; a uprobe program can
 * be (uprobes run preemptible), and a second task on the same CPU then
 * overwrites the first one's locals (wrong charges, or an oops). A program
 * that makes a tail call never gets a private stack. */
BPF_PROG_ARRAY(no_priv_stack, 1);

/* opening: key __u32 tid -> __u64 user address of the path being opened,
 * when it names the driver library. Written by the openat entry program,
 * consumed by its exit (or the thread's exit). Only with the open gate. */
BPF_HASH(opening, __u32, __u64, 4096);

/* lib_fds: key hami_libfd (tgid, fd) -> user address of the name it was
 * opened under, for descriptors of files named like the driver library.
 * Written by the openat exit program, consumed by an executable mmap of the
 * descriptor; LRU: a descriptor closed unmapped is evicted in time (a stale
 * one reused for another file costs one stop that finds nothing to probe). */
BPF_TABLE("lru_hash", struct hami_libfd, __u64, lib_fds, 4096);

/* config: one hami_config, written by the controller (heartbeat every tick). */
BPF_ARRAY(config, struct hami_config, 1);

/* stats: per-CPU counters HAMI_STAT_*, written by all programs, summed by the
 * controller. */
BPF_PERCPU_ARRAY(stats, __u64, HAMI_STAT_MAX);

#endif /* HAMI_MAPS_H */
