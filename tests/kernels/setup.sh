#!/bin/bash
# What `make test-kernels` needs besides `make install`: qemu (TCG or KVM),
# a static busybox for the guest's initramfs, and the tools that build it.
# Installs only what is missing; safe to run again.
set -euo pipefail
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
file -L /bin/busybox 2>/dev/null | grep -q "statically linked" || need+=(busybox-static)
command -v cpio >/dev/null || need+=(cpio)
command -v modinfo >/dev/null || need+=(kmod)
command -v xz >/dev/null || need+=(xz-utils)
command -v zstd >/dev/null || need+=(zstd)
command -v file >/dev/null || need+=(file)
command -v dpkg-deb >/dev/null || need+=(dpkg)
if [ ${#need[@]} -gt 0 ]; then
    echo "test-kernels: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
