#!/bin/bash
# Prepare a Debian 12 / Ubuntu host to run hami-bpf (`sudo make install`), or
# to test it too (`--test`, which `make test` uses).  Idempotent; run as root.
# Non-interactive.
#
#  1. Distribution packages: python3-bpfcc (bcc; the PyPI package named "bcc"
#     is an unrelated project), python3-venv, gcc/make/binutils (the stand-in
#     libcuda is compiled at run time), kernel headers; with --test also tmux
#     (terminal tests).
#  2. Kernel headers for bcc.  bcc compiles our BPF C at run time against
#     /lib/modules/$(uname -r)/build.  When the running kernel has no headers
#     package (custom or cloud kernels), we install the distribution's generic
#     headers and point build/ and source/ at them.  Those headers describe a
#     different kernel, so the layouts of kernel structs in them are wrong for
#     the running one: hami-bpf's BPF code therefore reads no kernel struct
#     fields, only generic types, helpers and tracepoint arguments (bcc builds
#     those from tracefs, which describes the running kernel).
#  3. tracefs at /sys/kernel/tracing (bcc attaches uprobes and tracepoints
#     through it) and securityfs (so the lockdown mode can be read).
#  4. A virtual environment at /opt/hami-bpf/venv on /usr/bin/python3 with
#     --system-site-packages (so the distribution's bcc imports), this checkout
#     installed editable (with --test: with its [test] extras), and
#     /usr/local/bin/hami-bpf.
#  5. With --containers (implies --test; `make test-containers`): podman and
#     mmdebstrap (the agent's image, deploy/build-image.sh) and, on a hybrid
#     cgroup host whose cgroup v2 hierarchy still holds controllers, those
#     controllers mounted as v1 hierarchies (podman's runtime, crun, refuses
#     to create containers otherwise: "cgroups in hybrid mode not supported,
#     drop all controllers from cgroupv2").
set -euo pipefail

TEST=0
CONTAINERS=0
case "${1:-}" in
  --test) TEST=1 ;;
  --containers) TEST=1; CONTAINERS=1 ;;
  "") ;;
  *) echo "usage: setup-host.sh [--test | --containers]" >&2; exit 2 ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HAMI_BPF_VENV:-/opt/hami-bpf/venv}"
export DEBIAN_FRONTEND=noninteractive

log() { echo "setup-host: $*"; }
die() { echo "setup-host: error: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (sudo make install)"
command -v apt-get >/dev/null || die "needs apt-get (Debian 12 or Ubuntu)"

. /etc/os-release
KREL="$(uname -r)"
ARCH="$(dpkg --print-architecture)"
case "${ID:-}" in
  ubuntu) GENERIC_HEADERS="linux-headers-generic" ;;
  *)      GENERIC_HEADERS="linux-headers-${ARCH}" ;;
esac

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

APT_UPDATED=0
apt_update_once() {
  if [ "$APT_UPDATED" -eq 0 ]; then
    log "apt-get update"
    apt-get update -q >/dev/null
    APT_UPDATED=1
  fi
}
apt_install() {
  local missing=() p
  for p in "$@"; do installed "$p" || missing+=("$p"); done
  [ "${#missing[@]}" -eq 0 ] && return 0
  apt_update_once
  log "apt-get install ${missing[*]}"
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

# -- 1. packages -----------------------------------------------------------
apt_install python3-bpfcc python3-venv gcc make binutils libc6-dev
[ "$TEST" -eq 0 ] || apt_install tmux
[ "$CONTAINERS" -eq 0 ] || apt_install podman mmdebstrap

# -- 2. kernel headers -----------------------------------------------------
MODDIR="/lib/modules/${KREL}"
if [ -e "${MODDIR}/build/Makefile" ]; then
  log "kernel headers: ${MODDIR}/build -> $(readlink -f "${MODDIR}/build")"
else
  exact="linux-headers-${KREL}"
  if installed "$exact"; then
    :
  else
    apt_update_once
    if apt-cache show "$exact" >/dev/null 2>&1; then
      apt_install "$exact"
    fi
  fi
  if [ ! -e "${MODDIR}/build/Makefile" ]; then
    # No headers for this exact kernel: use the distribution's generic ones
    # (see the comment at the top for why mismatched headers are acceptable).
    apt_install "$GENERIC_HEADERS"
    # the newest installed -<flavour> tree and its -common sibling
    if [ "${ID:-}" = ubuntu ]; then
      build_dir="$(ls -d /usr/src/linux-headers-*-generic 2>/dev/null | sort -V | tail -n1)"
      source_dir="${build_dir%-generic}"
    else
      build_dir="$(ls -d /usr/src/linux-headers-*-"${ARCH}" 2>/dev/null | sort -V | tail -n1)"
      source_dir="${build_dir%-${ARCH}}-common"
    fi
    [ -n "$build_dir" ] && [ -d "$build_dir" ] || die "no kernel header tree under /usr/src after installing ${GENERIC_HEADERS}"
    [ -d "$source_dir" ] || source_dir="$build_dir"
    mkdir -p "$MODDIR"
    ln -sfn "$build_dir" "${MODDIR}/build"
    ln -sfn "$source_dir" "${MODDIR}/source"
    log "kernel headers: linked ${MODDIR}/build -> ${build_dir}, source -> ${source_dir} (headers of another kernel; see docs/install.md)"
  fi
fi

# -- 3. tracefs, securityfs ------------------------------------------------
if ! grep -qs " /sys/kernel/tracing tracefs " /proc/self/mounts; then
  mkdir -p /sys/kernel/tracing 2>/dev/null || true
  mount -t tracefs nodev /sys/kernel/tracing && log "mounted tracefs at /sys/kernel/tracing"
fi
if [ -d /sys/kernel/security ] && ! grep -qs " /sys/kernel/security securityfs " /proc/self/mounts; then
  mount -t securityfs securityfs /sys/kernel/security 2>/dev/null \
    && log "mounted securityfs at /sys/kernel/security" || true
fi

# -- 3b. cgroups for podman on hybrid hosts (--containers) -------------------
if [ "$CONTAINERS" -eq 1 ] && grep -qs " /sys/fs/cgroup/unified cgroup2 " /proc/self/mounts; then
  for c in $(cat /sys/fs/cgroup/unified/cgroup.controllers 2>/dev/null); do
    [ -s /sys/fs/cgroup/unified/cgroup.subtree_control ] \
      && die "cgroup v2 hierarchy uses controller $c: cannot move it to v1 for podman"
    mkdir -p "/sys/fs/cgroup/$c"
    mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c" \
      && log "mounted the $c controller as a cgroup v1 hierarchy (podman on a hybrid host)"
  done
fi

# -- 4. virtual environment -----------------------------------------------
if [ ! -x "${VENV}/bin/python" ]; then
  log "creating ${VENV}"
  mkdir -p "$(dirname "$VENV")"
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
# Reinstall when the checkout, its dependencies or the extras change (the
# editable install points at one checkout; a fresh clone must take it over).
# An install with the test extras also satisfies a plain one.
STAMP="${VENV}/.hami-bpf-installed"
stamp_for() { printf '%s\n%s\n' "$REPO" "$1" | cat - "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1; }
want_test="$(stamp_for test)"
if [ "$TEST" -eq 1 ]; then want="$want_test"; target="${REPO}[test]"; else want="$(stamp_for run)"; target="${REPO}"; fi
have="$(cat "$STAMP" 2>/dev/null || true)"
if { [ "$have" != "$want" ] && [ "$have" != "$want_test" ]; } \
   || ! (cd / && "${VENV}/bin/python" -c "import hami_bpf, sys; sys.exit(0 if hami_bpf.__file__.startswith('${REPO}/') else 1)") 2>/dev/null; then
  log "pip install -e ${target}"
  "${VENV}/bin/python" -m pip install -q --disable-pip-version-check -e "${target}"
  echo "$want" > "$STAMP"
fi
"${VENV}/bin/python" -c "import bcc" 2>/dev/null \
  || die "bcc does not import in ${VENV} (python3-bpfcc installed for another python?)"
if [ "$VENV" = /opt/hami-bpf/venv ]; then  # another venv (tests of this script) leaves it alone
  ln -sfn "${VENV}/bin/hami-bpf" /usr/local/bin/hami-bpf
fi
log "ready: venv ${VENV}, $(readlink /usr/local/bin/hami-bpf >/dev/null && echo /usr/local/bin/hami-bpf -\> "$(readlink /usr/local/bin/hami-bpf)")"
