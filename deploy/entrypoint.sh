#!/bin/sh
# hami-bpf container entrypoint: give bcc kernel headers for the node's
# kernel, check tracefs, then exec `hami-bpf "$@"`.  See deploy/Containerfile
# for the order in which headers are chosen and why.
set -eu

KREL="$(uname -r)"
HOST="${HAMI_BPF_HOST_ROOT:-/host}"
MOD="/lib/modules/${KREL}"        # an emptyDir in the DaemonSet (writable)
log() { echo "hami-bpf-entrypoint: $*" >&2; }

# Resolve a symlink found in the host's tree against the host's root.
host_target() {
    t="$(readlink "$1" 2>/dev/null)" || return 1
    case "$t" in
        /*) echo "${HOST}${t}" ;;
        *)  echo "$(dirname "$1")/${t}" ;;
    esac
}

mkdir -p "$MOD"
if [ -e "${MOD}/build/Makefile" ]; then
    log "kernel headers: ${MOD}/build (already present)"
elif b="$(host_target "${HOST}${MOD}/build")" && [ -e "${b}/Makefile" ]; then
    ln -sfn "$b" "${MOD}/build"
    if s="$(host_target "${HOST}${MOD}/source")" && [ -d "$s" ]; then
        ln -sfn "$s" "${MOD}/source"
    fi
    log "kernel headers: the node's, ${b}"
elif [ -e /sys/kernel/kheaders.tar.xz ]; then
    log "kernel headers: /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS)"
else
    . /etc/hami-bpf-headers
    ln -sfn "$GENERIC_BUILD" "${MOD}/build"
    ln -sfn "$GENERIC_SOURCE" "${MOD}/source"
    log "kernel headers: none for ${KREL} on the node; using the image's generic" \
        "${GENERIC_BUILD} (the BPF programs read no kernel struct, so this is safe)"
fi

if [ ! -d /sys/kernel/tracing/events ] && [ ! -d /sys/kernel/debug/tracing/events ]; then
    log "tracefs is not mounted at /sys/kernel/tracing on the node (hostPath);" \
        "mount it there (mount -t tracefs nodev /sys/kernel/tracing) or grant CAP_SYS_ADMIN"
fi

exec /usr/local/bin/hami-bpf "$@"
