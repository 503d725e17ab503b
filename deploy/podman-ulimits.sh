#!/bin/bash
# Print the --ulimit flags podman needs on a host whose root lacks
# CAP_SYS_RESOURCE (some CI sandboxes): podman asks the runtime for
# nofile=1048576 and nproc=4194304 by default, which the runtime then cannot
# set ("setrlimit ...: Operation not permitted").  The flags ask for this
# shell's own hard limits instead (nproc capped at conmon's 32768).  Prints
# nothing where the defaults work.  Used by deploy/build-image.sh and
# tests/containers.
if grep -q '^CapEff:.*' /proc/self/status && \
   [ $(( 0x$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status) >> 24 & 1 )) -eq 1 ]; then
    exit 0    # CAP_SYS_RESOURCE (bit 24): the defaults can be set
fi
nofile="$(ulimit -Hn)"
nproc="$(ulimit -Hu)"
[ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ] && nproc=32768
[ "$nofile" = unlimited ] && nofile=1048576
echo "--ulimit nofile=${nofile}:${nofile} --ulimit nproc=${nproc}:${nproc}"
