#!/bin/bash
# Stage 2 of a guest boot (tests/kernels/init.sh hands over here, as PID 1, in
# the host's root file system under a tmpfs overlay).
#
# $1 is the checkout, $2 the virtual environment. /hami-out is the host's
# result folder for this kernel:
#   in:  pytest.args  (pytest arguments, one a line), pytest2.args (optional
#        second pass after raising lockdown to integrity), modroot (the folder
#        to link as /lib/modules/$(uname -r)), guest.patch (optional experiment)
#   out: doctor.json, junit.xml, pytest.log, rc, guest.log (+ doctor2.json,
#        junit2.xml, pytest2.log of the second pass), dmesg.txt
# The guest powers off at the end, whatever happened.
REPO="$1"
OUT=/hami-out
KVER="$(uname -r)"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TERM=dumb
unset CI
# The first daemon start's bound (tests/bpf/helpers.py derives every later
# deadline from how long that start took).
export HAMI_TEST_READY_TIMEOUT="${HAMI_TEST_READY_TIMEOUT:-900}"
VENV="${2:-/opt/hami-bpf/venv}"   # the host's venv under test (make test-kernels VENV=...)

off() { sync; echo o > /proc/sysrq-trigger; sleep 30; }
trap off EXIT

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
# The checkout may live under /tmp or /run (CI clones wherever it likes):
# keep it visible at the same path across the fresh tmpfs mounts below.
mkdir -p /hami-repo && mount --bind "$REPO" /hami-repo
mount -t tmpfs tmpfs /tmp
mount -t tmpfs -o mode=0755 tmpfs /run   # as on a host: the daemon refuses a /run others can write
mkdir -p "$REPO" && mount --bind /hami-repo "$REPO"
mount -t tracefs nodev /sys/kernel/tracing
mount -t debugfs nodev /sys/kernel/debug
mount -t bpf bpf /sys/fs/bpf
mount -t securityfs securityfs /sys/kernel/security
mount -t cgroup2 cgroup2 /sys/fs/cgroup
ip link set lo up 2>/dev/null
hostname hami-guest

log() { echo "hami-guest: $*" | tee -a "$OUT/guest.log"; }
log "kernel $KVER, $(nproc) cpus, $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo), \
lockdown: $(cat /sys/kernel/security/lockdown 2>/dev/null || echo n/a)"

# Kernel headers for bcc: the host prepared a folder (named in $OUT/modroot: build and
# source links to the headers extracted from Debian's packages for THIS kernel).
MODROOT="$(cat "$OUT/modroot" 2>/dev/null)"
if [ -n "$MODROOT" ] && [ -d "$MODROOT" ]; then
    rm -rf "/usr/lib/modules/$KVER"
    mkdir -p /usr/lib/modules
    ln -s "$MODROOT" "/usr/lib/modules/$KVER"
    log "headers: /lib/modules/$KVER/build -> $(readlink -f "/lib/modules/$KVER/build")"
else
    log "no $MODROOT: bcc will not find headers"
fi

cd "$REPO" || exit 1
if [ -s "$OUT/guest.patch" ]; then
    # An experiment (run_matrix.py --guest-patch): applied to the guest's view
    # only (the tmpfs overlay); the host's checkout is not touched.
    if patch -p1 -d "$REPO" < "$OUT/guest.patch" > "$OUT/guest.patch.log" 2>&1; then
        log "applied guest.patch: $(grep -c '^+++' "$OUT/guest.patch") file(s)"
    else
        log "guest.patch did not apply: $(tail -1 "$OUT/guest.patch.log")"
    fi
fi
T0=$(date +%s)
"$VENV/bin/hami-bpf" doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor.stderr"
log "doctor --json: exit $?, $(( $(date +%s) - T0 )) s"

mapfile -t ARGS < "$OUT/pytest.args"
log "pytest ${ARGS[*]}"
export HAMI_TEST_DOCTOR_JSON="$OUT/doctor.json"   # test_mechanisms.py reuses it
T0=$(date +%s)
"$VENV/bin/python" -m pytest -p no:cacheprovider -o junit_family=legacy --junitxml="$OUT/junit.xml" "${ARGS[@]}" \
    2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
echo "$rc" > "$OUT/rc"
log "pytest exit $rc after $(( $(date +%s) - T0 )) s"
if [ -s "$OUT/pytest2.args" ] && "$VENV/bin/python" -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["features"]["probe_write_user"] else 1)' "$OUT/doctor.json" 2>/dev/null; then
    # Second pass: lockdown raised to integrity (one way, until power-off),
    # so the memory-info fallback (stop-write) runs on this kernel too.
    if echo integrity > /sys/kernel/security/lockdown; then
        log "lockdown now: $(cat /sys/kernel/security/lockdown)"
        mapfile -t ARGS2 < "$OUT/pytest2.args"
        "$VENV/bin/hami-bpf" doctor --json > "$OUT/doctor2.json" 2>/dev/null
        export HAMI_TEST_DOCTOR_JSON="$OUT/doctor2.json"
        "$VENV/bin/python" -m pytest -p no:cacheprovider -o junit_family=legacy --junitxml="$OUT/junit2.xml" "${ARGS2[@]}" \
            2>&1 | tee "$OUT/pytest2.log"
        log "lockdown pass: pytest exit ${PIPESTATUS[0]}"
    else
        log "could not raise lockdown to integrity"
    fi
fi
dmesg > "$OUT/dmesg.txt" 2>/dev/null
echo "HAMI-GUEST-DONE rc=$rc"
