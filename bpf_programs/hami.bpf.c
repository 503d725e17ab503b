/* SPDX-License-Identifier: Apache-2.0 */
/*
 * hami.bpf.c: every program hami-bpf loads, in libbpf-bootstrap's order:
 * ABI, maps, helpers, then programs: libcuda uprobes and uretprobes, then the
 * exit and exec tracepoints. Programs are named after what they probe; probes.py
 * attaches one program to several twins (_v2, _ptsz). (bcc makes programs,
 * and rewrites map calls, only in the main file: hence one file.)
 *
 * Entry probes save their arguments in `inflight` (keyed by thread id) and
 * run admission; return probes read results from user memory and report them.
 * Optional helpers are compiled in only where the start-up probe found the
 * kernel allows them (-DHAMI_HAVE_REG_WRITE, -DHAMI_HAVE_PROBE_WRITE_USER):
 * the verifier refuses them even in branches that never run.
 */
#include <uapi/linux/ptrace.h>
#include "hami.h"
#include "maps.h"

/* First statement of every uprobe program: keeps it off the private stack
 * (maps.h, no_priv_stack). */
static __always_inline void keep_off_private_stack(struct pt_regs *ctx)
{
	no_priv_stack.call(ctx, 0);
}

/* ---- helpers ----------------------------------------------------------- */
/*
 * cuda.c: uprobes and uretprobes on libcuda's driver entry points.
 *
 * Entry probes save their arguments in `inflight` (keyed by thread id) and
 * run admission; return probes read the result from user memory and report
 * it. Programs are named after what they probe; one program may be attached
 * to several twins (_v2, _ptsz) by hami_bpf/probes.py.
 */

/* ---- small helpers ---------------------------------------------------- */

static __always_inline void stat_inc(__u32 idx)
{
	__u64 *v = stats.lookup(&idx);
	if (v)
		(*v)++;
}

static __always_inline struct hami_config *get_config(void)
{
	__u32 zero = 0;
	return config.lookup(&zero);
}

/* A stop is only ever sent while the controller is alive to undo it. */
static __always_inline int controller_alive(struct hami_config *c)
{
	if (!c || !c->heartbeat_ns)
		return 0;
	return bpf_ktime_get_ns() - c->heartbeat_ns < c->stale_ns;
}

static __always_inline struct hami_proc *get_proc(__u32 tgid)
{
	struct hami_proc init = { .charged = HAMI_GROUP_NONE, .last_dev = -1,
				  .image = bpf_ktime_get_ns() };
	struct hami_proc *p = procs.lookup(&tgid);
	if (p)
		return p;
	if (procs.update(&tgid, &init) != 0)
		stat_inc(HAMI_STAT_PROCS_FULL);
	return procs.lookup(&tgid);
}

static __always_inline struct hami_event *new_event(__u32 kind)
{
	struct hami_event *e = events.ringbuf_reserve(sizeof(struct hami_event));
	if (!e) {
		stat_inc(HAMI_STAT_RB_DROPS);
		return 0;
	}
	__u64 id = bpf_get_current_pid_tgid();
	e->kind = kind;
	e->tgid = id >> 32;
	e->tid = (__u32)id;
	e->device = -1;
	e->rc = 0;
	e->flags = 0;
	e->group = HAMI_GROUP_NONE;
	e->alloc_kind = 0;
	e->ts_ns = bpf_ktime_get_ns();
	e->size = 0;
	e->ptr = 0;
	e->aux = 0;
	bpf_get_current_comm(&e->comm, sizeof(e->comm));
	return e;
}

/* Visible ordinal -> physical ordinal, as the controller mapped it. */
static __always_inline __s32 to_physical(__u32 tgid, __s32 visible)
{
	if (visible < 0)
		return visible;
	struct hami_pcfg *pc = proc_cfg.lookup(&tgid);
	if (!pc)
		return visible;
	return pc->phys[visible & (HAMI_MAX_DEVS - 1)];
}

/* The visible device of the calling thread's current context. */
static __always_inline __s32 current_visible_device(__u32 tid, struct hami_proc *p)
{
	struct hami_tctx *t = cur_ctx.lookup(&tid);
	if (t && t->depth > 0) {
		__s32 d = t->dev[(t->depth - 1) & (HAMI_CTX_DEPTH - 1)];
		if (d >= 0)
			return d;
	}
	/* A context bound before we attached: the process's last known device. */
	if (p && p->last_dev >= 0)
		return p->last_dev;
	return 0;
}

/*
 * The group this process's bytes are charged to. The first probe after the
 * controller assigned a group moves the bytes the process already holds into
 * it; the cmpxchg makes exactly one thread do that.
 */
static __always_inline __u32 charged_group(__u32 tgid, struct hami_proc *p)
{
	if (!p)
		return HAMI_GROUP_NONE;
	if (p->charged != HAMI_GROUP_NONE)
		return (__u32)p->charged;
	struct hami_pcfg *pc = proc_cfg.lookup(&tgid);
	if (!pc)
		return HAMI_GROUP_NONE;
	__u64 g = pc->group;
	if (__sync_val_compare_and_swap(&p->charged, (__u64)HAMI_GROUP_NONE, g) != HAMI_GROUP_NONE)
		return (__u32)p->charged;
	struct hami_gmem zero = {};
#pragma unroll
	for (int d = 0; d < HAMI_MAX_DEVS; d++) {
		struct hami_pkey pk = { .tgid = tgid, .device = d };
		__u64 *held = pmem.lookup(&pk);
		if (!held || !*held)
			continue;
		struct hami_gkey gk = { .group = g, .device = d };
		struct hami_gmem *gm = grp_mem.lookup_or_try_init(&gk, &zero);
		if (gm)
			__sync_fetch_and_add(&gm->used, *held);
	}
	return g;
}

static __always_inline void charge(__u32 tgid, __u32 group, __s32 dev, __s64 delta,
				   int group_too)
{
	struct hami_pkey pk = { .tgid = tgid, .device = dev };
	__u64 zero64 = 0;
	__u64 *held = pmem.lookup_or_try_init(&pk, &zero64);
	if (held)
		__sync_fetch_and_add(held, delta);
	if (group_too && group != HAMI_GROUP_NONE) {
		struct hami_gkey gk = { .group = group, .device = dev };
		struct hami_gmem zero = {};
		struct hami_gmem *gm = grp_mem.lookup_or_try_init(&gk, &zero);
		if (gm)
			__sync_fetch_and_add(&gm->used, delta);
	}
}

/* ---- contexts ------------------------------------------------------------ */

static __always_inline void ctx_stack_op(__u32 tid, int op, __u64 cu_ctx, __s32 dev)
{
	struct hami_tctx zero = {};
	struct hami_tctx *t = cur_ctx.lookup_or_try_init(&tid, &zero);
	if (!t) {
		stat_inc(HAMI_STAT_CTX_FULL);
		return;
	}
	__u32 d = t->depth;
	if (op == HAMI_CTXOP_SET) {
		if (!cu_ctx) {
			if (d > 0)
				t->depth = d - 1;
			return;
		}
		if (d == 0)
			d = 1;
		t->ctx[(d - 1) & (HAMI_CTX_DEPTH - 1)] = cu_ctx;
		t->dev[(d - 1) & (HAMI_CTX_DEPTH - 1)] = dev;
		t->depth = d;
	} else if (op == HAMI_CTXOP_PUSH) {
		if (d >= HAMI_CTX_DEPTH)
			return;
		t->ctx[d & (HAMI_CTX_DEPTH - 1)] = cu_ctx;
		t->dev[d & (HAMI_CTX_DEPTH - 1)] = dev;
		t->depth = d + 1;
	} else if (op == HAMI_CTXOP_POP) {
		if (d > 0)
			t->depth = d - 1;
	} else if (op == HAMI_CTXOP_DESTROY) {
		if (d > 0 && t->ctx[(d - 1) & (HAMI_CTX_DEPTH - 1)] == cu_ctx)
			t->depth = d - 1;
	}
}

static __always_inline __s32 ctx_device(__u32 tgid, __u64 cu_ctx)
{
	struct hami_ckey k = { .tgid = tgid, .ctx = cu_ctx };
	__s32 *d = ctx_dev.lookup(&k);
	return d ? *d : -1;
}

static __always_inline void note_device(__u32 tgid, __s32 dev)
{
	struct hami_proc *p = get_proc(tgid);
	if (p && dev >= 0)
		p->last_dev = dev;
}

/* The entry probe's saved arguments for this thread, taken out of the map. */
static __always_inline int take_call(__u32 tid, struct hami_call *out)
{
	struct hami_call *c = inflight.lookup(&tid);
	if (!c)
		return 0;
	*out = *c;
	inflight.delete(&tid);
	return 1;
}

/* ---- admission ---------------------------------------------------------- */

#ifdef HAMI_HAVE_REG_WRITE
/*
 * The address of a `ret` byte at or after `entry` in the probed function's
 * code, 0 if none is readable within the scan. Jumping there returns to the
 * caller through the return address the call pushed, which is where the
 * kernel hijacks it for return probes: it does so after every entry handler
 * has run, at the stack pointer they leave, so a refusal must leave the stack
 * as it is (popping the return address itself would have the kernel plant
 * its trampoline in the caller's frame).
 */
static __always_inline __u64 find_ret(__u64 entry)
{
	__u8 buf[HAMI_RET_SCAN_CHUNK];
	for (int c = 0; c < HAMI_RET_SCAN_CHUNKS; c++) {
		__u64 at = entry + (__u64)c * HAMI_RET_SCAN_CHUNK;
		if (bpf_probe_read_user(buf, sizeof(buf), (void *)at) != 0)
			return 0;
		for (int i = 0; i < HAMI_RET_SCAN_CHUNK; i++)
			if (buf[i] == HAMI_X86_RET)
				return at + i;
	}
	return 0;
}
#endif

/*
 * Refuse an allocation. Returns the action taken (HAMI_ACT_*). With
 * stop-rewrite the process is stopped here and the controller makes the call
 * return CUDA_ERROR_OUT_OF_MEMORY before resuming it. return-oom returns it
 * here, in the kernel; where no `ret` is found to return through it falls
 * back to stop-rewrite, which the event's action tells the controller.
 */
static __always_inline __u32 deny(struct pt_regs *ctx, struct hami_config *c)
{
	__u32 act = c ? c->oom_action : HAMI_ACT_OBSERVE;
#ifdef HAMI_HAVE_REG_WRITE
	if (act == HAMI_ACT_RETURN_OOM) {
		/* The driver never runs: resume at a `ret` with the error in rax. */
		__u64 ret = find_ret(PT_REGS_IP(ctx));
		if (ret) {
			ctx->ip = ret;
			ctx->ax = HAMI_CUDA_ERROR_OUT_OF_MEMORY;
			return act;
		}
		stat_inc(HAMI_STAT_RET_FALLBACKS);
		act = HAMI_ACT_STOP_REWRITE;
	}
#endif
	switch (act) {
	case HAMI_ACT_STOP_REWRITE:
		if (!controller_alive(c)) {
			stat_inc(HAMI_STAT_STALE_SKIPS);
			return HAMI_ACT_NONE_STALE;
		}
		bpf_send_signal(HAMI_SIGSTOP);
		stat_inc(HAMI_STAT_STOPS);
		return act;
	case HAMI_ACT_KILL:
		bpf_send_signal(HAMI_SIGKILL);
		return act;
	default:
		return HAMI_ACT_OBSERVE;
	}
}

/* The name space an allocating call's result lives in (HAMI_KIND_*). */
static __always_inline __u32 alloc_kind_of(__u32 fn)
{
	return fn == HAMI_FN_CREATE ? HAMI_KIND_HANDLE :
	       fn == HAMI_FN_ARRAY ? HAMI_KIND_ARRAY : HAMI_KIND_PTR;
}

/*
 * Common entry of every allocation: reserve `size` on the group's device
 * atomically, so two processes of one group can't both pass a check that only
 * one fits. Returns 1 when the call was refused.
 */
static __always_inline int alloc_enter(struct pt_regs *ctx, __u32 fn, __u64 out, __u64 size,
				       __s32 visible_dev, __u64 aux, __u64 aux2)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct hami_proc *p = get_proc(tgid);
	if (visible_dev < 0)
		visible_dev = current_visible_device(tid, p);
	__s32 dev = to_physical(tgid, visible_dev);
	__u32 group = charged_group(tgid, p);

	struct hami_call call = {
		.out = out, .size = size, .aux = aux, .aux2 = aux2,
		.fn = fn, .flags = 0, .group = group, .device = dev,
	};
	if (group == HAMI_GROUP_NONE)
		call.flags |= HAMI_F_NOGROUP;

	struct hami_config *c = get_config();
	struct hami_gkey gk = { .group = group, .device = dev };
	struct hami_glim *lim = group != HAMI_GROUP_NONE ? grp_lim.lookup(&gk) : 0;
	if (group != HAMI_GROUP_NONE) {
		struct hami_gmem zero = {};
		struct hami_gmem *gm = grp_mem.lookup_or_try_init(&gk, &zero);
		if (gm) {
			__u64 before = __sync_fetch_and_add(&gm->used, size);
			if (lim && c && (c->flags & HAMI_CFG_ENFORCE_MEM) &&
			    lim->limit != HAMI_UNLIMITED && before + size > lim->limit) {
				/* The event first, tested once: a stop nobody hears of
				 * would never be resumed, so with the ring buffer full the
				 * call goes through (counted in stats as a drop). */
				struct hami_event *e = new_event(HAMI_EV_DENY);
				if (e) {
					__u32 act = deny(ctx, c);
					int refused = act != HAMI_ACT_OBSERVE && act != HAMI_ACT_NONE_STALE;
					if (refused) {
						__sync_fetch_and_add(&gm->used, -size);
						__sync_fetch_and_add(&gm->denied, 1);
						stat_inc(HAMI_STAT_DENIALS);
					}
					e->device = dev;
					e->group = group;
					e->size = size;
					e->aux = act;
					/* The probed entry: where stop-and-rewrite expects the
					 * stopped thread (entry + the emulated push). */
					e->ptr = PT_REGS_IP(ctx);
					e->alloc_kind = alloc_kind_of(fn);
					e->flags = act == HAMI_ACT_STOP_REWRITE ? HAMI_F_STOPPED : 0;
					events.ringbuf_submit(e, 0);
					if (refused) {
						/* The reservation is back; the call stays in
						 * flight, marked. Should it return success all
						 * the same (a stop resumed by someone else
						 * before its rewrite, a new ip the kernel did
						 * not take), its return probe charges what it
						 * allocated: over the limit, never unaccounted. */
						call.flags |= HAMI_F_DENIED;
						if (inflight.update(&tid, &call) != 0)
							stat_inc(HAMI_STAT_INFLIGHT_FULL);
						return 1;
					}
				}
			}
			call.flags |= HAMI_F_RESERVED;
		}
	}
	if (inflight.update(&tid, &call) != 0) {
		/* No return probe will settle it: don't keep the reservation. */
		stat_inc(HAMI_STAT_INFLIGHT_FULL);
		if (call.flags & HAMI_F_RESERVED) {
			struct hami_gmem *gm = grp_mem.lookup(&gk);
			if (gm)
				__sync_fetch_and_add(&gm->used, -size);
		}
	}
	return 0;
}

/* Common return of every allocation. */
static __always_inline int alloc_return(struct pt_regs *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct hami_call call;
	if (!take_call(tid, &call))
		return 0;
	if (call.fn != HAMI_FN_ALLOC && call.fn != HAMI_FN_PITCH && call.fn != HAMI_FN_CREATE &&
	    call.fn != HAMI_FN_ARRAY)
		return 0;

	int rc = (int)PT_REGS_RC(ctx);
	if (call.flags & HAMI_F_DENIED) {
		if (rc != HAMI_CUDA_SUCCESS)
			return 0;	/* the refusal took effect */
		stat_inc(HAMI_STAT_DENY_IGNORED);
	}
	__u64 size = call.size;
	__u64 ptr = 0;
	if (rc == HAMI_CUDA_SUCCESS) {
		bpf_probe_read_user(&ptr, sizeof(ptr), (void *)call.out);
		if (call.fn == HAMI_FN_PITCH) {
			__u64 pitch = 0;
			bpf_probe_read_user(&pitch, sizeof(pitch), (void *)call.aux);
			size = pitch * call.aux2;
		}
	}

	struct hami_gkey gk = { .group = call.group, .device = call.device };
	if (call.flags & HAMI_F_RESERVED) {
		/* Settle the reservation: give it all back on failure, or the
		 * difference when the driver padded (pitch). */
		__s64 delta = rc == HAMI_CUDA_SUCCESS ? (__s64)(size - call.size) : -(__s64)call.size;
		if (delta) {
			struct hami_gmem *gm = grp_mem.lookup(&gk);
			if (gm)
				__sync_fetch_and_add(&gm->used, delta);
		}
	}

	__u32 kind = 0;
	if (rc == HAMI_CUDA_SUCCESS) {
		kind = alloc_kind_of(call.fn);
		struct hami_akey ak = { .tgid = tgid, .kind = kind, .ptr = ptr };
		struct hami_proc *p = procs.lookup(&tgid);
		struct hami_alloc rec = { .size = size, .device = call.device,
					  .image = p ? p->image : 0 };
		if (allocs.update(&ak, &rec) != 0)
			stat_inc(HAMI_STAT_ALLOCS_FULL);
		charge(tgid, call.group, call.device, size, 0);
		/* Admitted without a group, but the process was adopted meanwhile:
		 * the group must see these bytes too. */
		if (!(call.flags & HAMI_F_RESERVED)) {
			__u32 g = p ? (__u32)p->charged : HAMI_GROUP_NONE;
			if (g != HAMI_GROUP_NONE) {
				struct hami_gkey gk2 = { .group = g, .device = call.device };
				struct hami_gmem zero = {};
				struct hami_gmem *gm = grp_mem.lookup_or_try_init(&gk2, &zero);
				if (gm)
					__sync_fetch_and_add(&gm->used, size);
			}
		}
	}
	/* Reserved only here, tested once: 6.1's verifier does not know a
	 * tested ring buffer record is non-null and walks a second test's
	 * "null" branch ("Unreleased reference"). */
	struct hami_event *e = new_event(rc == HAMI_CUDA_SUCCESS ? HAMI_EV_ALLOC : HAMI_EV_ALLOC_FAIL);
	if (e) {
		e->alloc_kind = kind;
		e->rc = rc;
		e->device = call.device;
		e->group = call.group;
		e->size = size;
		e->ptr = ptr;
		e->flags = call.flags;
		events.ringbuf_submit(e, 0);
	}
	return 0;
}

static __always_inline int free_enter(struct pt_regs *ctx, __u32 kind, __u64 ptr)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32;
	if (!ptr)
		return 0;
	struct hami_proc *p = get_proc(tgid);
	__u32 group = charged_group(tgid, p);
	struct hami_akey ak = { .tgid = tgid, .kind = kind, .ptr = ptr };
	struct hami_alloc *rec = allocs.lookup(&ak);
	__u64 size = 0;
	__s32 dev = -1;
	if (rec && p && rec->image != p->image) {
		/* Made by the image before an exec, whose bytes went back at the
		 * exec: freeing it now must not take them off again. */
		allocs.delete(&ak);
		rec = 0;
	}
	if (rec) {
		size = rec->size;
		dev = rec->device;
		allocs.delete(&ak);
		charge(tgid, group, dev, -(__s64)size, 1);
	}
	struct hami_event *e = new_event(HAMI_EV_FREE);   /* see alloc_return */
	if (e) {
		e->size = size;      /* 0 and -1: a pointer we have no record of */
		e->device = dev;
		e->alloc_kind = kind;
		e->ptr = ptr;
		e->group = group;
		events.ringbuf_submit(e, 0);
	}
	return 0;
}


/* ---- registration ------------------------------------------------------- */

/*
 * cuInit: the process uses CUDA. Where limits may apply (HAMI_CFG_GATE_INIT),
 * a process the controller has not classified yet is held here until it has:
 * otherwise its first allocations would be admitted against no group. Only
 * while the controller is alive to resume it; it learns of the hold from
 * gate_wait (maps.h), the event being only the fast path.
 */
int uprobe__cuInit(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	get_proc(tgid);
	__u32 flags = 0;
	struct hami_config *c = get_config();
	if (c && (c->flags & HAMI_CFG_GATE_INIT) && !proc_cfg.lookup(&tgid) && controller_alive(c)) {
		/* Recorded before the stop: the controller finds it in gate_wait
		 * even if the event below is lost. */
		__u64 now = bpf_ktime_get_ns();
		if (gate_wait.update(&tgid, &now) == 0) {
			bpf_send_signal(HAMI_SIGSTOP);
			stat_inc(HAMI_STAT_STOPS);
			flags = HAMI_F_STOPPED;
		}
	}
	struct hami_event *e = new_event(HAMI_EV_INIT);
	if (!e)
		return 0;
	e->flags = flags;
	events.ringbuf_submit(e, 0);
	return 0;
}

/* ---- contexts and devices ----------------------------------------------- */

/* Save where the new context will be written and for which device. */
static __always_inline int ctx_enter(__u32 fn, __u64 pctx, __s32 dev)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct hami_call call = { .out = pctx, .fn = fn, .device = dev };
	if (inflight.update(&tid, &call) != 0)
		stat_inc(HAMI_STAT_INFLIGHT_FULL);
	return 0;
}

/* cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) */
int uprobe__cuDevicePrimaryCtxRetain(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return ctx_enter(HAMI_FN_CTXRETAIN, PT_REGS_PARM1(ctx), (__s32)PT_REGS_PARM2(ctx));
}

/* cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) */
int uprobe__cuCtxCreate_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return ctx_enter(HAMI_FN_CTXCREATE, PT_REGS_PARM1(ctx), (__s32)PT_REGS_PARM3(ctx));
}

/* cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *p, int n, unsigned int flags, CUdevice dev) */
int uprobe__cuCtxCreate_v3(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return ctx_enter(HAMI_FN_CTXCREATE, PT_REGS_PARM1(ctx), (__s32)PT_REGS_PARM5(ctx));
}

/* cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p, unsigned int flags, CUdevice dev) */
int uprobe__cuCtxCreate_v4(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return ctx_enter(HAMI_FN_CTXCREATE, PT_REGS_PARM1(ctx), (__s32)PT_REGS_PARM4(ctx));
}

/* Return of cuDevicePrimaryCtxRetain and cuCtxCreate_*: learn ctx -> device;
 * creation also makes the context current. */
int uretprobe__ctx_return(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct hami_call call;
	if (!take_call(tid, &call))
		return 0;
	if ((call.fn != HAMI_FN_CTXRETAIN && call.fn != HAMI_FN_CTXCREATE) || PT_REGS_RC(ctx) != HAMI_CUDA_SUCCESS)
		return 0;
	__u64 cu_ctx = 0;
	bpf_probe_read_user(&cu_ctx, sizeof(cu_ctx), (void *)call.out);
	struct hami_ckey k = { .tgid = tgid, .ctx = cu_ctx };
	__s32 dev = call.device;
	if (ctx_dev.update(&k, &dev) != 0)
		stat_inc(HAMI_STAT_CTX_FULL);
	if (call.fn == HAMI_FN_CTXCREATE) {
		ctx_stack_op(tid, HAMI_CTXOP_PUSH, cu_ctx, dev);
		note_device(tgid, dev);
	}
	return 0;
}

/* cuCtxSetCurrent(CUcontext ctx) */
int uprobe__cuCtxSetCurrent(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	__u64 cu_ctx = PT_REGS_PARM1(ctx);
	__s32 dev = cu_ctx ? ctx_device(tgid, cu_ctx) : -1;
	ctx_stack_op(tid, HAMI_CTXOP_SET, cu_ctx, dev);
	note_device(tgid, dev);
	return 0;
}

/* cuCtxPushCurrent_v2(CUcontext ctx) */
int uprobe__cuCtxPushCurrent_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	__u64 cu_ctx = PT_REGS_PARM1(ctx);
	__s32 dev = ctx_device(tgid, cu_ctx);
	ctx_stack_op(tid, HAMI_CTXOP_PUSH, cu_ctx, dev);
	note_device(tgid, dev);
	return 0;
}

/* cuCtxPopCurrent_v2(CUcontext *pctx) */
int uprobe__cuCtxPopCurrent_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	ctx_stack_op(tid, HAMI_CTXOP_POP, 0, -1);
	return 0;
}

/* cuCtxDestroy_v2(CUcontext ctx) */
int uprobe__cuCtxDestroy_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	__u64 cu_ctx = PT_REGS_PARM1(ctx);
	struct hami_ckey k = { .tgid = tgid, .ctx = cu_ctx };
	ctx_dev.delete(&k);
	ctx_stack_op(tid, HAMI_CTXOP_DESTROY, cu_ctx, -1);
	return 0;
}

/* ---- allocation --------------------------------------------------------- */

/* cuMemAlloc_v2(CUdeviceptr *dptr, size_t size), and with the same first two
 * arguments: cuMemAllocManaged, cuMemAllocAsync[_ptsz],
 * cuMemAllocFromPoolAsync[_ptsz]. */
int uprobe__cuMemAlloc_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	alloc_enter(ctx, HAMI_FN_ALLOC, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), -1, 0, 0);
	return 0;
}

/* cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height, unsigned elem) */
int uprobe__cuMemAllocPitch_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 width = PT_REGS_PARM3(ctx), height = PT_REGS_PARM4(ctx);
	alloc_enter(ctx, HAMI_FN_PITCH, PT_REGS_PARM1(ctx), width * height, -1,
		    PT_REGS_PARM2(ctx), height);
	return 0;
}

/* cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
 *             const CUmemAllocationProp *prop, unsigned long long flags):
 * the device is prop->location.id. */
int uprobe__cuMemCreate(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__s32 dev = -1;
	__u64 prop = PT_REGS_PARM3(ctx);
	if (prop)
		bpf_probe_read_user(&dev, sizeof(dev), (void *)(prop + HAMI_MEMPROP_LOCATION_ID));
	alloc_enter(ctx, HAMI_FN_CREATE, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), dev, 0, 0);
	return 0;
}

/* One element of a CUDA array: its channels' bytes by format, or the most
 * any format takes where the format is not one of the plain ones. */
static __always_inline __u64 array_elem_bytes(__u32 format, __u32 channels)
{
	__u64 ch;
	switch (format) {
	case HAMI_AD_UNSIGNED_INT8:
	case HAMI_AD_SIGNED_INT8:
		ch = 1;
		break;
	case HAMI_AD_UNSIGNED_INT16:
	case HAMI_AD_SIGNED_INT16:
	case HAMI_AD_HALF:
		ch = 2;
		break;
	case HAMI_AD_UNSIGNED_INT32:
	case HAMI_AD_SIGNED_INT32:
	case HAMI_AD_FLOAT:
		ch = 4;
		break;
	default:
		return HAMI_ARRAY_ELEM_MAX;
	}
	/* 1, 2 or 4 channels; the driver refuses others, so bound them only. */
	if (channels < 1)
		channels = 1;
	if (channels > 4)
		channels = 4;
	return ch * channels;
}

/* Bytes of a CUDA array of w x h x d elements (a zero dimension counts as
 * one), over `levels` mipmap levels, each half the one before in every
 * dimension but Depth where it counts layers or cube faces. */
static __always_inline __u64 array_bytes(__u64 w, __u64 h, __u64 d, __u64 elem, __u32 flags,
					 __u32 levels)
{
	int halve_d = !(flags & (HAMI_ARRAY3D_LAYERED | HAMI_ARRAY3D_CUBEMAP));
	__u64 total = 0;
	if (!w)
		w = 1;
	if (!h)
		h = 1;
	if (!d)
		d = 1;
#pragma unroll
	for (int i = 0; i < HAMI_MIPMAP_LEVELS_MAX; i++) {
		if (i > 0 && (__u32)i >= levels)
			break;
		total += w * h * d * elem;
		w = w > 1 ? w >> 1 : 1;
		h = h > 1 ? h >> 1 : 1;
		if (halve_d)
			d = d > 1 ? d >> 1 : 1;
	}
	return total;
}

/* A CUDA array descriptor's size over `levels` levels (0 when unreadable):
 * a CUDA_ARRAY3D_DESCRIPTOR where is3d, else a CUDA_ARRAY_DESCRIPTOR (no
 * depth, no flags). */
static __always_inline __u64 array_desc_bytes(__u64 desc, int is3d, __u32 levels)
{
	__u64 w = 0, h = 0, d = 0;
	__u32 fmt = 0, ch = 0, flags = 0;
	if (!desc)
		return 0;
	if (bpf_probe_read_user(&w, sizeof(w), (void *)(desc + HAMI_ARRAY_WIDTH)) ||
	    bpf_probe_read_user(&h, sizeof(h), (void *)(desc + HAMI_ARRAY_HEIGHT)))
		return 0;
	if (is3d ? (bpf_probe_read_user(&d, sizeof(d), (void *)(desc + HAMI_ARRAY3D_DEPTH)) ||
		    bpf_probe_read_user(&fmt, sizeof(fmt), (void *)(desc + HAMI_ARRAY3D_FORMAT)) ||
		    bpf_probe_read_user(&ch, sizeof(ch), (void *)(desc + HAMI_ARRAY3D_CHANNELS)) ||
		    bpf_probe_read_user(&flags, sizeof(flags), (void *)(desc + HAMI_ARRAY3D_FLAGS)))
		 : (bpf_probe_read_user(&fmt, sizeof(fmt), (void *)(desc + HAMI_ARRAY_FORMAT)) ||
		    bpf_probe_read_user(&ch, sizeof(ch), (void *)(desc + HAMI_ARRAY_CHANNELS))))
		return 0;
	return array_bytes(w, h, d, array_elem_bytes(fmt, ch), flags, levels);
}

/* cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) */
int uprobe__cuArrayCreate_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	alloc_enter(ctx, HAMI_FN_ARRAY, PT_REGS_PARM1(ctx), array_desc_bytes(PT_REGS_PARM2(ctx), 0, 1),
		    -1, 0, 0);
	return 0;
}

/* cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) */
int uprobe__cuArray3DCreate_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	alloc_enter(ctx, HAMI_FN_ARRAY, PT_REGS_PARM1(ctx), array_desc_bytes(PT_REGS_PARM2(ctx), 1, 1),
		    -1, 0, 0);
	return 0;
}

/* cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
 *                        unsigned int numMipmapLevels) */
int uprobe__cuMipmappedArrayCreate(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u32 levels = (__u32)PT_REGS_PARM3(ctx);
	alloc_enter(ctx, HAMI_FN_ARRAY, PT_REGS_PARM1(ctx),
		    array_desc_bytes(PT_REGS_PARM2(ctx), 1, levels), -1, 0, 0);
	return 0;
}

int uretprobe__alloc_return(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return alloc_return(ctx);
}

/* cuMemFree_v2(CUdeviceptr), cuMemFreeAsync[_ptsz](CUdeviceptr, CUstream) */
int uprobe__cuMemFree_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return free_enter(ctx, HAMI_KIND_PTR, PT_REGS_PARM1(ctx));
}

/* cuArrayDestroy(CUarray), cuMipmappedArrayDestroy(CUmipmappedArray) */
int uprobe__cuArrayDestroy(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return free_enter(ctx, HAMI_KIND_ARRAY, PT_REGS_PARM1(ctx));
}

/* cuMemRelease(CUmemGenericAllocationHandle) */
int uprobe__cuMemRelease(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return free_enter(ctx, HAMI_KIND_HANDLE, PT_REGS_PARM1(ctx));
}

/* ---- memory information ------------------------------------------------- */

/* cuMemGetInfo_v2(size_t *free, size_t *total) */
int uprobe__cuMemGetInfo_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct hami_proc *p = get_proc(tgid);
	__s32 dev = to_physical(tgid, current_visible_device(tid, p));
	struct hami_call call = { .out = PT_REGS_PARM1(ctx), .aux = PT_REGS_PARM2(ctx),
				  .fn = HAMI_FN_MEMINFO, .device = dev,
				  .group = charged_group(tgid, p) };
	inflight.update(&tid, &call);
	return 0;
}

/* cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) */
int uprobe__cuDeviceTotalMem_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct hami_proc *p = get_proc(tgid);
	__s32 dev = to_physical(tgid, (__s32)PT_REGS_PARM2(ctx));
	struct hami_call call = { .out = PT_REGS_PARM1(ctx), .fn = HAMI_FN_TOTALMEM,
				  .device = dev, .group = charged_group(tgid, p) };
	inflight.update(&tid, &call);
	return 0;
}

/* nvmlDeviceGetHandleByIndex[_v2](unsigned index, nvmlDevice_t *device):
 * NVML's indices are physical (it ignores CUDA_VISIBLE_DEVICES). */
int uprobe__nvmlDeviceGetHandleByIndex(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return ctx_enter(HAMI_FN_NVMLHANDLE, PT_REGS_PARM2(ctx), (__s32)PT_REGS_PARM1(ctx));
}

int uretprobe__nvml_handle_return(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct hami_call call;
	if (!take_call(tid, &call))
		return 0;
	if (call.fn != HAMI_FN_NVMLHANDLE || PT_REGS_RC(ctx) != HAMI_NVML_SUCCESS)
		return 0;
	__u64 handle = 0;
	bpf_probe_read_user(&handle, sizeof(handle), (void *)call.out);
	struct hami_ckey k = { .tgid = tgid, .ctx = handle };
	__s32 dev = call.device;
	nvml_dev.update(&k, &dev);
	return 0;
}

/* nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *) and _v2: the memory
 * an nvidia-smi-style query sees; rewritten at return like cuMemGetInfo. */
static __always_inline int nvml_mem_enter(struct pt_regs *ctx, __u64 version)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct hami_ckey k = { .tgid = tgid, .ctx = PT_REGS_PARM1(ctx) };
	__s32 *dev = nvml_dev.lookup(&k);
	if (!dev)
		return 0;
	struct hami_proc *p = get_proc(tgid);
	struct hami_call call = { .out = PT_REGS_PARM2(ctx), .aux = version,
				  .fn = HAMI_FN_NVMLMEM, .device = *dev,
				  .group = charged_group(tgid, p) };
	inflight.update(&tid, &call);
	return 0;
}

int uprobe__nvmlDeviceGetMemoryInfo(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return nvml_mem_enter(ctx, HAMI_NVML_MEM_V1);
}

int uprobe__nvmlDeviceGetMemoryInfo_v2(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	return nvml_mem_enter(ctx, HAMI_NVML_MEM_V2);
}

/*
 * Return of cuMemGetInfo_v2 / cuDeviceTotalMem_v2: where the group has a
 * limit on the device, the caller must see the limit as total and
 * limit - group usage as free.
 */
int uretprobe__meminfo_return(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct hami_call call;
	if (!take_call(tid, &call))
		return 0;
	if ((call.fn != HAMI_FN_MEMINFO && call.fn != HAMI_FN_TOTALMEM && call.fn != HAMI_FN_NVMLMEM) ||
	    PT_REGS_RC(ctx) != HAMI_CUDA_SUCCESS)  /* HAMI_NVML_SUCCESS is the same 0 */
		return 0;
	struct hami_config *cfg = get_config();
	if (!cfg || !(cfg->flags & HAMI_CFG_VIRT_MEMINFO) || call.group == HAMI_GROUP_NONE)
		return 0;
	struct hami_gkey gk = { .group = call.group, .device = call.device };
	struct hami_glim *lim = grp_lim.lookup(&gk);
	if (!lim || !lim->total)
		return 0;
#ifdef HAMI_HAVE_PROBE_WRITE_USER
	{
		__u64 total = lim->total, used = 0, real_free = 0;
		struct hami_gmem *gm = grp_mem.lookup(&gk);
		if (gm)
			used = gm->used;
		__u64 free = used < total ? total - used : 0;
		if (call.fn == HAMI_FN_NVMLMEM) {
			int v2 = call.aux == HAMI_NVML_MEM_V2;
			__u64 total_at = call.out + (v2 ? HAMI_NVML_MEM_V2_TOTAL : HAMI_NVML_MEM_V1_TOTAL);
			__u64 free_at = call.out + (v2 ? HAMI_NVML_MEM_V2_FREE : HAMI_NVML_MEM_V1_FREE);
			__u64 used_at = call.out + (v2 ? HAMI_NVML_MEM_V2_USED : HAMI_NVML_MEM_V1_USED);
			bpf_probe_read_user(&real_free, sizeof(real_free), (void *)free_at);
			if (real_free < free)
				free = real_free;
			bpf_probe_write_user((void *)total_at, &total, sizeof(total));
			bpf_probe_write_user((void *)free_at, &free, sizeof(free));
			bpf_probe_write_user((void *)used_at, &used, sizeof(used));
		} else if (call.fn == HAMI_FN_MEMINFO) {
			bpf_probe_read_user(&real_free, sizeof(real_free), (void *)call.out);
			if (real_free < free)
				free = real_free;
			bpf_probe_write_user((void *)call.out, &free, sizeof(free));
			bpf_probe_write_user((void *)call.aux, &total, sizeof(total));
		} else {
			bpf_probe_write_user((void *)call.out, &total, sizeof(total));
		}
		return 0;
	}
#endif
	if (!controller_alive(cfg)) {
		stat_inc(HAMI_STAT_STALE_SKIPS);
		return 0;
	}
	/* The event first: a stop nobody hears of would never be resumed. */
	struct hami_event *e = new_event(call.fn == HAMI_FN_MEMINFO ? HAMI_EV_MEMINFO :
					 call.fn == HAMI_FN_NVMLMEM ? HAMI_EV_NVMLMEM : HAMI_EV_TOTALMEM);
	if (!e)
		return 0;
	bpf_send_signal(HAMI_SIGSTOP);
	stat_inc(HAMI_STAT_STOPS);
	e->device = call.device;
	e->group = call.group;
	e->ptr = call.out;
	e->aux = call.aux;
	e->flags = HAMI_F_STOPPED;
	events.ringbuf_submit(e, 0);
	return 0;
}

/* ---- launches (attached only on demand) ------------------------------- */

/*
 * Charge a launch to its group's SM budget on the calling thread's device.
 * Cost is the grid's block count (a proxy for GPU time that the controller's
 * feedback corrects). Over budget, the process stops until the controller
 * grants more; the controller stops and resumes the group's other processes
 * with it, so tensor-parallel peers are never frozen apart.
 */
static __always_inline int launch_charge(struct pt_regs *ctx, __u64 cost)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	__u64 one = 1;
	__u64 *n = launches.lookup(&tgid);
	if (n)
		__sync_fetch_and_add(n, 1);
	else
		launches.update(&tgid, &one);

	struct hami_proc *p = get_proc(tgid);
	__u32 group = charged_group(tgid, p);
	if (group == HAMI_GROUP_NONE)
		return 0;
	if (cost == 0)
		cost = 1;
	if (cost > (1 << 24))
		cost = 1 << 24;
	struct hami_gkey gk = { .group = group,
				.device = to_physical(tgid, current_visible_device(tid, p)) };
	struct hami_smuse zero = {};
	struct hami_smuse *u = sm_use.lookup_or_try_init(&gk, &zero);
	if (!u)
		return 0;
	__u64 consumed = __sync_fetch_and_add(&u->consumed, cost) + cost;
	__sync_fetch_and_add(&u->launches, 1);
	struct hami_smgrant *g = sm_grant.lookup(&gk);
	if (!g || !g->limited || consumed <= g->granted)
		return 0;
	struct hami_config *c = get_config();
	if (!controller_alive(c)) {
		stat_inc(HAMI_STAT_STALE_SKIPS);
		return 0;
	}
	struct hami_event *e = new_event(HAMI_EV_THROTTLE);
	if (!e)
		return 0;  /* nobody would learn of the stop: don't stop */
	bpf_send_signal(HAMI_SIGSTOP);
	stat_inc(HAMI_STAT_THROTTLES);
	e->flags = HAMI_F_STOPPED;
	e->device = gk.device;
	e->group = group;
	e->size = consumed;
	e->aux = g->granted;
	events.ringbuf_submit(e, 0);
	return 0;
}

/* cuLaunchKernel(f, gridX, gridY, gridZ, blockX, ...), and with the same
 * leading arguments cuLaunchCooperativeKernel and the _ptsz twins. */
int uprobe__cuLaunchKernel(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 gx = (__u32)PT_REGS_PARM2(ctx), gy = (__u32)PT_REGS_PARM3(ctx),
	      gz = (__u32)PT_REGS_PARM4(ctx);
	return launch_charge(ctx, gx * gy * gz);
}

/* cuLaunchKernelEx(const CUlaunchConfig *config, f, params, extra): the grid
 * is the config's first three unsigned ints, in user memory. */
int uprobe__cuLaunchKernelEx(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u32 grid[3] = {};
	__u64 cfg = PT_REGS_PARM1(ctx);
	if (cfg)
		bpf_probe_read_user(&grid, sizeof(grid), (void *)cfg);
	return launch_charge(ctx, (__u64)grid[0] * grid[1] * grid[2]);
}

/* cuGraphLaunch(exec, stream): one opaque launch of many kernels, charged
 * the controller's learned cost per graph (config.graph_cost). */
int uprobe__cuGraphLaunch(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	struct hami_config *c = get_config();
	return launch_charge(ctx, c && c->graph_cost ? c->graph_cost : 1);
}

/*
 * Synchronize calls (cuStreamSynchronize, cuCtxSynchronize,
 * cuEventSynchronize, _ptsz twins): when one returns, everything the group
 * had launched before it began is done on the GPU. That gives the controller
 * the GPU's real pace, which the host's launch rate hides behind a launch
 * queue that can hold a second of work.
 */
int uprobe__sync_enter(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct hami_proc *p = procs.lookup(&tgid);
	if (!p || p->charged == HAMI_GROUP_NONE)
		return 0;
	struct hami_syncat at = {};
	at.gk.group = (__u32)p->charged;
	at.gk.device = to_physical(tgid, current_visible_device(tid, p));
	struct hami_smuse *u = sm_use.lookup(&at.gk);
	if (!u)
		return 0;
	at.consumed = u->consumed;
	at.ts = bpf_ktime_get_ns();
	sync_at.update(&tid, &at);
	return 0;
}

/*
 * Duty pacing: the controller asked for this group to be held at its next
 * synchronize's return, where everything it launched before is done, so the
 * hold takes its time off the GPU too. One thread takes the request (cmpxchg)
 * and stops its process; the controller stops the group's other processes.
 */
static __always_inline void hold_at_sync(struct hami_gkey *gk)
{
	struct hami_smgrant *g = sm_grant.lookup(gk);
	if (!g || !g->limited || !g->hold_at_sync)
		return;
	if (__sync_val_compare_and_swap(&g->hold_at_sync, 1, 0) != 1)
		return;
	struct hami_config *c = get_config();
	if (!controller_alive(c)) {
		stat_inc(HAMI_STAT_STALE_SKIPS);
		return;
	}
	struct hami_event *e = new_event(HAMI_EV_THROTTLE);
	if (!e)
		return;  /* nobody would learn of the stop: don't stop */
	bpf_send_signal(HAMI_SIGSTOP);
	stat_inc(HAMI_STAT_THROTTLES);
	e->flags = HAMI_F_STOPPED | HAMI_F_AT_SYNC;
	e->device = gk->device;
	e->group = gk->group;
	events.ringbuf_submit(e, 0);
}

int uretprobe__sync_return(struct pt_regs *ctx)
{
	keep_off_private_stack(ctx);
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct hami_syncat *at = sync_at.lookup(&tid);
	if (!at)
		return 0;
	struct hami_syncat a = *at;
	sync_at.delete(&tid);
	if (PT_REGS_RC(ctx) != HAMI_CUDA_SUCCESS)
		return 0;
	struct hami_smuse *u = sm_use.lookup(&a.gk);
	if (!u)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	__sync_fetch_and_add(&u->sync_ns, now - a.ts);
	__sync_fetch_and_add(&u->syncs, 1);
	hold_at_sync(&a.gk);
	/* Racing writers may both store; the controller reads a maximum, and
	 * takes a time older than the completion it last saw as "now". */
	if (a.consumed > u->completed) {
		u->completed = a.consumed;
		u->completed_ns = now;
		/* Still learning: this completion may be the one that teaches the
		 * controller the group's pace, and a deep-queued workload refills
		 * its queue (a second of work on the H200) within microseconds of
		 * returning, long before the controller's next tick: that second
		 * would run uncapped. Spend the grant so that its next launch stops
		 * (launch_charge, heartbeat-gated) until the controller has looked. */
		struct hami_smgrant *g = sm_grant.lookup(&a.gk);
		if (g && g->limited && g->checkpoint && now - u->checkpoint_ns >= HAMI_CHECKPOINT_NS) {
			u->checkpoint_ns = now;
			g->granted = u->consumed;
		}
	}
	return 0;
}

/* ---- exits and execs ------------------------------------------------------ */

/*
 * A process image we know (it is in `procs`) is gone: give the bytes it held
 * back to its group and delete its entries, so that whatever comes next under
 * this pid (a reused pid, or the new image after an exec) starts clean.
 * Returns the group the bytes were charged to.
 */
static __always_inline __u32 release_image(__u32 tgid, struct hami_proc *p)
{
	__u32 group = (__u32)p->charged;
#pragma unroll
	for (int d = 0; d < HAMI_MAX_DEVS; d++) {
		struct hami_pkey pk = { .tgid = tgid, .device = d };
		__u64 *held = pmem.lookup(&pk);
		if (!held)
			continue;
		if (group != HAMI_GROUP_NONE && *held) {
			struct hami_gkey gk = { .group = group, .device = d };
			struct hami_gmem *gm = grp_mem.lookup(&gk);
			if (gm)
				__sync_fetch_and_add(&gm->used, -*held);
		}
		pmem.delete(&pk);
	}
	procs.delete(&tgid);
	proc_cfg.delete(&tgid);
	launches.delete(&tgid);
	gate_wait.delete(&tgid);
	return group;
}

/*
 * Every exiting thread gives back a reservation whose return probe will never
 * run, and drops its context stack. A thread-group leader we know (it is in
 * `procs`, so it called into libcuda) also gives back the bytes it held and is
 * reported, so the controller compacts its group at once. Kernel threads and
 * processes that never touched libcuda are not in `procs`: no event.
 * Attached by bcc from its name; the tracepoint's arguments are not needed.
 */
int tracepoint__sched__sched_process_exit(void *args)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;

	struct hami_call *c = inflight.lookup(&tid);
	if (c) {
		if (c->flags & HAMI_F_RESERVED) {
			struct hami_gkey gk = { .group = c->group, .device = c->device };
			struct hami_gmem *gm = grp_mem.lookup(&gk);
			if (gm)
				__sync_fetch_and_add(&gm->used, -c->size);
		}
		inflight.delete(&tid);
	}
	cur_ctx.delete(&tid);
	sync_at.delete(&tid);
	opening.delete(&tid);

	if (tid != tgid)
		return 0;
	struct hami_proc *p = procs.lookup(&tgid);
	if (!p)
		return 0;
	__u32 group = release_image(tgid, p);

	struct hami_event *e = new_event(HAMI_EV_EXIT);
	if (e) {
		e->group = group;
		events.ringbuf_submit(e, 0);
	}
	return 0;
}

#ifdef HAMI_HAVE_OPEN_GATE
/*
 * The open gate: a process that maps executable a file it opened under a
 * name like the driver library's ("libcuda" in the path: a private copy,
 * another path, a file it unlinks next) is stopped when that mmap returns,
 * before any code in it runs, until the controller has probes on that file
 * (or knows it has). Applied only while the heartbeat is fresh. Opens that
 * fail (the loader trying its search path) and files opened only to be read
 * (copies, linkers, scanners) stop nobody.
 */
static __always_inline int names_libcuda(const char *s, long n)
{
	/* "libcuda" not followed by a letter: libcuda.so.1, libcuda-copy.so,
	 * never the runtime's libcudart. */
	for (int i = 0; i < HAMI_PATH_SCAN - HAMI_LIBNAME_LEN - 1; i++) {
		if (i + HAMI_LIBNAME_LEN >= n)
			return 0;
		char next = s[i + HAMI_LIBNAME_LEN];
		if (s[i] == 'l' && s[i + 1] == 'i' && s[i + 2] == 'b' && s[i + 3] == 'c' &&
		    s[i + 4] == 'u' && s[i + 5] == 'd' && s[i + 6] == 'a' &&
		    !(next >= 'a' && next <= 'z'))
			return 1;
	}
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
	struct hami_config *c = get_config();
	if (!c || !(c->flags & HAMI_CFG_GATE_LIBS))
		return 0;
	char name[HAMI_PATH_SCAN];
	long n = bpf_probe_read_user_str(name, sizeof(name), args->filename);
	if (n <= 0 || !names_libcuda(name, n))
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 at = (__u64)args->filename;
	opening.update(&tid, &at);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 *at = opening.lookup(&tid);
	if (!at)
		return 0;
	opening.delete(&tid);
	if (args->ret < 0)
		return 0;
	/* Remember the descriptor: only mapping it executable is loading it
	 * (a copy, a linker, a scanner reading the file never do). */
	struct hami_libfd k = { .tgid = (__u32)(bpf_get_current_pid_tgid() >> 32),
				.fd = (__s32)args->ret };
	__u64 name = *at;
	lib_fds.update(&k, &name);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
	if (!(args->prot & HAMI_PROT_EXEC) || (long)args->fd < 0)
		return 0;
	struct hami_libfd k = { .tgid = (__u32)(bpf_get_current_pid_tgid() >> 32),
				.fd = (__s32)args->fd };
	__u64 *name = lib_fds.lookup(&k);
	if (!name)
		return 0;
	__u64 at = *name;
	lib_fds.delete(&k);
	struct hami_config *c = get_config();
	if (!controller_alive(c) || k.tgid == c->controller)
		return 0;
	/* The event first: a stop nobody hears of would never be resumed. The
	 * stop lands when the mmap returns: mapped, nothing in it run yet. */
	struct hami_event *e = new_event(HAMI_EV_LIBOPEN);
	if (!e)
		return 0;
	e->ptr = at;
	e->aux = k.fd;
	e->flags = HAMI_F_STOPPED;
	bpf_send_signal(HAMI_SIGSTOP);
	events.ringbuf_submit(e, 0);
	return 0;
}
#endif

/*
 * execve replaced a process image: the old image's CUDA memory died with it,
 * so its bytes go back to its group as at an exit, and the new image starts
 * unclassified (no proc_cfg: held at its cuInit like any new process). The
 * pid and its start time stay: only this event tells the controller. The
 * other threads of the old image exited through the program above (a
 * non-leader that execs takes over the leader's pid after the leader's exit
 * released the image: then there is nothing left here). Its allocation
 * records stay behind under the pid, marked with the old image
 * (hami_alloc.image), so a free in the new image never matches them.
 */
int tracepoint__sched__sched_process_exec(void *args)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;

	cur_ctx.delete(&tid);
	sync_at.delete(&tid);
	struct hami_proc *p = procs.lookup(&tgid);
	if (!p)
		return 0;
	__u32 group = release_image(tgid, p);

	struct hami_event *e = new_event(HAMI_EV_EXEC);
	if (e) {
		e->group = group;
		events.ringbuf_submit(e, 0);
	}
	return 0;
}
