#!/bin/bash
# Build the hami-bpf node agent image with podman, without any image registry.
#
#   bash deploy/build-image.sh [TAG]        (as root; TAG default: the version)
#
#  1. Base: a Debian 12 root filesystem made by mmdebstrap from Debian's own
#     packages (the mirrors in /etc/apt, or HAMI_BPF_MIRROR), holding what the
#     agent needs from the distribution: python3, python3-venv, bcc
#     (python3-bpfcc) and Debian's generic kernel headers (the entrypoint's
#     last resort, deploy/Containerfile).  Cached as a tarball under
#     /var/cache/hami-bpf/image/ keyed by the package list and the suite, and
#     imported as localhost/hami-bpf-base:bookworm.
#  2. Wheels: hami-bpf and its Python dependencies (click, rich, nvidia-ml-py,
#     prometheus-client) as wheels in build/image/wheels (the build context),
#     made with the host's pip; the dependencies are cached under
#     /var/cache/hami-bpf/image/wheels.
#  3. `podman build -f deploy/Containerfile`: no network (--network none):
#     everything comes from steps 1 and 2.
#
# Needs: podman, mmdebstrap (apt-get install podman mmdebstrap; `make
# install-test` installs them), python3 with pip (the project's venv).
# Environment: HAMI_BPF_IMAGE (default localhost/hami-bpf), HAMI_BPF_VENV
# (the pip to use, default /opt/hami-bpf/venv), HAMI_BPF_IMAGE_CACHE.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -n1)"
TAG="${1:-$VERSION}"
IMAGE="${HAMI_BPF_IMAGE:-localhost/hami-bpf}"
BASE="localhost/hami-bpf-base:bookworm"
CACHE="${HAMI_BPF_IMAGE_CACHE:-/var/cache/hami-bpf/image}"
VENV="${HAMI_BPF_VENV:-/opt/hami-bpf/venv}"
SUITE=bookworm
ARCH="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
PACKAGES="python3,python3-venv,python3-bpfcc,linux-headers-${ARCH},ca-certificates"

log() { echo "build-image: $*" >&2; }
die() { echo "build-image: error: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root (podman stores system images under /var/lib/containers)"
command -v podman >/dev/null || die "podman not found (apt-get install podman)"

mkdir -p "$CACHE/wheels"
T0=$(date +%s)

# -- 1. base rootfs ----------------------------------------------------------
key="$(printf '%s\n' "$SUITE" "$ARCH" "$PACKAGES" minbase v1 | sha256sum | cut -c1-12)"
tarball="$CACHE/base-${SUITE}-${key}.tar"
# A directory there, or a temporary left by a run that was cut short, is not
# a base to import.
[ ! -d "$tarball" ] || rm -rf "$tarball"
rm -rf "$tarball.tmp"
if [ ! -s "$tarball" ]; then
  command -v mmdebstrap >/dev/null || die "mmdebstrap not found (apt-get install mmdebstrap)"
  mirror=()
  [ -z "${HAMI_BPF_MIRROR:-}" ] || mirror=("$HAMI_BPF_MIRROR")
  log "making the base root filesystem (mmdebstrap $SUITE: $PACKAGES)"
  # minbase plus the packages; no recommends; apt lists and docs dropped
  # (what debian:12-slim drops too).
  # --format: mmdebstrap picks the format from the name's ending, and the
  # temporary name ends in .tmp, which it would take for a directory.
  mmdebstrap --variant=minbase --format=tar --arch="$ARCH" --include="$PACKAGES" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$SUITE" "$tarball.tmp" "${mirror[@]}"
  mv "$tarball.tmp" "$tarball"
fi
have="$(podman image inspect --format '{{index .Labels "io.hami-bpf.base"}}' "$BASE" 2>/dev/null || true)"
if [ "$have" != "$key" ]; then
  log "importing $tarball as $BASE"
  podman import --change "LABEL io.hami-bpf.base=$key" --change 'CMD ["/bin/bash"]' \
    "$tarball" "$BASE" >/dev/null
fi

# -- 2. wheels -----------------------------------------------------------------
WHEELS="$REPO/build/image/wheels"
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
[ -x "$VENV/bin/python" ] || VENV=""
PY="${VENV:+$VENV/bin/}python3"
deps="$(cd "$REPO" && "$PY" - <<'EOF'
import tomllib
d = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(x for x in d if "python_version <" not in x))
EOF
)"
dkey="$(echo "$deps" | sha256sum | cut -c1-12)"
if [ ! -e "$CACHE/wheels/$dkey/.complete" ]; then
  log "downloading wheels: $deps"
  rm -rf "$CACHE/wheels/$dkey"
  # cp311 for Debian 12's python3; binary wheels only
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.11 \
    --dest "$CACHE/wheels/$dkey" $deps
  touch "$CACHE/wheels/$dkey/.complete"
fi
cp "$CACHE/wheels/$dkey"/*.whl "$WHEELS/"
# hami-bpf itself, from this checkout (its build backend, setuptools, from the
# host pip's index like the dependencies)
"$PY" -m pip wheel -q --no-deps --wheel-dir "$WHEELS" "$REPO"

# -- 3. image ------------------------------------------------------------------
log "podman build $IMAGE:$TAG (offline)"
old_id="$(podman image inspect --format '{{.Id}}' "$IMAGE:$TAG" 2>/dev/null || true)"
T1=$(date +%s)
# shellcheck disable=SC2046
podman build --network none --pull=never --build-arg "BASE_IMAGE=$BASE" \
  $(bash "$REPO/deploy/podman-ulimits.sh") \
  -f "$REPO/deploy/Containerfile" -t "$IMAGE:$TAG" "$REPO"
T2=$(date +%s)
# the image this tag named before, if nothing else names it now
if [ -n "$old_id" ] && [ "$old_id" != "$(podman image inspect --format '{{.Id}}' "$IMAGE:$TAG")" ]; then
  podman rmi "$old_id" >/dev/null 2>&1 || true
fi
size="$(podman image inspect --format '{{.Size}}' "$IMAGE:$TAG")"
log "built $IMAGE:$TAG: $((size / 1000000)) MB, in $((T2 - T0)) s (podman build $((T2 - T1)) s)"
