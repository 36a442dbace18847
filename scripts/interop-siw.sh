#!/usr/bin/env bash
# Interop of krdma's siw with Linux kernel siw: a qemu guest running kernel siw and rdma-core's
# tools faces `krdma` on this host, in both roles, with the guest's siw in its default mode and
# with MPA CRC required (--siwcrc). Every run is captured and the capture checked with tshark
# (iWARP decoded, no malformed frames, no CRC errors). Two tool sets: rping (`krdma rping`) and
# perftest 4.5 -R (ib_write_bw, ib_read_bw, ib_send_bw, ib_send_lat, ib_write_lat, ib_read_lat
# against `krdma perf`).
#
#   bash scripts/interop-siw.sh            # the whole set
#   INTEROP=/path/to/shared/interop bash scripts/interop-siw.sh
#   ONLY=guest-server bash scripts/interop-siw.sh   # the cases whose name matches
#   ONLY=perf- PERF_ITERS=200 bash scripts/interop-siw.sh   # perftest only, 200 iterations
#   CARGO_TARGET_DIR=/path PROFILE=ci bash scripts/interop-siw.sh  # build there, ci profile
#
# Needs root (network namespace, tap devices, qemu). The guest tooling lives outside the
# project (../shared/interop relative to the project's parent by default); its build.sh
# installs qemu and downloads the guest kernel and rdma-core on first use.
set -uo pipefail
RDMA=siw
. "$(dirname "$0")/interop-lib.sh"

for crc in "" "--siwcrc"; do
    tag=${crc:+-crc}
    record "rping-guest-server$tag" 3 "$crc" "rping -s -a $GUEST -v -C 10" \
        "rping -c -a $GUEST -C 10 -v -V" guest-first
    front=embedded
    [ -n "$crc" ] && front=daemon  # one direction through krdmad as well
    record "rping-host-server$tag" 1 "$crc" "rping -c -a $HOST -v -V -C 10" \
        "rping -s -a $HOST -v" host-first $front
done

# perftest -R (rdma_cm mode, the only one iWARP can run): the guest runs perftest 4.5 over
# kernel siw, the host `krdma perf` with the same options. Guests run under TCG, so the runs
# are short (PERF_ITERS iterations of the default sizes: 64 KiB for bandwidth, 2 B for latency).
PERF_ITERS=${PERF_ITERS:-100}
for crc in "" "--siwcrc"; do
    tag=${crc:+-crc}
    front=embedded
    [ -n "$crc" ] && front=daemon  # the host-server direction through krdmad as well
    for t in write_bw read_bw send_bw send_lat write_lat read_lat; do
        k=${t/_/-}
        record "perf-$k-guest-server$tag" 3 "$crc" "ib_$t -d siw0 -R -n $PERF_ITERS" \
            "perf $k -R -n $PERF_ITERS $GUEST" guest-first
        record "perf-$k-host-server$tag" 1 "$crc" "ib_$t -d siw0 -R -n $PERF_ITERS $HOST" \
            "perf $k -R -n $PERF_ITERS" host-first $front
    done
done

# perftest's run options, both roles: a timed run (-D, -f), a post list (-l) and
# bidirectional runs (-b; send_bw -b writes receive credits both ways).
for spec in write_bw:-D send_bw:-D send_lat:-D write_lat:-D write_bw:-l send_bw:-l \
    write_bw:-b read_bw:-b send_bw:-b; do
    t=${spec%%:*} opt=${spec#*:}
    k=${t/_/-}
    perf_option "$opt"
    record "perf-$k-$name-guest-server" 3 "" "ib_$t -d siw0 -R $args" \
        "perf $k -R $args $GUEST" guest-first
    record "perf-$k-$name-host-server" 1 "" "ib_$t -d siw0 -R $args $HOST" \
        "perf $k -R $args" host-first
done

summary
