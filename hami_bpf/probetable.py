"""Which libcuda and NVML symbols get which BPF program (names only: no bcc)."""
from __future__ import annotations

# symbol -> (entry program, return program or None). Twins share programs.
CORE_PROBES: dict[str, tuple[str, str | None]] = {
    "cuInit": ("uprobe__cuInit", None),
    "cuDevicePrimaryCtxRetain": ("uprobe__cuDevicePrimaryCtxRetain", "uretprobe__ctx_return"),
    "cuCtxCreate_v2": ("uprobe__cuCtxCreate_v2", "uretprobe__ctx_return"),
    "cuCtxCreate_v3": ("uprobe__cuCtxCreate_v3", "uretprobe__ctx_return"),
    "cuCtxCreate_v4": ("uprobe__cuCtxCreate_v4", "uretprobe__ctx_return"),
    "cuCtxSetCurrent": ("uprobe__cuCtxSetCurrent", None),
    "cuCtxPushCurrent_v2": ("uprobe__cuCtxPushCurrent_v2", None),
    "cuCtxPopCurrent_v2": ("uprobe__cuCtxPopCurrent_v2", None),
    "cuCtxDestroy_v2": ("uprobe__cuCtxDestroy_v2", None),
    "cuMemAlloc_v2": ("uprobe__cuMemAlloc_v2", "uretprobe__alloc_return"),
    "cuMemAllocManaged": ("uprobe__cuMemAlloc_v2", "uretprobe__alloc_return"),
    "cuMemAllocAsync": ("uprobe__cuMemAlloc_v2", "uretprobe__alloc_return"),
    "cuMemAllocAsync_ptsz": ("uprobe__cuMemAlloc_v2", "uretprobe__alloc_return"),
    "cuMemAllocFromPoolAsync": ("uprobe__cuMemAlloc_v2", "uretprobe__alloc_return"),
    "cuMemAllocFromPoolAsync_ptsz": ("uprobe__cuMemAlloc_v2", "uretprobe__alloc_return"),
    "cuMemAllocPitch_v2": ("uprobe__cuMemAllocPitch_v2", "uretprobe__alloc_return"),
    "cuMemCreate": ("uprobe__cuMemCreate", "uretprobe__alloc_return"),
    "cuMemFree_v2": ("uprobe__cuMemFree_v2", None),
    "cuMemFreeAsync": ("uprobe__cuMemFree_v2", None),
    "cuMemFreeAsync_ptsz": ("uprobe__cuMemFree_v2", None),
    "cuMemRelease": ("uprobe__cuMemRelease", None),
    "cuArrayCreate_v2": ("uprobe__cuArrayCreate_v2", "uretprobe__alloc_return"),
    "cuArray3DCreate_v2": ("uprobe__cuArray3DCreate_v2", "uretprobe__alloc_return"),
    "cuMipmappedArrayCreate": ("uprobe__cuMipmappedArrayCreate", "uretprobe__alloc_return"),
    "cuArrayDestroy": ("uprobe__cuArrayDestroy", None),
    "cuMipmappedArrayDestroy": ("uprobe__cuArrayDestroy", None),
    "cuMemGetInfo_v2": ("uprobe__cuMemGetInfo_v2", "uretprobe__meminfo_return"),
    "cuDeviceTotalMem_v2": ("uprobe__cuDeviceTotalMem_v2", "uretprobe__meminfo_return"),
}

# libnvidia-ml (a separate library): what nvidia-smi-style queries call.
NVML_PROBES: dict[str, tuple[str, str | None]] = {
    "nvmlDeviceGetHandleByIndex_v2": ("uprobe__nvmlDeviceGetHandleByIndex", "uretprobe__nvml_handle_return"),
    "nvmlDeviceGetHandleByIndex": ("uprobe__nvmlDeviceGetHandleByIndex", "uretprobe__nvml_handle_return"),
    "nvmlDeviceGetMemoryInfo": ("uprobe__nvmlDeviceGetMemoryInfo", "uretprobe__meminfo_return"),
    "nvmlDeviceGetMemoryInfo_v2": ("uprobe__nvmlDeviceGetMemoryInfo_v2", "uretprobe__meminfo_return"),
}


# Entry points whose denial is undone by stop-and-rewrite (their uprobe runs admission).
ALLOC_SYMBOLS = tuple(s for s, (_, ret) in CORE_PROBES.items() if ret == "uretprobe__alloc_return")

# Launch entry points -> the program that charges them (attached only on demand).
LAUNCH_PROBES: dict[str, str] = {
    "cuLaunchKernel": "uprobe__cuLaunchKernel",
    "cuLaunchKernel_ptsz": "uprobe__cuLaunchKernel",
    "cuLaunchCooperativeKernel": "uprobe__cuLaunchKernel",
    "cuLaunchCooperativeKernel_ptsz": "uprobe__cuLaunchKernel",
    "cuLaunchKernelEx": "uprobe__cuLaunchKernelEx",
    "cuLaunchKernelEx_ptsz": "uprobe__cuLaunchKernelEx",
    "cuGraphLaunch": "uprobe__cuGraphLaunch",
    "cuGraphLaunch_ptsz": "uprobe__cuGraphLaunch",
}
LAUNCH_SYMBOLS = tuple(LAUNCH_PROBES)

# Synchronize calls: their returns tell the controller what the GPU finished.
# Attached and detached with the launch probes. PyTorch 2.11 on driver 580:
# torch.cuda.synchronize() -> cuCtxSynchronize_v2, .item() -> cuStreamSynchronize,
# Event.synchronize() -> cuEventSynchronize (bench/gpu/which_calls.py).
SYNC_SYMBOLS = ("cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize",
                "cuCtxSynchronize_v2", "cuEventSynchronize")
