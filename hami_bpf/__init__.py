"""hami-bpf: GPU sharing for CUDA processes, enforced from the kernel with eBPF."""
__version__ = "0.1.0"
