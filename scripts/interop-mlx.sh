#!/usr/bin/env bash
# krdma's mlx provider on real verbs devices: in a qemu guest, krdma's own binaries run over
# the Linux kernel's rxe0 (or siw0) through libibverbs — the device `ibv-rxe0` (`ibv-siw0`),
# whose fast path runs in the krdma process itself (rnicpi::user) — against krdma's
# software rxe0 (siw0) on this host: two implementations of one wire. Every run is captured
# and checked as in interop-rxe.sh / interop-siw.sh, and the krdma-to-krdma runs check the
# data they move (`--validate`, rping -V, pingpong's own check).
#
#   bash scripts/interop-mlx.sh              # RoCEv2: guest kernel rxe0 through mlx
#   RDMA=siw bash scripts/interop-mlx.sh     # iWARP: guest kernel siw0 through mlx
#   ONLY=pingpong bash scripts/interop-mlx.sh
#
# Needs root (network namespace, tap devices, raw sockets, qemu). Opt-in: not run by
# scripts/test.sh (the guests run under TCG and take minutes).
set -uo pipefail
RDMA=${RDMA:-rxe}
. "$(dirname "$0")/interop-lib.sh"

# What the guest runs, staged in one folder (/mnt/host/bin there): krdma and the IT-API
# examples.
cargo build --profile "$PROFILE" -p krdma-itapi --example pingpong --example rdma_rw >&2 || exit 1
EXAMPLES=$TARGET/$PROFILE/examples
BIN=$OUT/bin
rm -rf "$BIN" && mkdir -p "$BIN"
cp "$KRDMA" "$EXAMPLES/pingpong" "$EXAMPLES/rdma_rw" "$BIN/"
GUEST_COPY=$BIN
# The guest's krdma: only the kernel's device through libibverbs (krdma's own software
# devices stay off in the guest; the kernel holds UDP 4791 there anyway).
G="env KRDMA_RXE=off /mnt/host/bin/krdma"
GX="env KRDMA_RXE=off /mnt/host/bin"
ITERS=${ITERS:-100}
PERF_ITERS=${PERF_ITERS:-100}
HOSTDEV=$RDMA"0"
GDEV=ibv-$RDMA"0"

if [ "$RDMA" = rxe ]; then
    # The guest's IPv4 GID is index 1 (0 is its IPv6 link-local); krdma's is index 0.
    record "pingpong-guest-server" 2 "" "$G pingpong -d $GDEV -g 1 -n $ITERS" \
        "pingpong -n $ITERS -g 0 $GUEST" guest-first
    record "pingpong-host-server" 1 "" "$G pingpong -d $GDEV -g 1 -n $ITERS $HOST" \
        "pingpong -n $ITERS -g 0" host-first
    record "pingpong-host-server-daemon" 1 "" "$G pingpong -d $GDEV -g 1 -n $ITERS $HOST" \
        "pingpong -n $ITERS -g 0" host-first daemon
    # UD: address handles of the kernel's device (ibv_create_ah), Sends through them.
    record "ud-pingpong-guest-server" 2 "" "$G ud-pingpong -d $GDEV -g 1 -n $ITERS" \
        "ud-pingpong -n $ITERS -g 0 $GUEST" guest-first
    record "ud-pingpong-host-server" 2 "" "$G ud-pingpong -d $GDEV -g 1 -n $ITERS $HOST" \
        "ud-pingpong -n $ITERS -g 0" host-first
fi
record "rping-guest-server" 2 "" "$G rping -s -a $GUEST -v -C 10 --device $GDEV" \
    "rping -c -a $GUEST -C 10 -v -V --device $HOSTDEV" guest-first
record "rping-host-server" 1 "" "$G rping -c -a $HOST -v -V -C 10 --device $GDEV" \
    "rping -s -a $HOST -v --device $HOSTDEV" host-first

# perftest-compatible runs, both roles: without -R (IB/RoCE only: QPs moved to RTS by
# Modify QP after a TCP exchange) and with -R (rdma_cm).
cms=("-R")
[ "$RDMA" = rxe ] && cms=("" "-R")
for cm in "${cms[@]}"; do
    tag=${cm:+-cm}
    for t in write-bw read-bw send-bw send-lat; do
        v=--validate
        [ "$t" = send-lat ] && v=""
        record "perf-$t-guest-server$tag" 2 "" "$G perf $t -d $GDEV -x 1 $cm $v -n $PERF_ITERS" \
            "perf $t -d $HOSTDEV $cm $v -n $PERF_ITERS $GUEST" guest-first
        record "perf-$t-host-server$tag" 1 "" "$G perf $t -d $GDEV -x 1 $cm $v -n $PERF_ITERS $HOST" \
            "perf $t -d $HOSTDEV $cm $v -n $PERF_ITERS" host-first
    done
done

# The IT-API examples, both roles: Sends with their data checked (pingpong) and RDMA Write
# and Read of a pattern each side verifies (rdma_rw; without memory windows on the device
# the server hands out its LMR).
for ex in pingpong rdma_rw; do
    HOST_PROG=$EXAMPLES/$ex record "itapi-$ex-guest-server" 2 "" \
        "$GX/$ex --device $GDEV --server 7480" "--device $HOSTDEV --client $GUEST:7480" guest-first
    HOST_PROG=$EXAMPLES/$ex record "itapi-$ex-host-server" 1 "" \
        "$GX/$ex --device $GDEV --client $HOST:7481" "--device $HOSTDEV --server 7481" host-first
done

# uDAPL: Debian's unmodified dtest at both ends through the system's libdat2 and krdma's
# DAT provider — in the guest on the kernel's device through mlx, on the host on krdma's
# software device — both registered as ofa-v2-eth0 (dtest's client takes the name from its
# server), each with its own address as the IA parameters' second word.
cargo build --profile "$PROFILE" -p krdma-dapl-provider >&2 || exit 1
command -v dtest >/dev/null || apt-get install -y -qq dapl2-utils libdapl2 >/dev/null
cp "$TARGET/$PROFILE/libdaplkrdma.so" "$BIN/"
datconf() { echo "ofa-v2-eth0 u2.0 nonthreadsafe default $1 dapl.2.0 \"$2 $3\" \"\""; }
datconf /mnt/host/bin/libdaplkrdma.so "$GDEV" "$GUEST" >"$BIN/dat.conf"
datconf "$BIN/libdaplkrdma.so" "$HOSTDEV" "$HOST" >"$OUT/dat-host.conf"
DTEST="dtest -P ofa-v2-eth0 -b 4096 -B 10"
# dtest exits 0 even when it prints "DAPL Test Complete. FAILED": a side passes only when
# it says PASSED.
printf '#!/bin/sh\nDAT_OVERRIDE=%s stdbuf -oL -eL dtest "$@" >"$0.log" 2>&1; rc=$?; cat "$0.log"\n[ $rc = 0 ] && grep -q "Complete. PASSED" "$0.log"\n' \
    "$OUT/dat-host.conf" >"$OUT/dtest-host.sh"
chmod +x "$OUT/dtest-host.sh"
gdtest() { echo "env DAT_OVERRIDE=/mnt/host/bin/dat.conf KRDMA_RXE=off $DTEST $1 >/tmp/dtest.log 2>&1; cat /tmp/dtest.log; grep -q 'Complete. PASSED' /tmp/dtest.log"; }
# Only the guest as client: dtest's server makes its PSP after it has sent its rendezvous
# message, and krdma's client on the host connects within milliseconds of it, before a
# server in the emulated guest listens (NON_PEER_REJECTED; docs/interop.md). The guest's
# side as server is run against the guest's own libdaplofa client instead, whose rdma_cm
# address and route resolution gives it time (mlx-rdmacore.sh).
HOST_PROG=$OUT/dtest-host.sh record "dapl-host-server" 2 "" "$(gdtest "-h $HOST")" \
    "-P ofa-v2-eth0 -s -b 4096 -B 10" host-first

# Cases inside the guest alone (scripts/guest/*.sh, busybox sh): guest_only NAME SCRIPT
# MARKER passes when the script prints "MARKER OK".
# - rdma-core's own tools (ibv_rc_pingpong, perftest with and without -R, rping) against
#   krdma over the same kernel device, both roles (mlx-rdmacore.sh);
# - daemon mode: krdmad serving the kernel's device, its objects in `krdma stat`, a per-user
#   quota, and a killed process's resources given back (mlx-daemon.sh; the guest loads
#   FUSE from its own kernel's modules).
FUSE_KO=$(ls "${VMDIR:-/tmp/vm}"/extract/lib/modules/*/kernel/fs/fuse/fuse.ko 2>/dev/null | head -1)
guest_only() {
    local name=$1 script=$2 marker=$3 log=$OUT/$1.guest.log
    [[ "$name" =~ ${ONLY:-.} ]] || return 0
    echo "== $name (guest only)" >&2
    if [ -z "$FUSE_KO" ]; then
        echo "  $name: no fuse.ko for the guest kernel under ${VMDIR:-/tmp/vm}/extract"
    elif bash "$INTEROP/guest-peer.sh" --rdma "$RDMA" --copy "$BIN" --copy "$KRDMAD" \
        --copy "$FUSE_KO" --copy "$ROOT/scripts/guest/$script" --timeout 400 \
        -- "DEV=$GDEV sh /mnt/host/$script" >"$log" 2>&1 && grep -q "$marker OK" "$log"; then
        local n note=""
        n=$(grep -c "$marker PASS" "$log")
        [ "$n" -gt 0 ] && note=" ($n pairs)"
        pass=$((pass + 1)); results+=("PASS $name$note"); return
    fi
    grep "$marker" "$log" | grep -v PASS | tail -5
    fail=$((fail + 1)); results+=("FAIL $name (log: $log)")
}
guest_only rdma-core-tools mlx-rdmacore.sh RDMACORE
guest_only daemon-quota-death mlx-daemon.sh MLX-DAEMON

summary
