#!/bin/busybox sh
# /init of the guest's initramfs (tests/kernels/run_matrix.py builds it).
#
# Loads the modules listed in /modules.order (9p, overlay, virtio, in
# dependency order), mounts the host's root file system (shared read-only by
# qemu as 9p tag `hostroot`) under an overlay whose writes go to a tmpfs,
# mounts the writable result folder (tag `hamiout`) at /hami-out, and hands
# over to the checkout's tests/kernels/guest.sh (arguments: the repository
# path and the virtual environment, from `hami.repo=` and `hami.venv=` on the
# kernel command line).
#
# `hami.probe=1` on the command line: print a marker and power off at once
# (run_matrix.py uses it to find out whether KVM boots this kernel).
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /newroot /lower /rw
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null

off() { echo o > /proc/sysrq-trigger; sleep 10; }
fail() { echo "HAMI-GUEST-FAIL: $*"; off; }

for arg in $(cat /proc/cmdline); do
    case "$arg" in
        hami.repo=*) REPO="${arg#hami.repo=}" ;;
        hami.venv=*) VENV="${arg#hami.venv=}" ;;
        hami.probe=1) PROBE=1 ;;
    esac
done
echo "HAMI-GUEST-BOOTED $(uname -r)"
[ -n "$PROBE" ] && off

while read -r m; do
    [ -n "$m" ] || continue
    insmod "/modules/$m" || echo "init: insmod $m failed"
done < /modules.order

mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /lower \
    || fail "mounting the host's root over 9p"
mount -t tmpfs -o size=75% tmpfs /rw || fail "tmpfs"
mkdir -p /rw/upper /rw/work
if ! mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot; then
    fail "overlay of 9p root and tmpfs"
fi
mkdir -p /newroot/hami-out
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 hamiout /newroot/hami-out \
    || fail "mounting the result folder"
[ -n "$REPO" ] || fail "no hami.repo= on the kernel command line"
exec switch_root /newroot /bin/bash "$REPO/tests/kernels/guest.sh" "$REPO" "$VENV"
fail "switch_root"
