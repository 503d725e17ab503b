/*
 * A stand-in for libnvidia-ml.so.1: just what an nvidia-smi-style memory
 * query inside a workload calls. Every device reports FAKECUDA_TOTAL_MEM
 * (default 16 GiB) total, all of it free. Entries begin with push %rbp like
 * the stand-in libcuda (see libcuda.c), so the probes treat them the same.
 */
#include <stdlib.h>

#define ENTRY() __asm__ volatile("" : : "r"(__builtin_frame_address(0)) : "memory")
#define EXPORT __attribute__((visibility("default"), noinline))

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct fake_dev { int index; } *nvmlDevice_t;

static struct fake_dev g_devs[16];

static int ndev(void)
{
	const char *s = getenv("FAKECUDA_DEVICES");
	int n = s ? atoi(s) : 2;
	return n < 1 ? 1 : n > 16 ? 16 : n;
}

static unsigned long long total_mem(void)
{
	const char *s = getenv("FAKECUDA_TOTAL_MEM");
	return s ? strtoull(s, NULL, 0) : (16ULL << 30);
}

EXPORT int nvmlInit_v2(void) { ENTRY(); return 0; }
EXPORT int nvmlInit(void) { ENTRY(); return 0; }
EXPORT int nvmlShutdown(void) { ENTRY(); return 0; }

EXPORT int nvmlDeviceGetCount_v2(unsigned int *n)
{
	ENTRY();
	*n = ndev();
	return 0;
}

EXPORT int nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *dev)
{
	ENTRY();
	if ((int)i >= ndev() || !dev)
		return 2; /* NVML_ERROR_INVALID_ARGUMENT */
	g_devs[i].index = i;
	*dev = &g_devs[i];
	return 0;
}

EXPORT int nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *dev)
{
	ENTRY();
	return nvmlDeviceGetHandleByIndex_v2(i, dev);
}

EXPORT int nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m)
{
	ENTRY();
	if (!dev || !m)
		return 2;
	m->total = total_mem();
	m->used = 0;
	m->free = m->total;
	return 0;
}

EXPORT int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m)
{
	ENTRY();
	if (!dev || !m)
		return 2;
	m->total = total_mem();
	m->reserved = 0;
	m->used = 0;
	m->free = m->total;
	return 0;
}
