/*
 * fakecuda: a stand-in for the NVIDIA CUDA driver library (libcuda.so.1).
 *
 * It exports a subset of the CUDA driver API with the real signatures and
 * simulates, per process, FAKECUDA_DEVICES devices (default 2) of
 * FAKECUDA_TOTAL_MEM bytes each (default 16 GiB).  Nothing runs on any GPU:
 * allocations hand out unique fake device pointers and are charged to the
 * device of the calling thread's current context; launches are counted (and
 * may busy-wait FAKECUDA_LAUNCH_NS nanoseconds to look like a kernel).
 *
 * It exists so that hami-bpf's uprobes, enforcement and demo can run on a
 * machine without a GPU.  Every exported entry point must begin with
 * `push %rbp`, as in the real libcuda 580: enforcement stops a thread right
 * after that emulated instruction and rewrites the call into an early return.
 * Build flags (see __init__.py): -O2 -fno-omit-frame-pointer
 * -fcf-protection=none -fno-ipa-icf -fvisibility=hidden -fPIC -shared.
 * tests/unit/test_fakecuda.py checks the first byte of each entry.
 *
 * No CUDA header is used; the few types needed are declared below with the
 * layouts of cuda.h (x86-64).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default"), noinline))
/* First statement of every exported function: using the frame address makes
 * gcc set up %rbp even in leaf functions, so the entry is `push %rbp`. */
#define ENTRY() __asm__ volatile("" : : "r"(__builtin_frame_address(0)) : "memory")

/* ---- types (cuda.h layouts) ---------------------------------------------- */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUuuid_st { char bytes[16]; } CUuuid;
typedef struct CUexecAffinityParam_st CUexecAffinityParam;
typedef struct CUctxCreateParams_st CUctxCreateParams;
typedef int CUdriverProcAddressQueryResult;

typedef struct CUmemLocation_st {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct {
    size_t Width, Height;
    int Format;               /* CUarray_format */
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;
typedef struct {
    size_t Width, Height, Depth;
    int Format;
    unsigned int NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

typedef struct CUlaunchAttribute_st CUlaunchAttribute;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

/* ---- error codes ---------------------------------------------------------- */
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_CONTEXT_ALREADY_IN_USE = 216,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

/* ---- simulation state ----------------------------------------------------- */
#define MAX_DEVICES 64
#define CTX_STACK_MAX 64
#define CTX_MAGIC 0xc0de2a11u
#define PTR_BASE 0x7f0000000000ULL
#define PTR_ALIGN 512ULL
#define DEV_SPAN (1ULL << 40)
#define NBUCKETS 65536

struct CUctx_st {
    unsigned magic;
    int dev;
    int primary;
    int refcount; /* primary: retain count */
    int alive;
};

enum { K_PTR = 1, K_HANDLE = 2, K_VA = 3, K_ARRAY = 4, K_MODULE = 5 };

struct alloc {
    struct alloc *next;
    unsigned long long key; /* device pointer or handle */
    unsigned long long size;
    int kind;
    int dev;               /* -1 for address reservations (no device memory) */
    struct CUctx_st *ctx;  /* owner context (NULL for cuMemCreate handles) */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_initialized;
static int g_ndev = 2;
static unsigned long long g_total = 16ULL << 30;
static unsigned long long g_launch_ns;
static unsigned long long g_used[MAX_DEVICES];
static unsigned long long g_next_off[MAX_DEVICES];
static unsigned long long g_next_va;
static unsigned long long g_next_handle = 0x1000;
static unsigned long long g_space; /* this copy's pointers and handles: its top bits */
static unsigned long long g_launches;

/*
 * The simulated GPU (FAKECUDA_GPU_SIM=/dev/shm/NAME): one timeline per device,
 * shared by every process that maps the same file, so processes compete for
 * it as they do for a real GPU.  A launch appends FAKECUDA_NS_PER_BLOCK x
 * blocks (a graph: FAKECUDA_GRAPH_NS) of GPU time to the device's queue;
 * a launch that finds more than FAKECUDA_QUEUE_NS of the process's own work
 * queued blocks until it drains to that depth (the driver's push-back), so
 * processes that keep their queues full share the device evenly; synchronize
 * calls sleep until the process's last launch is done.  Without the variable
 * launches take no GPU time and synchronize returns at once.
 *
 * FAKECUDA_SIM_SHARE_EFF=P (percent) serves the first PS_DEVS devices by
 * processor sharing instead of one FIFO: every process with work pending is
 * served at once, each at P%/k of the device while k > 1 share it, alone at
 * full speed, as a GPU time-slicing contexts does, losing the switches (two
 * matmul processes on the H200 complete ~90% of what one does alone). The
 * state is advanced lazily by whichever process calls in, under a spinlock
 * in the shared file; busy_ns then counts GPU time served.
 */
#define PS_DEVS 8
#define PS_SLOTS 32
struct ps_slot {
    unsigned int pid, pad;
    unsigned long long pending;                 /* device ns of work not yet served */
};
struct ps_dev {
    int lock, pad;
    unsigned long long t_last;                  /* served up to (CLOCK_MONOTONIC ns) */
    struct ps_slot s[PS_SLOTS];
};
struct gpu_sim {
    unsigned long long busy_until[MAX_DEVICES]; /* the device's queue ends at (CLOCK_MONOTONIC ns) */
    unsigned long long busy_ns[MAX_DEVICES];    /* GPU time ever queued */
    struct ps_dev ps[PS_DEVS];                  /* FAKECUDA_SIM_SHARE_EFF only */
};
static struct gpu_sim *g_sim;
static unsigned long long g_ns_per_block, g_graph_ns, g_queue_ns, g_share_eff;
static unsigned long long g_last_end[MAX_DEVICES]; /* this process's last launch done at */
static struct CUctx_st g_primary[MAX_DEVICES];
static struct alloc *g_table[NBUCKETS];

/*
 * Each process's device memory (FAKECUDA_PROC_MEM=/dev/shm/NAME), as NVML's
 * per-process list reports it on a bare-metal host: everything the process
 * holds, whichever call took it. The daemon reads it in place of NVML
 * (hami_bpf/fakecuda/sim.py, ProcMem). One slot per process, taken at its
 * first change (a free one, or one whose process is gone).
 */
#define PM_SLOTS 256
#define PM_DEVS 8
struct pm_slot {
    unsigned int pid, pad;
    unsigned long long used[PM_DEVS];
};
static struct pm_slot *g_pm;

static void pm_map(void)
{
    const char *path = getenv("FAKECUDA_PROC_MEM");
    if (!path || !*path || g_pm)
        return;
    size_t len = PM_SLOTS * sizeof(struct pm_slot);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return;
    if (ftruncate(fd, (off_t)len) == 0) {
        void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m != MAP_FAILED)
            g_pm = m;
    }
    close(fd);
}

/* This process's usage into its slot; under g_lock (or before any thread). */
static void pm_publish(void)
{
    if (!g_pm)
        return;
    unsigned int me = (unsigned int)getpid();
    struct pm_slot *slot = NULL;
    for (int i = 0; i < PM_SLOTS && !slot; i++)
        if (__atomic_load_n(&g_pm[i].pid, __ATOMIC_ACQUIRE) == me)
            slot = &g_pm[i];
    for (int i = 0; i < PM_SLOTS && !slot; i++) {
        unsigned int p = __atomic_load_n(&g_pm[i].pid, __ATOMIC_ACQUIRE);
        if ((p == 0 || (kill((pid_t)p, 0) != 0 && errno == ESRCH)) &&
            __sync_bool_compare_and_swap(&g_pm[i].pid, p, me))
            slot = &g_pm[i];
    }
    if (!slot)
        return;
    for (int d = 0; d < PM_DEVS; d++)
        __atomic_store_n(&slot->used[d], g_used[d], __ATOMIC_RELEASE);
}

/* A new image holds nothing yet (after an exec the old one's slot said otherwise). */
__attribute__((constructor)) static void pm_start(void)
{
    pm_map();
    pm_publish();
}

static __thread struct CUctx_st *t_stack[CTX_STACK_MAX];
static __thread int t_depth;

static unsigned long long env_ull(const char *name, unsigned long long dflt)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return dflt;
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    switch (*end) {
    case 'k': case 'K': v <<= 10; break;
    case 'm': case 'M': v <<= 20; break;
    case 'g': case 'G': v <<= 30; break;
    case 't': case 'T': v <<= 40; break;
    default: break;
    }
    return v;
}

static void load_config(void)
{
    unsigned long long n = env_ull("FAKECUDA_DEVICES", 2);
    g_ndev = n > MAX_DEVICES ? MAX_DEVICES : (int)n;
    g_total = env_ull("FAKECUDA_TOTAL_MEM", 16ULL << 30);
    g_launch_ns = env_ull("FAKECUDA_LAUNCH_NS", 0);
    g_ns_per_block = env_ull("FAKECUDA_NS_PER_BLOCK", 1000);
    g_graph_ns = env_ull("FAKECUDA_GRAPH_NS", 50000);
    g_queue_ns = env_ull("FAKECUDA_QUEUE_NS", 500000000ULL);
    g_share_eff = env_ull("FAKECUDA_SIM_SHARE_EFF", 0);
    const char *sim = getenv("FAKECUDA_GPU_SIM");
    if (sim && *sim) {
        int fd = open(sim, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0) {
            if (ftruncate(fd, sizeof(struct gpu_sim)) == 0) {
                void *m = mmap(NULL, sizeof(struct gpu_sim), PROT_READ | PROT_WRITE, MAP_SHARED,
                               fd, 0);
                if (m != MAP_FAILED)
                    g_sim = m;
            }
            close(fd);
        }
        if (!g_sim)
            fprintf(stderr, "fakecuda: cannot map the simulated GPU %s\n", sim);
    }
    /* A process that loads a second copy of the library gets pointers and
     * handles from it that the first copy never hands out, as a real
     * driver's come from the process's one address space (UVA). */
    unsigned long long a = (unsigned long long)(uintptr_t)&g_space;
    a ^= a >> 29;
    a *= 0x9e3779b97f4a7c15ULL;
    g_space = (a >> 48) << 48;
    for (int i = 0; i < MAX_DEVICES; i++) {
        g_primary[i].magic = CTX_MAGIC;
        g_primary[i].dev = i;
        g_primary[i].primary = 1;
    }
}

static inline unsigned bucket(unsigned long long key)
{
    key ^= key >> 29;
    key *= 0xbf58476d1ce4e5b9ULL;
    key ^= key >> 32;
    return (unsigned)(key & (NBUCKETS - 1));
}

static struct alloc *table_find(unsigned long long key, struct alloc ***prevp)
{
    struct alloc **pp = &g_table[bucket(key)];
    for (; *pp; pp = &(*pp)->next) {
        if ((*pp)->key == key) {
            if (prevp)
                *prevp = pp;
            return *pp;
        }
    }
    return NULL;
}

static void table_insert(struct alloc *a)
{
    unsigned b = bucket(a->key);
    a->next = g_table[b];
    g_table[b] = a;
}

static struct CUctx_st *current_ctx(void)
{
    return t_depth > 0 ? t_stack[t_depth - 1] : NULL;
}

static int ctx_valid(struct CUctx_st *c)
{
    return c && c->magic == CTX_MAGIC && c->alive;
}

/* Charge `size` bytes to the current context's device; store a new pointer. */
static CUresult do_alloc(CUdeviceptr *dptr, unsigned long long size)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *ctx = current_ctx();
    if (!ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    int dev = ctx->dev;
    struct alloc *a = calloc(1, sizeof(*a));
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    if (size > g_total || g_used[dev] + size > g_total) {
        pthread_mutex_unlock(&g_lock);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    unsigned long long span = (size + PTR_ALIGN - 1) & ~(PTR_ALIGN - 1);
    unsigned long long ptr;
    do { /* the offset wraps after 1 TiB of churn: skip live pointers */
        if (g_next_off[dev] + span >= DEV_SPAN)
            g_next_off[dev] = 0;
        ptr = g_space + PTR_BASE + ((unsigned long long)dev << 40) + g_next_off[dev];
        g_next_off[dev] += span;
    } while (table_find(ptr, NULL));
    a->key = ptr;
    a->size = size;
    a->kind = K_PTR;
    a->dev = dev;
    a->ctx = ctx;
    table_insert(a);
    g_used[dev] += size;
    pm_publish();
    pthread_mutex_unlock(&g_lock);
    *dptr = ptr;
    return CUDA_SUCCESS;
}

static CUresult do_free(unsigned long long key, int kind)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct alloc **pp = NULL;
    pthread_mutex_lock(&g_lock);
    struct alloc *a = table_find(key, &pp);
    if (!a || a->kind != kind) {
        pthread_mutex_unlock(&g_lock);
        return kind == K_PTR || kind == K_VA ? CUDA_ERROR_INVALID_VALUE
                                             : CUDA_ERROR_INVALID_HANDLE;
    }
    *pp = a->next;
    if (a->dev >= 0)
        g_used[a->dev] -= a->size;
    pm_publish();
    pthread_mutex_unlock(&g_lock);
    free(a);
    return CUDA_SUCCESS;
}

/* Destroying a context frees what was allocated in it, as the driver does. */
static void free_ctx_allocations(struct CUctx_st *ctx)
{
    pthread_mutex_lock(&g_lock);
    for (int b = 0; b < NBUCKETS; b++) {
        struct alloc **pp = &g_table[b];
        while (*pp) {
            struct alloc *a = *pp;
            if (a->ctx == ctx) {
                *pp = a->next;
                if (a->dev >= 0)
                    g_used[a->dev] -= a->size;
                free(a);
            } else {
                pp = &a->next;
            }
        }
    }
    pm_publish();
    pthread_mutex_unlock(&g_lock);
}

static void stack_remove(struct CUctx_st *ctx)
{
    int j = 0;
    for (int i = 0; i < t_depth; i++)
        if (t_stack[i] != ctx)
            t_stack[j++] = t_stack[i];
    t_depth = j;
}

static unsigned long long mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
}

static void count_launch(void)
{
    __atomic_add_fetch(&g_launches, 1, __ATOMIC_RELAXED);
    if (g_launch_ns) {
        unsigned long long t0 = mono_ns();
        while (mono_ns() - t0 < g_launch_ns)
            ;
    }
}

static void sleep_until_ns(unsigned long long when)
{
    struct timespec ts = {(time_t)(when / 1000000000ULL), (long)(when % 1000000000ULL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/* This process's kernels not yet done, oldest first: the driver pushes back
 * on a process (not the device) whose queue is full. */
#define SIM_RING 8192
static struct { unsigned long long end, ns; } g_ring[SIM_RING];
static unsigned g_ring_head, g_ring_len;
static unsigned long long g_pending_ns;
static pthread_mutex_t g_ring_lock = PTHREAD_MUTEX_INITIALIZER;

static void ring_retire(unsigned long long now)
{
    while (g_ring_len && g_ring[g_ring_head].end <= now) {
        g_pending_ns -= g_ring[g_ring_head].ns;
        g_ring_head = (g_ring_head + 1) % SIM_RING;
        g_ring_len--;
    }
}

/* ---- processor sharing (FAKECUDA_SIM_SHARE_EFF) ---- */
static void ps_lock(struct ps_dev *d)
{
    while (__atomic_exchange_n(&d->lock, 1, __ATOMIC_ACQUIRE))
        sched_yield();
}

static void ps_unlock(struct ps_dev *d)
{
    __atomic_store_n(&d->lock, 0, __ATOMIC_RELEASE);
}

/* Serve the pending work of every process on `dev` up to `now`. */
static void ps_advance(int dev, struct ps_dev *d, unsigned long long now)
{
    if (now <= d->t_last)
        return;
    double dt = d->t_last ? (double)(now - d->t_last) : 0.0;
    d->t_last = now;
    while (dt > 0) {
        int k = 0;
        unsigned long long least = 0;
        for (int i = 0; i < PS_SLOTS; i++) {
            unsigned long long p = d->s[i].pending;
            if (p) {
                k++;
                if (!least || p < least)
                    least = p;
            }
        }
        if (!k)
            break;
        double rate = (k == 1 ? 1.0 : (double)g_share_eff / 100.0) / k;  /* work per ns, each */
        double step = (double)least / rate;
        if (step > dt)
            step = dt;
        unsigned long long w = (unsigned long long)(step * rate + 0.5);
        if (!w)
            w = 1;
        for (int i = 0; i < PS_SLOTS; i++)
            if (d->s[i].pending)
                d->s[i].pending = d->s[i].pending > w ? d->s[i].pending - w : 0;
        __atomic_add_fetch(&g_sim->busy_ns[dev], (unsigned long long)step, __ATOMIC_RELAXED);
        dt -= step;
    }
}

/* This process's slot (a free one taken on first use); NULL if all are busy. */
static struct ps_slot *ps_mine(struct ps_dev *d)
{
    unsigned int me = (unsigned int)getpid();
    struct ps_slot *spare = NULL;
    for (int i = 0; i < PS_SLOTS; i++) {
        if (d->s[i].pid == me)
            return &d->s[i];
        if (!spare && !d->s[i].pending)
            spare = &d->s[i];
    }
    if (spare)
        spare->pid = me;
    return spare;
}

/* Lock `dev`, serve it up to now and return this process's slot; the
 * caller unlocks. */
static struct ps_slot *ps_enter(int dev, struct ps_dev *d)
{
    ps_lock(d);
    ps_advance(dev, d, mono_ns());
    return ps_mine(d);
}

/* Sleep about `ns` (work still to be served), between lo and hi. */
static void ps_wait(unsigned long long ns, unsigned long long lo, unsigned long long hi)
{
    sleep_until_ns(mono_ns() + (ns < lo ? lo : ns > hi ? hi : ns));
}

/* Queue `ns` of work, waiting while this process has more than
 * FAKECUDA_QUEUE_NS pending (the driver's push-back). */
static void ps_launch(int dev, unsigned long long ns)
{
    struct ps_dev *d = &g_sim->ps[dev];
    for (;;) {
        struct ps_slot *m = ps_enter(dev, d);
        if (!m || !m->pending || m->pending + ns <= g_queue_ns) {
            if (m)
                m->pending += ns;
            ps_unlock(d);
            return;
        }
        unsigned long long over = m->pending + ns - g_queue_ns;
        ps_unlock(d);
        ps_wait(over, 50000, 2000000);
    }
}

/* Wait until this process's work is served (polling keeps the state moving). */
static void ps_sync(int dev)
{
    struct ps_dev *d = &g_sim->ps[dev];
    for (;;) {
        struct ps_slot *m = ps_enter(dev, d);
        unsigned long long p = m ? m->pending : 0;
        ps_unlock(d);
        if (!p)
            return;
        ps_wait(p, 20000, 1000000);
    }
}

/* Queue `ns` of GPU time on `dev`. One FIFO timeline per device, shared by
 * all processes: work-conserving, and fair between processes that keep their
 * queues full, since each may hold at most FAKECUDA_QUEUE_NS of it. */
static void sim_launch(int dev, unsigned long long ns)
{
    if (!g_sim || dev < 0 || dev >= MAX_DEVICES)
        return;
    if (g_share_eff && dev < PS_DEVS) {
        ps_launch(dev, ns);
        return;
    }
    pthread_mutex_lock(&g_ring_lock);
    unsigned long long now = mono_ns();
    ring_retire(now);
    while (g_ring_len && (g_pending_ns + ns > g_queue_ns || g_ring_len == SIM_RING)) {
        unsigned long long wake = g_ring[g_ring_head].end;
        pthread_mutex_unlock(&g_ring_lock);
        sleep_until_ns(wake);
        pthread_mutex_lock(&g_ring_lock);
        now = mono_ns();
        ring_retire(now);
    }
    unsigned long long old = __atomic_load_n(&g_sim->busy_until[dev], __ATOMIC_ACQUIRE), end;
    do {
        end = (old > now ? old : now) + ns;
    } while (!__atomic_compare_exchange_n(&g_sim->busy_until[dev], &old, end, 0,
                                          __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    __atomic_add_fetch(&g_sim->busy_ns[dev], ns, __ATOMIC_RELAXED);
    unsigned tail = (g_ring_head + g_ring_len) % SIM_RING;
    g_ring[tail].end = end;
    g_ring[tail].ns = ns;
    g_ring_len++;
    g_pending_ns += ns;
    if (end > g_last_end[dev])
        g_last_end[dev] = end;
    pthread_mutex_unlock(&g_ring_lock);
}

static void sim_sync(int dev)
{
    if (g_sim && g_share_eff && dev >= 0 && dev < PS_DEVS) {
        ps_sync(dev);
        return;
    }
    if (g_sim && dev >= 0 && dev < MAX_DEVICES)
        sleep_until_ns(__atomic_load_n(&g_last_end[dev], __ATOMIC_RELAXED));
}

static CUresult launch_check(unsigned long long ns)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct CUctx_st *c = current_ctx();
    if (!ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    count_launch();
    sim_launch(c->dev, ns);
    return CUDA_SUCCESS;
}

static unsigned long long grid_ns(unsigned long long gx, unsigned long long gy,
                                  unsigned long long gz)
{
    return gx * gy * gz * g_ns_per_block;
}

static CUresult sync_check(void)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    struct CUctx_st *c = current_ctx();
    if (!ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_sync(c->dev);
    return CUDA_SUCCESS;
}

/* ---- initialization and devices ------------------------------------------ */
EXPORT CUresult cuInit(unsigned int Flags)
{
    ENTRY();
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&g_once, load_config);
    if (g_ndev <= 0)
        return CUDA_ERROR_NO_DEVICE;
    __atomic_store_n(&g_initialized, 1, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *driverVersion)
{
    ENTRY();
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = 13000;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = g_ndev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "FakeCUDA Simulated GPU %d", dev);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    static const char prefix[12] = {'f', 'a', 'k', 'e', 'c', 'u', 'd', 'a', 0x5e, 0x1a, 0x7e, 0xd0};
    memcpy(uuid->bytes, prefix, 12);
    uuid->bytes[12] = 0;
    uuid->bytes[13] = 0;
    uuid->bytes[14] = (char)(dev >> 8);
    uuid->bytes[15] = (char)dev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = g_total;
    return CUDA_SUCCESS;
}

/* ---- contexts -------------------------------------------------------------- */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    g_primary[dev].refcount++;
    g_primary[dev].alive = 1;
    pthread_mutex_unlock(&g_lock);
    *pctx = &g_primary[dev];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    int reset = 0;
    pthread_mutex_lock(&g_lock);
    if (g_primary[dev].refcount <= 0) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (--g_primary[dev].refcount == 0) {
        g_primary[dev].alive = 0; /* the static object stays; it is inactive */
        reset = 1;
    }
    pthread_mutex_unlock(&g_lock);
    if (reset)
        free_ctx_allocations(&g_primary[dev]);
    return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *pctx, CUdevice dev)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    if (t_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_UNKNOWN;
    struct CUctx_st *c = calloc(1, sizeof(*c));
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->magic = CTX_MAGIC;
    c->dev = dev;
    c->alive = 1;
    t_stack[t_depth++] = c;
    *pctx = c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    ENTRY();
    (void)flags;
    return ctx_create(pctx, dev);
}

EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                               unsigned int flags, CUdevice dev)
{
    ENTRY();
    (void)paramsArray;
    (void)numParams;
    (void)flags;
    return ctx_create(pctx, dev);
}

EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
                               unsigned int flags, CUdevice dev)
{
    ENTRY();
    (void)ctxCreateParams;
    (void)flags;
    return ctx_create(pctx, dev);
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx_valid(ctx) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    ctx->alive = 0; /* the object is never freed: stale handles stay detectable */
    stack_remove(ctx);
    free_ctx_allocations(ctx);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx == NULL) {
        if (t_depth > 0)
            t_depth--;
        return CUDA_SUCCESS;
    }
    if (!ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth == 0)
        t_stack[t_depth++] = ctx;
    else
        t_stack[t_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_ctx();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_UNKNOWN;
    t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (t_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = t_stack[--t_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = current_ctx();
    if (!ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->dev;
    return CUDA_SUCCESS;
}

/* ---- memory ----------------------------------------------------------------- */
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    ENTRY();
    return do_alloc(dptr, bytesize);
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                   size_t Height, unsigned int ElementSizeBytes)
{
    ENTRY();
    if (!pPitch || WidthInBytes == 0 || Height == 0)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    size_t pitch = (WidthInBytes + PTR_ALIGN - 1) & ~(size_t)(PTR_ALIGN - 1);
    if (Height > (~(size_t)0) / pitch)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = do_alloc(dptr, pitch * Height);
    if (rc == CUDA_SUCCESS)
        *pPitch = pitch;
    return rc;
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    ENTRY();
    if (flags != 1 && flags != 2) /* CU_MEM_ATTACH_GLOBAL, CU_MEM_ATTACH_HOST */
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return do_alloc(dptr, bytesize);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    ENTRY();
    return do_free(dptr, K_PTR);
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ENTRY();
    (void)hStream;
    return do_alloc(dptr, bytesize);
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ENTRY();
    (void)hStream;
    return do_alloc(dptr, bytesize);
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    ENTRY();
    (void)hStream;
    return do_free(dptr, K_PTR);
}

EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    ENTRY();
    (void)hStream;
    return do_free(dptr, K_PTR);
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                        CUstream hStream)
{
    ENTRY();
    (void)pool;
    (void)hStream;
    return do_alloc(dptr, bytesize);
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                             CUmemoryPool pool, CUstream hStream)
{
    ENTRY();
    (void)pool;
    (void)hStream;
    return do_alloc(dptr, bytesize);
}

/* Charge `size` bytes to `dev`; a new handle of `kind` in *key (a handle
 * made in a context, `ctx`, goes when that context does). */
static CUresult new_handle(unsigned long long *key, unsigned long long size, int kind, int dev,
                           struct CUctx_st *ctx)
{
    struct alloc *a = calloc(1, sizeof(*a));
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    if (size > g_total || g_used[dev] + size > g_total) {
        pthread_mutex_unlock(&g_lock);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->key = g_space + g_next_handle++;
    a->size = size;
    a->kind = kind;
    a->dev = dev;
    a->ctx = ctx;
    table_insert(a);
    g_used[dev] += size;
    pm_publish();
    pthread_mutex_unlock(&g_lock);
    *key = a->key;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                            const CUmemAllocationProp *prop, unsigned long long flags)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!handle || !prop || size == 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type != 1) /* CU_MEM_LOCATION_TYPE_DEVICE */
        return CUDA_ERROR_INVALID_VALUE;
    int dev = prop->location.id;
    if (dev < 0 || dev >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    return new_handle(handle, size, K_HANDLE, dev, NULL);
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    ENTRY();
    return do_free(handle, K_HANDLE);
}

/* ---- CUDA arrays ------------------------------------------------------------- */
/* A channel's bytes by CUarray_format; 0 for a format the stand-in refuses.
 * The 8-bit normalized formats (CU_AD_FORMAT_UNORM_INT8X1/X2/X4) stand for
 * the formats whose size a CUarray_format alone does not say. */
static unsigned long long array_channel_bytes(int format)
{
    switch (format) {
    case 0x01: case 0x08: return 1;                 /* [UN]SIGNED_INT8 */
    case 0x02: case 0x09: case 0x10: return 2;      /* [UN]SIGNED_INT16, HALF */
    case 0x03: case 0x0a: case 0x20: return 4;      /* [UN]SIGNED_INT32, FLOAT */
    case 0xc0: case 0xc1: case 0xc2: return 1;      /* UNORM_INT8X1, X2, X4 */
    default: return 0;
    }
}

/* Device bytes of a w x h x d array (a zero dimension counts as one) over
 * `levels` mipmap levels, each half the one before (Depth too, unless it
 * counts layers or cube faces); 0 where the descriptor is refused. */
static unsigned long long array_size(size_t w, size_t h, size_t d, int format,
                                     unsigned channels, unsigned flags, unsigned levels)
{
    unsigned long long ch = array_channel_bytes(format);
    if (!ch || w == 0 || (channels != 1 && channels != 2 && channels != 4) || levels == 0 ||
        levels > 32 || (flags & ~0x05u))   /* CUDA_ARRAY3D_LAYERED, CUDA_ARRAY3D_CUBEMAP */
        return 0;
    if ((flags & 0x04) && (w != h || (d % 6) != 0))
        return 0;
    unsigned long long total = 0, W = w, H = h ? h : 1, D = d ? d : 1;
    for (unsigned i = 0; i < levels; i++) {
        total += W * H * D * ch * channels;
        W = W > 1 ? W >> 1 : 1;
        H = H > 1 ? H >> 1 : 1;
        if (!(flags & 0x05))
            D = D > 1 ? D >> 1 : 1;
    }
    return total;
}

/* Charge `size` bytes to the current context's device; a new handle of `kind`
 * (a module may hold no device memory). */
static CUresult do_handle(void **handle, unsigned long long size, int kind)
{
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!handle || (size == 0 && kind != K_MODULE))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *ctx = current_ctx();
    if (!ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    unsigned long long key;
    CUresult rc = new_handle(&key, size, kind, ctx->dev, ctx);
    if (rc == CUDA_SUCCESS)
        *handle = (void *)(uintptr_t)key;
    return rc;
}

EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    ENTRY();
    if (!desc)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return do_handle((void **)pHandle, array_size(desc->Width, desc->Height, 1, desc->Format,
                                                  desc->NumChannels, 0, 1), K_ARRAY);
}

EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    ENTRY();
    if (!desc)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return do_handle((void **)pHandle, array_size(desc->Width, desc->Height, desc->Depth,
                                                  desc->Format, desc->NumChannels, desc->Flags, 1),
                     K_ARRAY);
}

EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                       const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                       unsigned int numMipmapLevels)
{
    ENTRY();
    if (!desc)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return do_handle((void **)pHandle, array_size(desc->Width, desc->Height, desc->Depth,
                                                  desc->Format, desc->NumChannels, desc->Flags,
                                                  numMipmapLevels), K_ARRAY);
}

EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    ENTRY();
    return do_free((unsigned long long)(uintptr_t)hArray, K_ARRAY);
}

EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    ENTRY();
    return do_free((unsigned long long)(uintptr_t)hMipmappedArray, K_ARRAY);
}

/* ---- modules ------------------------------------------------------------------ */
/* A module's static __device__ variables take device memory when it loads,
 * through no allocation call. The stand-in's image is text: an image that
 * begins with FAKE_MODULE_TAG and a size holds that many bytes of globals. */
#define FAKE_MODULE_TAG "fakecuda-module globals="
typedef struct CUmod_st *CUmodule;

EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    ENTRY();
    if (!module || !image)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    unsigned long long globals = 0;
    if (!strncmp(image, FAKE_MODULE_TAG, strlen(FAKE_MODULE_TAG)))
        globals = strtoull((const char *)image + strlen(FAKE_MODULE_TAG), NULL, 0);
    return do_handle((void **)module, globals, K_MODULE);
}

EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
    ENTRY();
    return do_free((unsigned long long)(uintptr_t)hmod, K_MODULE);
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                    CUdeviceptr addr, unsigned long long flags)
{
    ENTRY();
    (void)addr;
    (void)flags;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    unsigned long long align = alignment ? alignment : (2ULL << 20);
    if (align & (align - 1))
        return CUDA_ERROR_INVALID_VALUE;
    struct alloc *a = calloc(1, sizeof(*a));
    if (!a)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    /* virtual ranges live above every device's pointer span */
    unsigned long long base = g_space + PTR_BASE + ((unsigned long long)MAX_DEVICES << 40);
    unsigned long long va = (base + g_next_va + align - 1) & ~(align - 1);
    g_next_va = va - base + ((size + align - 1) & ~(align - 1));
    a->key = va;
    a->size = size;
    a->kind = K_VA;
    a->dev = -1;
    table_insert(a);
    pthread_mutex_unlock(&g_lock);
    *ptr = va;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    ENTRY();
    (void)size;
    return do_free(ptr, K_VA);
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                         CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    ENTRY();
    (void)offset;
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (size == 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    struct alloc *h = table_find(handle, NULL);
    int ok = h && h->kind == K_HANDLE;
    pthread_mutex_unlock(&g_lock);
    (void)ptr;
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ptr == 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                               size_t count)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ptr == 0 || size == 0 || !desc || count == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++)
        if (desc[i].location.type == 1 && (desc[i].location.id < 0 || desc[i].location.id >= g_ndev))
            return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    ENTRY();
    if (!g_initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!free_bytes || !total_bytes)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = current_ctx();
    if (!ctx_valid(c))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_lock);
    unsigned long long used = g_used[c->dev];
    pthread_mutex_unlock(&g_lock);
    *free_bytes = g_total - used;
    *total_bytes = g_total;
    return CUDA_SUCCESS;
}

/* ---- launches ------------------------------------------------------------- */
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                               unsigned int gridDimZ, unsigned int blockDimX,
                               unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream,
                               void **kernelParams, void **extra)
{
    ENTRY();
    (void)f; (void)gridDimX; (void)gridDimY; (void)gridDimZ; (void)blockDimX;
    (void)blockDimY; (void)blockDimZ; (void)sharedMemBytes; (void)hStream;
    (void)kernelParams; (void)extra;
    return launch_check(grid_ns(gridDimX, gridDimY, gridDimZ));
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                    unsigned int gridDimZ, unsigned int blockDimX,
                                    unsigned int blockDimY, unsigned int blockDimZ,
                                    unsigned int sharedMemBytes, CUstream hStream,
                                    void **kernelParams, void **extra)
{
    ENTRY();
    (void)f; (void)gridDimX; (void)gridDimY; (void)gridDimZ; (void)blockDimX;
    (void)blockDimY; (void)blockDimZ; (void)sharedMemBytes; (void)hStream;
    (void)kernelParams; (void)extra;
    return launch_check(grid_ns(gridDimX, gridDimY, gridDimZ));
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                 void **extra)
{
    ENTRY();
    (void)f; (void)kernelParams; (void)extra;
    if (!config)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return launch_check(grid_ns(config->gridDimX, config->gridDimY, config->gridDimZ));
}

EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                      void **kernelParams, void **extra)
{
    ENTRY();
    (void)f; (void)kernelParams; (void)extra;
    if (!config)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return launch_check(grid_ns(config->gridDimX, config->gridDimY, config->gridDimZ));
}

EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX,
                                          unsigned int gridDimY, unsigned int gridDimZ,
                                          unsigned int blockDimX, unsigned int blockDimY,
                                          unsigned int blockDimZ, unsigned int sharedMemBytes,
                                          CUstream hStream, void **kernelParams)
{
    ENTRY();
    (void)f; (void)gridDimX; (void)gridDimY; (void)gridDimZ; (void)blockDimX;
    (void)blockDimY; (void)blockDimZ; (void)sharedMemBytes; (void)hStream;
    (void)kernelParams;
    return launch_check(grid_ns(gridDimX, gridDimY, gridDimZ));
}

EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                               unsigned int gridDimY, unsigned int gridDimZ,
                                               unsigned int blockDimX, unsigned int blockDimY,
                                               unsigned int blockDimZ,
                                               unsigned int sharedMemBytes, CUstream hStream,
                                               void **kernelParams)
{
    ENTRY();
    (void)f; (void)gridDimX; (void)gridDimY; (void)gridDimZ; (void)blockDimX;
    (void)blockDimY; (void)blockDimZ; (void)sharedMemBytes; (void)hStream;
    (void)kernelParams;
    return launch_check(grid_ns(gridDimX, gridDimY, gridDimZ));
}

EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    ENTRY();
    (void)hStream;
    if (!hGraphExec)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return launch_check(g_graph_ns);
}

EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    ENTRY();
    (void)hStream;
    if (!hGraphExec)
        return g_initialized ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return launch_check(g_graph_ns);
}

/* ---- synchronize ---------------------------------------------------------- */
EXPORT CUresult cuCtxSynchronize(void)
{
    ENTRY();
    return sync_check();
}

/* What cudaDeviceSynchronize calls in CUDA 12.8+ runtimes (driver 580). */
EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    ENTRY();
    (void)ctx;
    return sync_check();
}

EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
    ENTRY();
    (void)hStream;
    return sync_check();
}

EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    ENTRY();
    (void)hStream;
    return sync_check();
}

EXPORT CUresult cuEventSynchronize(void *hEvent)
{
    ENTRY();
    if (!hEvent)
        return CUDA_ERROR_INVALID_VALUE;
    return sync_check();
}

/* ---- entry points by name and error strings -------------------------------- */
static void *self_handle(void)
{
    static void *handle;
    void *h = __atomic_load_n(&handle, __ATOMIC_ACQUIRE);
    if (h)
        return h;
    Dl_info info;
    if (!dladdr((void *)&self_handle, &info) || !info.dli_fname)
        return NULL;
    h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (h)
        __atomic_store_n(&handle, h, __ATOMIC_RELEASE);
    return h;
}

/* Resolve like the driver does, well enough for tests: with the per-thread
 * default stream flag (2) prefer the _ptsz/_ptds variants, then the `_v2`
 * version of the name, then the name itself. */
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    ENTRY();
    (void)cudaVersion;
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    if (symbolStatus)
        *symbolStatus = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    if (strncmp(symbol, "cu", 2) != 0 || strlen(symbol) > 200)
        return CUDA_ERROR_NOT_FOUND;
    void *h = self_handle();
    if (!h)
        return CUDA_ERROR_UNKNOWN;
    static const char *const pt_suffixes[] = {"_v2_ptsz", "_v2_ptds", "_ptsz", "_ptds"};
    static const char *const suffixes[] = {"_v2", ""};
    char name[256];
    if (flags & 2) {
        for (size_t i = 0; i < sizeof(pt_suffixes) / sizeof(*pt_suffixes); i++) {
            snprintf(name, sizeof(name), "%s%s", symbol, pt_suffixes[i]);
            if ((*pfn = dlsym(h, name)))
                goto found;
        }
    }
    for (size_t i = 0; i < sizeof(suffixes) / sizeof(*suffixes); i++) {
        snprintf(name, sizeof(name), "%s%s", symbol, suffixes[i]);
        if ((*pfn = dlsym(h, name)))
            goto found;
    }
    return CUDA_ERROR_NOT_FOUND;
found:
    if (symbolStatus)
        *symbolStatus = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    ENTRY();
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const char *s = NULL;
    switch (error) {
    case CUDA_SUCCESS: s = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: s = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: s = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: s = "initialization error"; break;
    case CUDA_ERROR_DEINITIALIZED: s = "driver shutting down"; break;
    case CUDA_ERROR_NO_DEVICE: s = "no CUDA-capable device is detected"; break;
    case CUDA_ERROR_INVALID_DEVICE: s = "invalid device ordinal"; break;
    case CUDA_ERROR_INVALID_CONTEXT: s = "invalid device context"; break;
    case CUDA_ERROR_INVALID_HANDLE: s = "invalid resource handle"; break;
    case CUDA_ERROR_NOT_FOUND: s = "named symbol not found"; break;
    case CUDA_ERROR_NOT_SUPPORTED: s = "operation not supported"; break;
    case CUDA_ERROR_UNKNOWN: s = "unknown error"; break;
    default:
        *pStr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = s;
    return CUDA_SUCCESS;
}

/* ---- not CUDA: introspection for tests ------------------------------------- */
EXPORT unsigned long long fakecuda_launch_count(void)
{
    ENTRY();
    return __atomic_load_n(&g_launches, __ATOMIC_RELAXED);
}

EXPORT unsigned long long fakecuda_used(int dev)
{
    ENTRY();
    if (dev < 0 || dev >= MAX_DEVICES)
        return 0;
    pthread_mutex_lock(&g_lock);
    unsigned long long u = g_used[dev];
    pthread_mutex_unlock(&g_lock);
    return u;
}
