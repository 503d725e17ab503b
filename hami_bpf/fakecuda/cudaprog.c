/*
 * cudaprog: a scriptable CUDA driver API workload for tests and the demo.
 *
 * Linked against libcuda.so.1 (the fakecuda stand-in, or a real driver).
 * Reads commands from stdin, one per line, and answers each with exactly one
 * flushed line on stdout: `ok key=value ...` or `err message`.
 *   cudaprog                  commands from stdin
 *   cudaprog -c 'a; b; c'     run a script (no stdin), then exit 0
 *   cudaprog -q ...           print no answers
 * Commands (sizes accept K/M/G/T suffixes, binary):
 *   init | pid | device N | ctxcreate N | ctxpush | ctxpop | ctxdestroy
 *   alloc SIZE | allocpitch W H ELEM | allocmanaged SIZE | allocasync SIZE
 *   allocpool SIZE | create SIZE DEV | vmm SIZE DEV | free ID | meminfo
 *   array W H FORMAT CHANNELS | array3d W H D FORMAT CHANNELS FLAGS
 *   mipmap W H D FORMAT CHANNELS FLAGS LEVELS (CUDA arrays; freed by free ID)
 *   module SIZE (a module whose globals take SIZE bytes; unloaded by free ID)
 *   totalmem N | launch N | launchex N | coop N | graph N
 *   getproc NAME [FLAGS] | procalloc SIZE | thread CMD... | sleep MS
 *   copyalloc PATH SIZE UNLINK (through a private copy of the driver at PATH)
 *   stress THREADS ITERS SIZE (threads on this thread's context, alloc+free)
 *   exit CODE | crash | hang | exec
 * exit, crash, hang and exec answer before they act (`ok exit=CODE`,
 * `ok crash=1`, `ok hang=1`, `ok exec=1`), so a driver always gets one line
 * per command. exec replaces the process image with a fresh cudaprog (same
 * pid, environment, stdin and stdout; nothing of the old image's CUDA state
 * survives); `thread exec` does it from a thread that is not the leader.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type;
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
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct CUlaunchAttribute_st CUlaunchAttribute;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxGetCurrent(CUcontext *);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                     unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct { size_t Width, Height; int Format; unsigned int NumChannels; } CUDA_ARRAY_DESCRIPTOR;
typedef struct {
    size_t Width, Height, Depth;
    int Format;
    unsigned int NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR;
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int);
CUresult cuArrayDestroy(CUarray);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray);
typedef struct CUmod_st *CUmodule;
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleUnload(CUmodule);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchCooperativeKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, unsigned, CUstream, void **);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuCtxSynchronize(void);
CUresult cuCtxSynchronize_v2(CUcontext);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

enum { A_FREE = 0, A_PTR, A_ASYNC, A_HANDLE, A_VMM, A_ARRAY, A_MIPMAP, A_MODULE };

struct slot {
    int kind;
    CUdeviceptr ptr;
    CUmemGenericAllocationHandle handle;
    size_t size;
};

static struct slot *g_slots;
static int g_nslots, g_capslots;
static pthread_mutex_t g_slots_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext g_last_ctx;
static int g_quiet;
static char g_dummy_kernel[16];

static int new_slot(int kind, CUdeviceptr ptr, CUmemGenericAllocationHandle h, size_t size)
{
    pthread_mutex_lock(&g_slots_lock);
    if (g_nslots == g_capslots) {
        int cap = g_capslots ? g_capslots * 2 : 64;
        struct slot *s = realloc(g_slots, (size_t)cap * sizeof(*s));
        if (!s) {
            pthread_mutex_unlock(&g_slots_lock);
            return -1;
        }
        g_slots = s;
        g_capslots = cap;
    }
    int id = g_nslots++;
    g_slots[id] = (struct slot){kind, ptr, h, size};
    pthread_mutex_unlock(&g_slots_lock);
    return id;
}

static int parse_size(const char *s, unsigned long long *out)
{
    if (!s || !*s)
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s)
        return -1;
    int shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    case 't': case 'T': shift = 40; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'B' || *end == 'b')
        end++;
    if (*end == 'B')
        end++;
    if (*end)
        return -1;
    if (shift && v > (~0ULL >> shift))
        return -1;
    *out = v << shift;
    return 0;
}

static int parse_int(const char *s, long long *out)
{
    if (!s || !*s)
        return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 0);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

/* one answer line: written with a single write(2) so threads never interleave */
static void reply(const char *fmt, ...)
{
    if (g_quiet)
        return;
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if (n > (int)sizeof(buf) - 2)
        n = (int)sizeof(buf) - 2;
    buf[n++] = '\n';
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(1, p, (size_t)n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        p += w;
        n -= (int)w;
    }
}

#define MAXARGS 16

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec / 1e9;
}

/* bench KIND GRID SECONDS SETTLE_MS [WINDOW_MS]: launch (KIND launch|graph,
 * GRID blocks) in windows of WINDOW_MS (250), synchronizing at each window's end, as
 * bench/gpu/sm_workload.py does on the GPU; reply with the mean launch rate
 * over the windows that start after SETTLE_MS, the slowest such window, the
 * launches over the time of those windows, and every window's rate. */
static void do_bench(const char *kind, long long grid, long long seconds, long long settle_ms,
                     long long window_ms)
{
    CUfunction f = (CUfunction)g_dummy_kernel;
    int graph = !strcmp(kind, "graph");
    double t_start = now_s(), sum = 0, mn = -1, n_after = 0, t_after = 0;
    int counted = 0, nw = 0;
    char buf[4096];
    size_t off = 0;
    buf[0] = 0;
    CUresult rc = 0;
    while (!rc && now_s() - t_start < seconds) {
        double t0 = now_s(), t1;
        long long n = 0;
        while (!rc && (t1 = now_s()) - t0 < window_ms / 1000.0) {
            rc = graph ? cuGraphLaunch((CUgraphExec)g_dummy_kernel, NULL)
                       : cuLaunchKernel(f, (unsigned)grid, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
            n++;
        }
        if (!rc)
            rc = cuCtxSynchronize_v2(NULL);  /* as torch.cuda.synchronize() does */
        t1 = now_s();
        double r = n / (t1 - t0);
        if (off < sizeof(buf) - 32)
            off += snprintf(buf + off, sizeof(buf) - off, "%s%.0f", nw ? "," : "", r);
        nw++;
        if ((t0 - t_start) * 1000 >= settle_ms) {
            sum += r;
            counted++;
            n_after += n;
            t_after += t1 - t0;
            if (mn < 0 || r < mn)
                mn = r;
        }
    }
    /* overall: launches over time after SETTLE_MS, where windows differ in length */
    reply("ok rc=%d steady=%.1f min=%.1f overall=%.1f windows=%s", rc, counted ? sum / counted : 0.0,
          mn < 0 ? 0.0 : mn, t_after > 0 ? n_after / t_after : 0.0, buf);
}

static void run_command(char *line);

struct thread_arg { char *line; };

static void *thread_main(void *p)
{
    struct thread_arg *a = p;
    run_command(a->line);
    return NULL;
}

struct stress_arg {
    CUcontext ctx;
    long long iters;
    unsigned long long size;
    CUresult rc;
    long long done;
};

static void *stress_main(void *p)
{
    struct stress_arg *a = p;
    a->rc = cuCtxSetCurrent(a->ctx);
    for (a->done = 0; !a->rc && a->done < a->iters; a->done++) {
        CUdeviceptr ptr;
        a->rc = cuMemAlloc_v2(&ptr, a->size);
        if (!a->rc)
            a->rc = cuMemFree_v2(ptr);
    }
    return NULL;
}

static void do_launches(const char *what, long long n)
{
    CUresult rc = 0;
    long long done = 0;
    CUfunction f = (CUfunction)g_dummy_kernel;
    CUlaunchConfig cfg = {1, 1, 1, 32, 1, 1, 0, NULL, NULL, 0};
    for (; done < n; done++) {
        if (what[0] == 'l' && what[6] == 0)
            rc = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
        else if (what[0] == 'l')
            rc = cuLaunchKernelEx(&cfg, f, NULL, NULL);
        else if (what[0] == 'c')
            rc = cuLaunchCooperativeKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL);
        else
            rc = cuGraphLaunch((CUgraphExec)g_dummy_kernel, NULL);
        if (rc)
            break;
    }
    reply("ok rc=%d n=%lld", rc, done);
}

static void run_command(char *line)
{
    char *argv[MAXARGS + 1];
    int argc = 0;
    char *save = NULL;
    char *copy = strdup(line); /* for `thread`, which passes the rest on */
    for (char *t = strtok_r(line, " \t\r\n", &save); t && argc < MAXARGS;
         t = strtok_r(NULL, " \t\r\n", &save))
        argv[argc++] = t;
    argv[argc] = NULL;
    if (argc == 0 || argv[0][0] == '#') {
        free(copy);
        return;
    }
    const char *c = argv[0];
    unsigned long long sz = 0;
    long long n = 0, m = 0;
    CUresult rc;
    CUdeviceptr ptr = 0;

#define NEED(k, usage)                                       \
    do {                                                     \
        if (argc != (k) + 1) {                               \
            reply("err usage: %s", usage);                   \
            goto out;                                        \
        }                                                    \
    } while (0)
#define SIZE_ARG(i, usage)                                   \
    do {                                                     \
        if (parse_size(argv[i], &sz)) {                      \
            reply("err usage: %s", usage);                   \
            goto out;                                        \
        }                                                    \
    } while (0)
#define INT_ARG(i, var, usage)                               \
    do {                                                     \
        if (parse_int(argv[i], &var)) {                      \
            reply("err usage: %s", usage);                   \
            goto out;                                        \
        }                                                    \
    } while (0)

    if (!strcmp(c, "init")) {
        NEED(0, "init");
        reply("ok rc=%d", cuInit(0));
    } else if (!strcmp(c, "pid")) {
        NEED(0, "pid");
        reply("ok pid=%d tid=%ld", (int)getpid(), (long)syscall(SYS_gettid));
    } else if (!strcmp(c, "device")) {
        NEED(1, "device N");
        INT_ARG(1, n, "device N");
        CUcontext ctx = NULL;
        rc = cuDevicePrimaryCtxRetain(&ctx, (int)n);
        if (!rc)
            rc = cuCtxSetCurrent(ctx);
        reply("ok rc=%d", rc);
    } else if (!strcmp(c, "ctxcreate")) {
        NEED(1, "ctxcreate N");
        INT_ARG(1, n, "ctxcreate N");
        CUcontext ctx = NULL;
        rc = cuCtxCreate_v2(&ctx, 0, (int)n);
        if (!rc)
            g_last_ctx = ctx;
        reply("ok rc=%d", rc);
    } else if (!strcmp(c, "ctxpush")) {
        NEED(0, "ctxpush");
        reply("ok rc=%d", cuCtxPushCurrent_v2(g_last_ctx));
    } else if (!strcmp(c, "ctxpop")) {
        NEED(0, "ctxpop");
        CUcontext ctx = NULL;
        reply("ok rc=%d", cuCtxPopCurrent_v2(&ctx));
    } else if (!strcmp(c, "ctxdestroy")) {
        NEED(0, "ctxdestroy");
        rc = cuCtxDestroy_v2(g_last_ctx);
        if (!rc)
            g_last_ctx = NULL;
        reply("ok rc=%d", rc);
    } else if (!strcmp(c, "alloc") || !strcmp(c, "allocmanaged") || !strcmp(c, "allocasync") ||
               !strcmp(c, "allocpool") || !strcmp(c, "procalloc")) {
        NEED(1, "alloc SIZE");
        SIZE_ARG(1, "alloc SIZE");
        int kind = A_PTR;
        if (!strcmp(c, "alloc")) {
            rc = cuMemAlloc_v2(&ptr, sz);
        } else if (!strcmp(c, "allocmanaged")) {
            rc = cuMemAllocManaged(&ptr, sz, 1);
        } else if (!strcmp(c, "allocasync")) {
            rc = cuMemAllocAsync(&ptr, sz, NULL);
            kind = A_ASYNC;
        } else if (!strcmp(c, "allocpool")) {
            rc = cuMemAllocFromPoolAsync(&ptr, sz, NULL, NULL);
            kind = A_ASYNC;
        } else { /* the way cudart gets at the driver: through cuGetProcAddress */
            CUresult (*fn)(CUdeviceptr *, size_t) = NULL;
            int st = 0;
            rc = cuGetProcAddress_v2("cuMemAlloc", (void **)&fn, 12000, 0, &st);
            if (!rc)
                rc = fn(&ptr, sz);
        }
        int id = rc ? -1 : new_slot(kind, ptr, 0, sz);
        reply("ok rc=%d id=%d ptr=0x%llx", rc, id, rc ? 0ULL : ptr);
    } else if (!strcmp(c, "copyalloc")) {
        /* A private copy of the driver library, as a process may load one:
         * dlopen PATH (then unlink it if UNLINK is 1), and through it alone
         * cuInit, device 0's primary context and one allocation of SIZE. */
        NEED(3, "copyalloc PATH SIZE UNLINK");
        SIZE_ARG(2, "copyalloc PATH SIZE UNLINK");
        void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            reply("err dlopen %s: %s", argv[1], dlerror());
            goto out;
        }
        if (!strcmp(argv[3], "1") && unlink(argv[1])) {
            reply("err unlink %s: %s", argv[1], strerror(errno));
            goto out;
        }
        CUresult (*init)(unsigned) = (CUresult (*)(unsigned))dlsym(h, "cuInit");
        CUresult (*retain)(CUcontext *, CUdevice) =
            (CUresult (*)(CUcontext *, CUdevice))dlsym(h, "cuDevicePrimaryCtxRetain");
        CUresult (*setcur)(CUcontext) = (CUresult (*)(CUcontext))dlsym(h, "cuCtxSetCurrent");
        CUresult (*alloc)(CUdeviceptr *, size_t) =
            (CUresult (*)(CUdeviceptr *, size_t))dlsym(h, "cuMemAlloc_v2");
        if (!init || !retain || !setcur || !alloc) {
            reply("err %s lacks the driver API", argv[1]);
            goto out;
        }
        CUcontext ctx = NULL;
        rc = init(0);
        if (!rc)
            rc = retain(&ctx, 0);
        if (!rc)
            rc = setcur(ctx);
        if (!rc)
            rc = alloc(&ptr, sz);
        reply("ok rc=%d ptr=0x%llx", rc, rc ? 0ULL : ptr);
    } else if (!strcmp(c, "allocpitch")) {
        NEED(3, "allocpitch W H ELEM");
        unsigned long long w, h;
        SIZE_ARG(1, "allocpitch W H ELEM");
        w = sz;
        SIZE_ARG(2, "allocpitch W H ELEM");
        h = sz;
        INT_ARG(3, n, "allocpitch W H ELEM");
        size_t pitch = 0;
        rc = cuMemAllocPitch_v2(&ptr, &pitch, w, h, (unsigned)n);
        int id = rc ? -1 : new_slot(A_PTR, ptr, 0, pitch * h);
        reply("ok rc=%d id=%d ptr=0x%llx pitch=%zu", rc, id, rc ? 0ULL : ptr, pitch);
    } else if (!strcmp(c, "module")) {
        /* module SIZE: a module whose static globals take SIZE bytes of device
         * memory when it loads (the stand-in's image format) */
        NEED(1, "module SIZE");
        SIZE_ARG(1, "module SIZE");
        char image[64];
        snprintf(image, sizeof(image), "fakecuda-module globals=%llu", (unsigned long long)sz);
        CUmodule m = NULL;
        rc = cuModuleLoadData(&m, image);
        int id = rc ? -1 : new_slot(A_MODULE, 0, (CUmemGenericAllocationHandle)(uintptr_t)m, sz);
        reply("ok rc=%d id=%d handle=0x%llx", rc, id, rc ? 0ULL : (unsigned long long)(uintptr_t)m);
    } else if (!strcmp(c, "array") || !strcmp(c, "array3d") || !strcmp(c, "mipmap")) {
        /* array W H FORMAT CHANNELS | array3d W H D FORMAT CHANNELS FLAGS |
         * mipmap W H D FORMAT CHANNELS FLAGS LEVELS (dimensions in elements) */
        int is2d = !strcmp(c, "array"), mip = !strcmp(c, "mipmap");
        const char *usage = is2d ? "array W H FORMAT CHANNELS"
                            : mip ? "mipmap W H D FORMAT CHANNELS FLAGS LEVELS"
                                  : "array3d W H D FORMAT CHANNELS FLAGS";
        NEED(is2d ? 4 : mip ? 7 : 6, usage);
        long long v[7] = {0};
        for (int i = 1; i < argc; i++)
            INT_ARG(i, v[i - 1], usage);
        void *h = NULL;
        if (is2d) {
            CUDA_ARRAY_DESCRIPTOR d = {(size_t)v[0], (size_t)v[1], (int)v[2], (unsigned)v[3]};
            rc = cuArrayCreate_v2((CUarray *)&h, &d);
        } else {
            CUDA_ARRAY3D_DESCRIPTOR d = {(size_t)v[0], (size_t)v[1], (size_t)v[2], (int)v[3],
                                         (unsigned)v[4], (unsigned)v[5]};
            rc = mip ? cuMipmappedArrayCreate((CUmipmappedArray *)&h, &d, (unsigned)v[6])
                     : cuArray3DCreate_v2((CUarray *)&h, &d);
        }
        int id = rc ? -1 : new_slot(mip ? A_MIPMAP : A_ARRAY, 0,
                                    (CUmemGenericAllocationHandle)(uintptr_t)h, 0);
        reply("ok rc=%d id=%d handle=0x%llx", rc, id,
              rc ? 0ULL : (unsigned long long)(uintptr_t)h);
    } else if (!strcmp(c, "create") || !strcmp(c, "vmm")) {
        NEED(2, "create SIZE DEV");
        SIZE_ARG(1, "create SIZE DEV");
        INT_ARG(2, n, "create SIZE DEV");
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof(prop));
        prop.type = 1;              /* CU_MEM_ALLOCATION_TYPE_PINNED */
        prop.location.type = 1;     /* CU_MEM_LOCATION_TYPE_DEVICE */
        prop.location.id = (int)n;
        CUmemGenericAllocationHandle h = 0;
        rc = cuMemCreate(&h, sz, &prop, 0);
        if (rc || !strcmp(c, "create")) {
            int id = rc ? -1 : new_slot(A_HANDLE, 0, h, sz);
            reply("ok rc=%d id=%d handle=0x%llx", rc, id, rc ? 0ULL : h);
            goto out;
        }
        /* vmm: reserve, map and grant access, like PyTorch's expandable segments */
        rc = cuMemAddressReserve(&ptr, sz, 0, 0, 0);
        if (!rc)
            rc = cuMemMap(ptr, sz, 0, h, 0);
        if (!rc) {
            CUmemAccessDesc d = {{1, (int)n}, 3 /* READWRITE */};
            rc = cuMemSetAccess(ptr, sz, &d, 1);
        }
        if (rc) {
            cuMemRelease(h);
            reply("ok rc=%d id=-1 handle=0x0 ptr=0x0", rc);
            goto out;
        }
        int id = new_slot(A_VMM, ptr, h, sz);
        reply("ok rc=%d id=%d handle=0x%llx ptr=0x%llx", rc, id, h, ptr);
    } else if (!strcmp(c, "free")) {
        NEED(1, "free ID");
        INT_ARG(1, n, "free ID");
        pthread_mutex_lock(&g_slots_lock);
        struct slot s = {0};
        if (n >= 0 && n < g_nslots)
            s = g_slots[n];
        pthread_mutex_unlock(&g_slots_lock);
        switch (s.kind) {
        case A_PTR: rc = cuMemFree_v2(s.ptr); break;
        case A_ASYNC: rc = cuMemFreeAsync(s.ptr, NULL); break;
        case A_HANDLE: rc = cuMemRelease(s.handle); break;
        case A_ARRAY: rc = cuArrayDestroy((CUarray)(uintptr_t)s.handle); break;
        case A_MIPMAP: rc = cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)s.handle); break;
        case A_MODULE: rc = cuModuleUnload((CUmodule)(uintptr_t)s.handle); break;
        case A_VMM:
            rc = cuMemUnmap(s.ptr, s.size);
            if (!rc)
                rc = cuMemAddressFree(s.ptr, s.size);
            if (!rc)
                rc = cuMemRelease(s.handle);
            break;
        default:
            reply("err no allocation with id %lld", n);
            goto out;
        }
        /* the slot keeps its kind: freeing twice asks the driver again */
        reply("ok rc=%d", rc);
    } else if (!strcmp(c, "meminfo")) {
        NEED(0, "meminfo");
        size_t fr = 0, tot = 0;
        rc = cuMemGetInfo_v2(&fr, &tot);
        reply("ok rc=%d free=%zu total=%zu", rc, fr, tot);
    } else if (!strcmp(c, "totalmem")) {
        NEED(1, "totalmem N");
        INT_ARG(1, n, "totalmem N");
        size_t tot = 0;
        rc = cuDeviceTotalMem_v2(&tot, (int)n);
        reply("ok rc=%d total=%zu", rc, tot);
    } else if (!strcmp(c, "nvmlmem") || !strcmp(c, "nvmlmem2")) {
        /* What nvidia-smi inside a container asks: NVML's memory info for
         * device N (the library is dlopen'ed, as tools do). */
        NEED(1, "nvmlmem N");
        INT_ARG(1, n, "nvmlmem N");
        void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        if (!h) {
            reply("err dlopen libnvidia-ml.so.1: %s", dlerror());
            return;
        }
        int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
        int (*get)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
        void *dev = NULL;
        if (!init || !get || init() != 0 || (rc = get((unsigned)n, &dev)) != 0) {
            reply("ok rc=%d", rc ? rc : 999);
            return;
        }
        if (!strcmp(c, "nvmlmem")) {
            struct { unsigned long long total, free, used; } m = {0};
            int (*mi)(void *, void *) = (int (*)(void *, void *))dlsym(h, "nvmlDeviceGetMemoryInfo");
            rc = mi(dev, &m);
            reply("ok rc=%d total=%llu free=%llu used=%llu", rc, m.total, m.free, m.used);
        } else {
            struct { unsigned version; unsigned long long total, reserved, free, used; } m = {0};
            m.version = (unsigned)(sizeof(m) | (2u << 24));
            int (*mi)(void *, void *) = (int (*)(void *, void *))dlsym(h, "nvmlDeviceGetMemoryInfo_v2");
            rc = mi(dev, &m);
            reply("ok rc=%d total=%llu free=%llu used=%llu", rc, m.total, m.free, m.used);
        }
    } else if (!strcmp(c, "launch") || !strcmp(c, "launchex") || !strcmp(c, "coop") ||
               !strcmp(c, "graph")) {
        NEED(1, "launch N");
        INT_ARG(1, n, "launch N");
        do_launches(c, n);
    } else if (!strcmp(c, "bench")) {
        if (argc != 5 && argc != 6) {
            reply("err usage: bench launch|graph GRID SECONDS SETTLE_MS [WINDOW_MS]");
            goto out;
        }
        long long grid = 0, secs = 0, settle = 0, window = 250;
        INT_ARG(2, grid, "bench launch|graph GRID SECONDS SETTLE_MS [WINDOW_MS]");
        INT_ARG(3, secs, "bench launch|graph GRID SECONDS SETTLE_MS [WINDOW_MS]");
        INT_ARG(4, settle, "bench launch|graph GRID SECONDS SETTLE_MS [WINDOW_MS]");
        if (argc > 5)
            INT_ARG(5, window, "bench launch|graph GRID SECONDS SETTLE_MS [WINDOW_MS]");
        if (window < 1)
            window = 1;
        do_bench(argv[1], grid, secs, settle, window);
    } else if (!strcmp(c, "sync")) {
        reply("ok rc=%d", cuCtxSynchronize());
    } else if (!strcmp(c, "getproc")) {
        if (argc != 2 && argc != 3) {
            reply("err usage: getproc NAME [FLAGS]");
            goto out;
        }
        if (argc == 3)
            INT_ARG(2, m, "getproc NAME [FLAGS]");
        void *fn = NULL;
        int st = -1;
        rc = cuGetProcAddress_v2(argv[1], &fn, 12000, (unsigned long long)m, &st);
        Dl_info info;
        const char *sym = "-";
        if (fn && dladdr(fn, &info) && info.dli_sname)
            sym = info.dli_sname;
        reply("ok rc=%d status=%d addr=%p sym=%s", rc, st, fn, sym);
    } else if (!strcmp(c, "thread")) {
        if (argc < 2) {
            reply("err usage: thread CMD ...");
            goto out;
        }
        /* the rest of the original line, after the word "thread" */
        char *rest = strstr(copy, "thread") + strlen("thread");
        struct thread_arg a = {rest};
        pthread_t t;
        if (pthread_create(&t, NULL, thread_main, &a)) {
            reply("err pthread_create failed");
            goto out;
        }
        pthread_join(t, NULL);
    } else if (!strcmp(c, "stress")) {
        NEED(3, "stress THREADS ITERS SIZE");
        INT_ARG(1, n, "stress THREADS ITERS SIZE");
        INT_ARG(2, m, "stress THREADS ITERS SIZE");
        SIZE_ARG(3, "stress THREADS ITERS SIZE");
        if (n < 1 || n > 256) {
            reply("err stress: 1..256 threads");
            goto out;
        }
        CUcontext ctx = NULL;
        cuCtxGetCurrent(&ctx);
        struct stress_arg args[256];
        pthread_t tids[256];
        int started = 0;
        for (int i = 0; i < n; i++) {
            args[i] = (struct stress_arg){ctx, m, sz, 0, 0};
            if (pthread_create(&tids[i], NULL, stress_main, &args[i]))
                break;
            started++;
        }
        CUresult first = started == n ? 0 : 999;
        long long total = 0;
        for (int i = 0; i < started; i++) {
            pthread_join(tids[i], NULL);
            total += args[i].done;
            if (!first && args[i].rc)
                first = args[i].rc;
        }
        reply("ok rc=%d n=%lld", first, total);
    } else if (!strcmp(c, "sleep")) {
        NEED(1, "sleep MS");
        INT_ARG(1, n, "sleep MS");
        struct timespec ts = {n / 1000, (n % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) && errno == EINTR)
            ;
        reply("ok slept=%lld", n);
    } else if (!strcmp(c, "exit")) {
        if (argc > 2) {
            reply("err usage: exit [CODE]");
            goto out;
        }
        if (argc == 2)
            INT_ARG(1, n, "exit CODE");
        reply("ok exit=%lld", n);
        exit((int)n);
    } else if (!strcmp(c, "exec")) {
        NEED(0, "exec");
        reply("ok exec=1");
        char *args[] = {"cudaprog", NULL};
        execv("/proc/self/exe", args);
        reply("err exec: %s", strerror(errno));
    } else if (!strcmp(c, "crash")) {
        NEED(0, "crash");
        reply("ok crash=1");
        *(volatile int *)(uintptr_t)0 = 1;
        abort();
    } else if (!strcmp(c, "hang")) {
        NEED(0, "hang");
        reply("ok hang=1");
        for (;;)
            pause();
    } else {
        reply("err unknown command: %s", c);
    }
out:
    free(copy);
}

static void usage(void)
{
    fprintf(stderr, "usage: cudaprog [-q] [-c 'cmd; cmd; ...']\n");
    exit(2);
}

int main(int argc, char **argv)
{
    const char *script = NULL;
    int opt;
    while ((opt = getopt(argc, argv, "qc:h")) != -1) {
        switch (opt) {
        case 'q': g_quiet = 1; break;
        case 'c': script = optarg; break;
        default: usage();
        }
    }
    if (optind != argc)
        usage();
    signal(SIGPIPE, SIG_IGN);
    if (script) {
        char *s = strdup(script);
        char *save = NULL;
        for (char *cmd = strtok_r(s, ";\n", &save); cmd; cmd = strtok_r(NULL, ";\n", &save))
            run_command(cmd);
        free(s);
        return 0;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0)
        run_command(line);
    free(line);
    return 0;
}
