/* SPDX-License-Identifier: Apache-2.0 */
/*
 * hami.h: the ABI between the BPF programs and the Python controller.
 *
 * Every struct here has fixed-width fields and explicit padding; it is
 * mirrored once, in hami_bpf/abi.py, and a test compares the two layouts.
 * Change both together and bump HAMI_ABI_VERSION.
 *
 * No kernel struct is read anywhere (the kernel headers bcc compiles against
 * may not match the running kernel): only helpers, probe registers, user
 * memory and tracepoint arguments.
 */
#ifndef HAMI_H
#define HAMI_H

#define HAMI_ABI_VERSION 4

/* Event kinds sent through the ring buffer. */
#define HAMI_EV_INIT        1  /* cuInit entered: a process uses CUDA; stopped if flags has HAMI_F_STOPPED */
#define HAMI_EV_ALLOC       2  /* an allocation returned CUDA_SUCCESS */
#define HAMI_EV_ALLOC_FAIL  3  /* an allocation returned an error (rc set) */
#define HAMI_EV_FREE        4  /* a free entered; size/device from our record, 0 if unknown */
#define HAMI_EV_DENY        5  /* admission refused an allocation; aux = action taken, ptr = probed entry */
#define HAMI_EV_EXIT        6  /* a thread-group leader we know exited */
#define HAMI_EV_MEMINFO     7  /* cuMemGetInfo_v2 returned; ptr = free*, aux = total*; the process is stopped when flags has HAMI_F_STOPPED */
#define HAMI_EV_TOTALMEM    8  /* cuDeviceTotalMem_v2 returned; ptr = bytes*, stopped as above */
#define HAMI_EV_NVMLMEM    11  /* nvmlDeviceGetMemoryInfo[_v2] returned; ptr = nvmlMemory*, aux = struct version (1, 2); stopped as MEMINFO */
#define HAMI_EV_THROTTLE   10  /* a launch found its group's SM budget spent: the process is stopped (flags) */
#define HAMI_EV_EXEC       12  /* a process we know replaced its image (execve): the old image's bytes went back to its group */
#define HAMI_EV_LIBOPEN    13  /* a file opened under a name like the driver library's was mapped executable: aux = its fd; stopped (flags) */
/* 9 is unused (it once named an event nothing sent): leave it unassigned. */

/* Allocation kinds: a device pointer, a cuMemCreate handle and a CUDA array
 * (CUarray, CUmipmappedArray) are different name spaces in one process. */
#define HAMI_KIND_PTR     0
#define HAMI_KIND_HANDLE  1
#define HAMI_KIND_ARRAY   2

/* Event flags. */
#define HAMI_F_STOPPED    (1u << 0) /* we sent SIGSTOP; the controller must resume */
#define HAMI_F_RESERVED   (1u << 1) /* the size was charged to a group by admission */
#define HAMI_F_NOGROUP    (1u << 2) /* the process had no group yet: not admitted against a limit */
#define HAMI_F_AT_SYNC    (1u << 3) /* HAMI_EV_THROTTLE: stopped at a synchronize's return (nothing queued) */
#define HAMI_F_DENIED     (1u << 4) /* admission refused the call; an allocation event with it: it succeeded all the same */

/* Signals the probes send (x86-64 numbers; bpf_send_signal takes a number). */
#define HAMI_SIGKILL 9
#define HAMI_SIGSTOP 19

/* CUDA driver and NVML results: success is checked before a return is
 * trusted; out-of-memory is what a refused call returns in its place. */
#define HAMI_CUDA_SUCCESS             0
#define HAMI_NVML_SUCCESS             0
#define HAMI_CUDA_ERROR_OUT_OF_MEMORY 2

/* Byte offset of CUmemAllocationProp.location.id (the device of a cuMemCreate). */
#define HAMI_MEMPROP_LOCATION_ID 12

/* CUDA arrays: the byte offsets of the descriptor fields their size is
 * computed from. CUDA_ARRAY_DESCRIPTOR {size_t Width, Height; CUarray_format
 * Format; unsigned NumChannels} (cuArrayCreate_v2) and CUDA_ARRAY3D_DESCRIPTOR
 * {size_t Width, Height, Depth; CUarray_format Format; unsigned NumChannels,
 * Flags} (cuArray3DCreate_v2, cuMipmappedArrayCreate). */
#define HAMI_ARRAY_WIDTH          0
#define HAMI_ARRAY_HEIGHT         8
#define HAMI_ARRAY_FORMAT        16
#define HAMI_ARRAY_CHANNELS      20
#define HAMI_ARRAY3D_DEPTH       16
#define HAMI_ARRAY3D_FORMAT      24
#define HAMI_ARRAY3D_CHANNELS    28
#define HAMI_ARRAY3D_FLAGS       32
/* CUarray_format values whose channel size is known: 1, 2 and 4 bytes. Any
 * other format (normalized, block-compressed, video) is charged
 * HAMI_ARRAY_ELEM_MAX bytes an element, the largest any format has
 * (4 channels of 4 bytes): over, never under. */
#define HAMI_AD_UNSIGNED_INT8   0x01
#define HAMI_AD_UNSIGNED_INT16  0x02
#define HAMI_AD_UNSIGNED_INT32  0x03
#define HAMI_AD_SIGNED_INT8     0x08
#define HAMI_AD_SIGNED_INT16    0x09
#define HAMI_AD_SIGNED_INT32    0x0a
#define HAMI_AD_HALF            0x10
#define HAMI_AD_FLOAT           0x20
#define HAMI_ARRAY_ELEM_MAX       16
/* CUDA_ARRAY3D_DESCRIPTOR.Flags whose Depth counts layers or cube faces,
 * which mipmap levels do not halve. */
#define HAMI_ARRAY3D_LAYERED    0x01
#define HAMI_ARRAY3D_CUBEMAP    0x04
/* Mipmap levels summed at most (a driver allows fewer: a level per halving
 * of the largest dimension). */
#define HAMI_MIPMAP_LEVELS_MAX    32

/* nvmlMemory_t {total, free, used} and nvmlMemory_v2_t {version (padded to
 * 8), total, reserved, free, used}: the struct version (HAMI_EV_NVMLMEM's
 * aux) and the byte offsets of the fields rewritten. */
#define HAMI_NVML_MEM_V1        1
#define HAMI_NVML_MEM_V2        2
#define HAMI_NVML_MEM_V1_TOTAL  0
#define HAMI_NVML_MEM_V1_FREE   8
#define HAMI_NVML_MEM_V1_USED  16
#define HAMI_NVML_MEM_V2_TOTAL  8
#define HAMI_NVML_MEM_V2_FREE  24
#define HAMI_NVML_MEM_V2_USED  32

/* return-oom resumes a refused call at a `ret` byte of the probed function's
 * own code (x86-64 opcode), found within this many bytes of its entry, read
 * in chunks so that a read stops at the end of the mapping. */
#define HAMI_X86_RET          0xc3
#define HAMI_RET_SCAN_CHUNK   64
#define HAMI_RET_SCAN_CHUNKS  16

/* Deny actions (event aux for HAMI_EV_DENY), also the config's oom_action. */
#define HAMI_ACT_OBSERVE      0
#define HAMI_ACT_STOP_REWRITE 1
#define HAMI_ACT_KILL         2
#define HAMI_ACT_RETURN_OOM   3
#define HAMI_ACT_NONE_STALE   4 /* would stop, but the controller's heartbeat is stale: allowed */

/* Config flags. */
#define HAMI_CFG_ENFORCE_MEM  (1u << 0)
#define HAMI_CFG_VIRT_MEMINFO (1u << 1)
#define HAMI_CFG_GATE_INIT    (1u << 2) /* hold a new process at cuInit until classified */
#define HAMI_CFG_GATE_LIBS    (1u << 3) /* hold a process that opened a libcuda until it is probed */

/* The name the open gate looks for in an opened path ("libcuda", anywhere),
 * and how much of the path it reads. */
#define HAMI_LIBNAME_LEN  7
#define HAMI_PATH_SCAN    256
#define HAMI_PROT_EXEC    0x4   /* mmap's PROT_EXEC */

/* lib_fds: a descriptor of a process. */
struct hami_libfd {
	__u32 tgid;
	__s32 fd;
};

#define HAMI_GROUP_NONE 0xffffffffu
#define HAMI_UNLIMITED  0xffffffffffffffffULL
#define HAMI_CTX_DEPTH  8
/* Operations on a thread's context stack (cuCtxSetCurrent, push, pop, destroy). */
#define HAMI_CTXOP_SET     0 /* replace the top; NULL pops */
#define HAMI_CTXOP_PUSH    1
#define HAMI_CTXOP_POP     2
#define HAMI_CTXOP_DESTROY 3 /* pop if the destroyed context is the top */
/* Learning checkpoints (hami_smgrant.checkpoint): at most one per group and
 * device this often, so that a loop synchronizing at every step is not
 * slowed while its pace is measured. */
#define HAMI_CHECKPOINT_NS 200000000ULL

/* Per-CPU stats counters (index into the stats array). */
#define HAMI_STAT_RB_DROPS        0 /* ring buffer full: event lost */
#define HAMI_STAT_ALLOCS_FULL     1 /* allocs map full: a free will be unknown to BPF */
#define HAMI_STAT_INFLIGHT_FULL   2
#define HAMI_STAT_PROCS_FULL      3
#define HAMI_STAT_DENIALS         4
#define HAMI_STAT_STOPS           5 /* SIGSTOPs sent */
#define HAMI_STAT_STALE_SKIPS     6 /* a stop was skipped: heartbeat stale */
#define HAMI_STAT_CTX_FULL        7
#define HAMI_STAT_THROTTLES       8 /* launches that found the budget spent */
#define HAMI_STAT_RET_FALLBACKS   9 /* return-oom found no `ret` to resume at: stop-rewrite instead */
#define HAMI_STAT_DENY_IGNORED   10 /* a refused allocation returned success: charged, over the limit */
#define HAMI_STAT_MAX             11

struct hami_event {
	__u32 kind;
	__u32 tgid;
	__u32 tid;
	__s32 device;    /* physical device ordinal (after CUDA_VISIBLE_DEVICES), -1 unknown */
	__s32 rc;        /* CUresult, for return events */
	__u32 flags;     /* HAMI_F_* */
	__u32 group;     /* group index the BPF side charged, or HAMI_GROUP_NONE */
	__u32 alloc_kind;/* HAMI_KIND_* */
	__u64 ts_ns;     /* bpf_ktime_get_ns (CLOCK_MONOTONIC) */
	__u64 size;
	__u64 ptr;       /* device pointer, handle, or user address (meminfo) */
	__u64 aux;
	char comm[16];
}; /* 88 bytes */

#define HAMI_MAX_DEVS 16

/* procs: key __u32 tgid. Owned by BPF (atomic fields). */
struct hami_proc {
	__u64 charged;   /* group this process's bytes are charged to; set once (64-bit: cmpxchg) */
	__s32 last_dev;  /* the visible device a thread of this process last bound */
	__u32 pad;
	__u64 image;     /* when this entry was made (bpf_ktime_get_ns): one value per
			  * process image, since an exec deletes the entry */
};

/* proc_cfg: key __u32 tgid. Owned by the controller (whole-value writes). */
struct hami_pcfg {
	__u32 group;     /* group index */
	__u32 slot;      /* slot inside the group, always < proc_num */
	__u8 phys[HAMI_MAX_DEVS]; /* visible ordinal -> physical ordinal (CUDA_VISIBLE_DEVICES) */
};

/* pmem: key (tgid, physical device) -> bytes the process holds there. */
struct hami_pkey {
	__u32 tgid;
	__s32 device;
};

/* grp_mem: the group's charge on one device. */
struct hami_gkey {
	__u32 group;
	__s32 device;
};

/* grp_mem value: changed only by BPF atomics. */
struct hami_gmem {
	__u64 used;      /* bytes charged to the group on the device */
	__u64 denied;    /* refused allocations */
};

/* grp_lim value: written only by the controller. */
struct hami_glim {
	__u64 limit;     /* HAMI_UNLIMITED or bytes */
	__u64 total;     /* what memory info reports as total (0: leave it alone) */
};

/* allocs: one live allocation of a process. */
struct hami_akey {
	__u32 tgid;
	__u32 kind;
	__u64 ptr;
};

struct hami_alloc {
	__u64 size;
	__s32 device;    /* physical */
	__u32 pad;
	__u64 image;     /* hami_proc.image of the process when it allocated */
};

/* inflight: an entry probe's arguments, until its return probe. key __u32 tid. */
struct hami_call {
	__u64 out;       /* user address of the result (CUdeviceptr*, handle*, CUcontext*, free*) */
	__u64 size;      /* requested or reserved bytes */
	__u64 aux;       /* call-specific: pPitch*, total* */
	__u64 aux2;      /* call-specific: height */
	__u32 fn;        /* HAMI_FN_* */
	__u32 flags;     /* HAMI_F_* */
	__u32 group;
	__s32 device;
};

#define HAMI_FN_ALLOC     1
#define HAMI_FN_PITCH     2
#define HAMI_FN_CREATE    3
#define HAMI_FN_CTXRETAIN 4
#define HAMI_FN_CTXCREATE 5
#define HAMI_FN_MEMINFO   6
#define HAMI_FN_TOTALMEM  7
#define HAMI_FN_CTXPOP    8
#define HAMI_FN_NVMLHANDLE 9
#define HAMI_FN_NVMLMEM   10
#define HAMI_FN_ARRAY     11   /* cuArrayCreate_v2, cuArray3DCreate_v2, cuMipmappedArrayCreate */

/* ctx_dev: key (tgid, context pointer) -> device. */
struct hami_ckey {
	__u32 tgid;
	__u32 pad;
	__u64 ctx;
};

/* cur_ctx: key __u32 tid -> this thread's context stack, as devices. */
struct hami_tctx {
	__u64 ctx[HAMI_CTX_DEPTH];
	__s32 dev[HAMI_CTX_DEPTH];
	__u32 depth;
	__u32 pad;
};

/* sm_grant value (key hami_gkey): written by the controller (and .granted by
 * a learning checkpoint, see below). */
struct hami_smgrant {
	__u64 granted;   /* cost units the group may have launched in total */
	__u32 limited;   /* 0: count only, never stop */
	__u32 checkpoint; /* learning: a synchronize's return (at most one per
			   * HAMI_CHECKPOINT_NS) lowers granted to consumed, so
			   * the next launch waits for the controller to apply
			   * what that completion taught it */
	__u64 hold_at_sync; /* nonzero: stop the process at its next synchronize's
			     * return, when nothing it launched is left queued
			     * (duty pacing); the stopping thread clears it */
};

/* sm_use value (key hami_gkey): changed only by BPF atomics. */
struct hami_smuse {
	__u64 consumed;  /* cost units launched in total */
	__u64 launches;  /* launch calls */
	__u64 completed; /* cost units known done on the GPU: `consumed` as of the
			  * entry of the latest synchronize call that returned */
	__u64 sync_ns;   /* time threads spent in synchronize calls that returned:
			  * the host waiting for the GPU, not launching */
	__u64 completed_ns; /* CLOCK_MONOTONIC when `completed` last advanced */
	__u64 checkpoint_ns; /* CLOCK_MONOTONIC of the last checkpoint (sm_grant) */
	__u64 syncs;     /* synchronize calls that returned */
};

/* sync_at: key __u32 tid -> what was launched when a synchronize call began. */
struct hami_syncat {
	__u64 consumed;
	__u64 ts;        /* CLOCK_MONOTONIC at entry */
	struct hami_gkey gk;
};

/* config: a single-entry array written by the controller. */
struct hami_config {
	__u64 heartbeat_ns;  /* controller's last CLOCK_MONOTONIC tick */
	__u64 stale_ns;      /* a heartbeat older than this means: controller gone, stop nobody */
	__u32 flags;         /* HAMI_CFG_* */
	__u32 oom_action;    /* HAMI_ACT_* */
	__u64 graph_cost;    /* cost units charged for one cuGraphLaunch (learned by the controller) */
	__u32 controller;    /* the controller's tgid: the open gate never stops it */
	__u32 pad;
};

#endif /* HAMI_H */
