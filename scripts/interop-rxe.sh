#!/usr/bin/env bash
# Interop of krdma's rxe with Linux kernel rdma_rxe: a qemu guest running kernel rxe and
# rdma-core's tools faces `krdma` on this host (rxe0), in both roles. Every run is captured
# and the capture checked: tshark decodes InfiniBand over UDP 4791 with no malformed frames,
# and every RoCEv2 ICRC is recomputed and must match (../shared/interop/icrc-check.py).
# The guest's IPv4 GID is index 1 (0 is its IPv6 link-local); krdma's is index 0.
#
#   bash scripts/interop-rxe.sh                  # the whole set
#   ONLY=pingpong bash scripts/interop-rxe.sh    # the cases whose name matches
#
# Needs root (network namespace, tap devices, raw sockets, qemu); see interop-siw.sh.
set -uo pipefail
RDMA=rxe
. "$(dirname "$0")/interop-lib.sh"

ITERS=${ITERS:-100}
# ibv_rc_pingpong: out-of-band QPN/PSN/GID exchange over TCP 18515, then RC Sends.
record "pingpong-guest-server" 2 "" "ibv_rc_pingpong -d rxe0 -g 1 -n $ITERS" \
    "pingpong -n $ITERS -g 0 $GUEST" guest-first
record "pingpong-host-server" 1 "" "ibv_rc_pingpong -d rxe0 -g 1 -n $ITERS $HOST" \
    "pingpong -n $ITERS -g 0" host-first
record "pingpong-host-server-64k" 1 "" "ibv_rc_pingpong -d rxe0 -g 1 -m 1024 -s 65536 -n $ITERS $HOST" \
    "pingpong -n $ITERS -g 0 -m 1024 -s 65536" host-first daemon
# rping: rdma_cm over the IB CM (REQ/REP/RTU/DREQ/DREP MADs on QP1), Sends, RDMA Read/Write.
record "rping-guest-server" 2 "" "rping -s -a $GUEST -v -C 10" \
    "rping -c -a $GUEST -C 10 -v -V --device rxe0" guest-first
record "rping-host-server" 1 "" "rping -c -a $HOST -v -V -C 10" \
    "rping -s -a $HOST -v --device rxe0" host-first
record "rping-host-server-daemon" 1 "" "rping -c -a $HOST -v -V -C 10" \
    "rping -s -a $HOST -v --device rxe0" host-first daemon

summary
