#!/usr/bin/env bash
# Interop of krdma's uDAPL provider with Linux's own: Debian's unmodified `dtest` runs on
# both ends — in a qemu guest over libdaplofa (the RDMA CM provider) on the guest kernel's
# rxe0 or siw0, and on this host over libdaplkrdma on krdma's rxe0 or siw0 — in both roles.
# dtest exchanges its buffers' addresses over TCP 15828 and the connection's private data
# (a 48-byte pattern each way, checked), then runs Sends, RDMA Writes and an RDMA Read.
# Every run is captured and the capture checked as in interop-rxe.sh / interop-siw.sh.
#
#   bash scripts/interop-dapl.sh                 # rxe and siw, both roles
#   ONLY=rxe bash scripts/interop-dapl.sh        # the cases whose name matches
#
# Needs root (network namespace, tap devices, qemu); see interop-siw.sh. Small buffers and
# bursts (-b 4096 -B 10): the guest runs under TCG (the kernel-to-kernel pair takes about
# two minutes per case with these sizes), and MEM=2048 for the guest (dtest registers
# large buffers and is OOM-killed in the default 1 GiB).
set -uo pipefail
export MEM=${MEM:-2048}
DTEST_ARGS=${DTEST_ARGS:--b 4096 -B 10}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/krdma-interop}
mkdir -p "$OUT"
command -v dtest >/dev/null || apt-get install -y -qq dapl2-utils libdapl2 >/dev/null

results_all=()
status=0
for RDMA in rxe siw; do
    (
        set -uo pipefail
        . "$ROOT/scripts/interop-lib.sh"
        cargo build --profile "$PROFILE" -p krdma-dapl-provider >&2 || exit 1
        LIB=$TARGET/$PROFILE/libdaplkrdma.so
        [ -f "$LIB" ] || LIB=$TARGET/$PROFILE/deps/libdaplkrdma.so
        # dtest's client takes the provider's name and the server's IA address from its
        # server (the rendezvous message carries them), so both ends must know one name:
        # on this host `ofa-v2-eth0` (the guest's entry) names krdma's device, through the
        # line `krdma dat-conf` prints, with this host's address on the guest network as
        # the IA address (the IA parameters' second word, as OFA's "eth0 0").
        export DAT_OVERRIDE=$OUT/dat.conf
        "$KRDMA" dat-conf --lib "$LIB" | sed -n "s/^krdma-${RDMA}0 \(.*\) \"${RDMA}0\" /ofa-v2-eth0 \1 \"${RDMA}0 $HOST\" /p" >"$DAT_OVERRIDE"
        grep -q "^ofa-v2-eth0 .*libdaplkrdma" "$DAT_OVERRIDE" || exit 1
        # dtest exits 0 even when it prints "DAPL Test Complete. FAILED": each side passes
        # only when it says PASSED. The host side: Debian's dtest through the system's
        # libdat2, krdma's provider.
        HOST_PROG="$OUT/dtest-passed.sh"
        printf '#!/bin/sh\nstdbuf -oL -eL dtest "$@" >"$0.log" 2>&1; rc=$?; cat "$0.log"\n[ $rc = 0 ] && grep -q "Complete. PASSED" "$0.log"\n' >"$HOST_PROG"
        chmod +x "$HOST_PROG"
        # With the guest as server the host's dtest reaches the guest's rendezvous through
        # scripts/dtest-relay.py, which holds the guest's message for a few seconds: dtest's
        # server sends it before it listens for the connection (see that script).
        RELAY_PROG="$OUT/dtest-relayed.sh"
        printf '#!/bin/sh\npython3 %s %s %s >"$0.log" 2>&1 &\nrelay=$!\nfor _ in $(seq 50); do grep -q listening "$0.log" && break; sleep 0.1; done\n%s "$@"; rc=$?\nkill $relay 2>/dev/null\nexit $rc\n' \
            "$ROOT/scripts/dtest-relay.py" "$HOST" "$GUEST" "$HOST_PROG" >"$RELAY_PROG"
        chmod +x "$RELAY_PROG"
        passed() { echo "$1 >/tmp/dtest.log 2>&1; cat /tmp/dtest.log; grep -q 'Complete. PASSED' /tmp/dtest.log"; }
        HOST_PROG=$RELAY_PROG record "dapl-$RDMA-guest-server" 2 "" \
            "$(passed "dtest -P ofa-v2-eth0 -s $DTEST_ARGS")" \
            "-P ofa-v2-eth0 $DTEST_ARGS -h $HOST" guest-first
        record "dapl-$RDMA-host-server" 2 "" "$(passed "dtest -P ofa-v2-eth0 $DTEST_ARGS -h $HOST")" \
            "-P ofa-v2-eth0 -s $DTEST_ARGS" host-first
        summary
    ) || status=1
done
exit $status
