#!/usr/bin/env bash
# Interop of krdma's rxe with Linux kernel rdma_rxe: a qemu guest running kernel rxe and
# rdma-core's tools faces `krdma` on this host (rxe0), in both roles. Every run is captured
# and the capture checked: tshark decodes InfiniBand over UDP 4791 with no malformed frames,
# and every RoCEv2 ICRC is recomputed and must match (../shared/interop/icrc-check.py).
# The guest's IPv4 GID is index 1 (0 is its IPv6 link-local); krdma's is index 0.
# Six tool sets: ibv_rc_pingpong (`krdma pingpong`), ibv_uc_pingpong (`krdma uc-pingpong`),
# ibv_ud_pingpong (`krdma ud-pingpong`), udaddy (`krdma udaddy`), rping (`krdma rping`), and
# perftest 4.5 (ib_write_bw, ib_read_bw, ib_send_bw, ib_send_lat, ib_write_lat, ib_read_lat
# against `krdma perf`) with and without -R, the Send tests over UD (-c UD) and the Send
# and Write tests over UC (-c UC).
#
#   bash scripts/interop-rxe.sh                  # the whole set
#   ONLY=pingpong bash scripts/interop-rxe.sh    # the cases whose name matches
#   ONLY=perf- PERF_ITERS=200 bash scripts/interop-rxe.sh   # perftest only, 200 iterations
#   CARGO_TARGET_DIR=/path PROFILE=ci bash scripts/interop-rxe.sh  # build there, ci profile
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
# ibv_uc_pingpong: the same exchange, UC QPs brought up with UC's attributes only, then
# Sends of four packets (UC opcodes, no acknowledgements).
record "uc-pingpong-guest-server" 2 "" "ibv_uc_pingpong -d rxe0 -g 1 -m 1024 -s 4096 -n $ITERS" \
    "uc-pingpong -n $ITERS -g 0 -m 1024 -s 4096 $GUEST" guest-first
record "uc-pingpong-host-server" 2 "" "ibv_uc_pingpong -d rxe0 -g 1 -m 1024 -s 4096 -n $ITERS $HOST" \
    "uc-pingpong -n $ITERS -g 0 -m 1024 -s 4096" host-first daemon
# ibv_ud_pingpong: the same exchange, then UD Sends (SEND Only with a DETH, Q_Key
# 0x11111111) through address handles, each receive 40 bytes longer for the GRH.
record "ud-pingpong-guest-server" 2 "" "ibv_ud_pingpong -d rxe0 -g 1 -n $ITERS" \
    "ud-pingpong -n $ITERS -g 0 $GUEST" guest-first
record "ud-pingpong-host-server" 2 "" "ibv_ud_pingpong -d rxe0 -g 1 -n $ITERS $HOST" \
    "ud-pingpong -n $ITERS -g 0" host-first daemon
# udaddy: rdma_cm's UDP port space — a SIDR_REQ/SIDR_REP on QP1 resolves the server's UD
# QP and Q_Key, then UD Sends with immediate data each way (the server answers the source
# address in the GRH of the first datagram).
record "udaddy-guest-server" 2 "" "udaddy -b $GUEST" "udaddy -s $GUEST" guest-first
record "udaddy-host-server" 2 "" "udaddy -s $HOST" "udaddy -b $HOST" host-first daemon
# rping: rdma_cm over the IB CM (REQ/REP/RTU/DREQ/DREP MADs on QP1), Sends, RDMA Read/Write.
record "rping-guest-server" 2 "" "rping -s -a $GUEST -v -C 10" \
    "rping -c -a $GUEST -C 10 -v -V --device rxe0" guest-first
record "rping-host-server" 1 "" "rping -c -a $HOST -v -V -C 10" \
    "rping -s -a $HOST -v --device rxe0" host-first
record "rping-host-server-daemon" 1 "" "rping -c -a $HOST -v -V -C 10" \
    "rping -s -a $HOST -v --device rxe0" host-first daemon

# perftest 4.5: without -R (perftest's default on RoCE: pingpong_dest records as text over
# TCP 18515, QPs moved to RTR/RTS by Modify QP) and with -R (rdma_cm: IB CM on QP1, then
# the exchange as Sends). The guest runs perftest over kernel rxe with its IPv4 GID (-x 1),
# the host `krdma perf -d rxe0` with the same options. Guests run under TCG, so the runs are
# short (PERF_ITERS iterations of the default sizes: 64 KiB for bandwidth, 2 B for latency).
PERF_ITERS=${PERF_ITERS:-100}
for cm in "" "-R"; do
    tag=${cm:+-cm}
    for t in write_bw read_bw send_bw send_lat write_lat read_lat atomic_bw atomic_lat; do
        k=${t/_/-}
        # One host-server case of each exchange method through krdmad as well.
        front=embedded
        [ "$k$tag" = write-bw ] || [ "$k$tag" = send-lat-cm ] && front=daemon
        record "perf-$k-guest-server$tag" 2 "" "ib_$t -d rxe0 -x 1 $cm -n $PERF_ITERS" \
            "perf $k -d rxe0 $cm -n $PERF_ITERS $GUEST" guest-first
        record "perf-$k-host-server$tag" 1 "" "ib_$t -d rxe0 -x 1 $cm -n $PERF_ITERS $HOST" \
            "perf $k -d rxe0 $cm -n $PERF_ITERS" host-first $front
    done
done

# perftest's UD Send tests (-c UD): SEND Only with a DETH through an address handle, each
# receive 40 bytes longer for the GRH, messages up to the path MTU (ib_send_bw's default
# 64 KiB becomes the MTU). Without -R the QPs go to RTS by Modify QP with perftest's Q_Key
# 0x11111111; with -R the client resolves the server's QP by SIDR (rdma_cm's UDP port
# space, its Q_Key) and, for latency, tells it its own in a first datagram. One
# host-server case of each exchange method through krdmad.
for cm in "" "-R"; do
    tag=${cm:+-cm}
    for t in send_bw send_lat; do
        k=${t/_/-}
        front=embedded
        [ "$k$tag" = send-lat ] || [ "$k$tag" = send-bw-cm ] && front=daemon
        record "perf-$k-ud-guest-server$tag" 2 "" "ib_$t -d rxe0 -x 1 -c UD $cm -n $PERF_ITERS" \
            "perf $k -d rxe0 -c UD $cm -n $PERF_ITERS $GUEST" guest-first
        record "perf-$k-ud-host-server$tag" 1 "" "ib_$t -d rxe0 -x 1 -c UD $cm -n $PERF_ITERS $HOST" \
            "perf $k -d rxe0 -c UD $cm -n $PERF_ITERS" host-first $front
    done
done

# perftest's UC tests (-c UC; perftest runs UC without -R only): Sends and RDMA Writes with
# UC opcodes, nothing acknowledged, each Send finding one of the receives perftest posts
# per message. 4 KiB messages for the bandwidth tests: a UC message lost to a full socket
# buffer in the slow guest is lost for good. One host-server case through krdmad.
for t in send_bw write_bw send_lat write_lat; do
    k=${t/_/-}
    size=""
    [ "${k#*-}" = bw ] && size="-s 4096"
    front=embedded
    [ "$k" = write-bw ] && front=daemon
    record "perf-$k-uc-guest-server" 2 "" "ib_$t -d rxe0 -x 1 -c UC $size -n $PERF_ITERS" \
        "perf $k -d rxe0 -c UC $size -n $PERF_ITERS $GUEST" guest-first
    record "perf-$k-uc-host-server" 1 "" "ib_$t -d rxe0 -x 1 -c UC $size -n $PERF_ITERS $HOST" \
        "perf $k -d rxe0 -c UC $size -n $PERF_ITERS" host-first $front
done

# perftest's run options, both roles, each exchange method: a timed run (-D seconds, -f
# margins: only the middle is measured, each side by its own clock), a post list (-l:
# requests posted as one list, CQ moderation following it) and bidirectional runs (-b).
for cm in "" "-R"; do
    tag=${cm:+-cm}
    for spec in write_bw:-D send_bw:-D send_lat:-D write_lat:-D read_lat:-D write_bw:-l \
        send_bw:-l write_bw:-b read_bw:-b send_bw:-b; do
        t=${spec%%:*} opt=${spec#*:}
        k=${t/_/-}
        perf_option "$opt"
        record "perf-$k-$name-guest-server$tag" 2 "" "ib_$t -d rxe0 -x 1 $cm $args" \
            "perf $k -d rxe0 $cm $args $GUEST" guest-first
        record "perf-$k-$name-host-server$tag" 1 "" "ib_$t -d rxe0 -x 1 $cm $args $HOST" \
            "perf $k -d rxe0 $cm $args" host-first
    done
done

summary
