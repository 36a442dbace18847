#!/usr/bin/env bash
# SDP through the preload library against kernel TCP, all in one run on loopback:
# iperf3 bandwidth (1 and 4 streams), sockperf ping-pong latency (64 B), redis-benchmark
# requests/s — over siw0 and rxe0, with the embedded kAL and through krdmad (root).
# A benchmark, not a test. Prints markdown tables and writes them into the `sdp` generated
# block of docs/benchmarks.md (commit, date and machine with them).
#
#   bash scripts/bench-sdp.sh [profile]     (default: release; `ci` reuses the test build)
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-release}
# (Two builds: `--bin` would leave the preload library out of one.)
cargo build -q --profile "$profile" -p krdma-sdp-preload
cargo build -q --profile "$profile" -p krdma-stack --bin krdmad
cargo build -q --profile "$profile" -p krdma-sdp-tool
dir=${CARGO_TARGET_DIR:-target}/$profile
[ "$profile" = dev ] && dir=${CARGO_TARGET_DIR:-target}/debug
PRELOAD=$(realpath "$dir/libkrdma_sdp_preload.so")
# A missing library would only make the loader warn, and every "SDP" figure TCP's.
[ -f "$PRELOAD" ] || { echo "no $PRELOAD" >&2; exit 1; }
work=$(mktemp -d)
# Cleanup only: nothing here may turn a finished run into a failure (errexit applies).
trap 'kill $(jobs -p) 2>/dev/null || true; [ -z "${daemon:-}" ] || kill "$daemon" 2>/dev/null || true; umount -l "$work/krdma" 2>/dev/null || true; rm -rf "$work"' EXIT

SECS=${SECS:-3}
# checked FIGURE SERVER_PID: the figure, marked [TCP:n] when the server, offloaded through
# the preload, accepted n connections over TCP (the switch fell back: not SDP's figure).
checked() {
    local n
    n=$("$dir/krdma-sdp" --raw "$2" 2>/dev/null | tr ' ' '\n' | sed -n 's/^accepted_tcp=//p' | head -1)
    if [ -n "$n" ] && [ "$n" != 0 ]; then echo "$1[TCP:$n]"; else echo "$1"; fi
}
# run_case NAME SERVER_ENV CLIENT_ENV SERVER_IP
run_case() {
    local name=$1 senv=$2 cenv=$3 ip=$4 port=$((27000 + RANDOM % 2000 * 3))
    env $senv iperf3 -s -p $port >/dev/null 2>&1 &
    local s=$!
    sleep 1.5
    local bw1 bw4
    bw1=$(env $cenv iperf3 -c "$ip" -p $port -t "$SECS" -J | python3 -c 'import json,sys; print("%.2f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9))')
    bw1=$(checked "$bw1" $s)
    bw4=$(env $cenv iperf3 -c "$ip" -p $port -t "$SECS" -P 4 -J | python3 -c 'import json,sys; print("%.2f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9))')
    bw4=$(checked "$bw4" $s)
    kill $s; wait $s 2>/dev/null || true
    port=$((port + 1))
    env $senv sockperf sr --tcp -i 0.0.0.0 -p $port >/dev/null 2>&1 &
    s=$!
    sleep 1.5
    local lat
    lat=$(env $cenv sockperf pp --tcp -i "$ip" -p $port -t "$SECS" -m 64 2>&1 | sed -n 's/.*percentile 50.000 = *\([0-9.]*\).*/\1/p')
    lat=$(checked "$lat" $s)
    kill $s; wait $s 2>/dev/null || true
    port=$((port + 1))
    env $senv redis-server --port $port --bind 0.0.0.0 --protected-mode no --save "" --appendonly no >/dev/null 2>&1 &
    s=$!
    sleep 1.5
    local rps
    rps=$(env $cenv redis-benchmark -h "$ip" -p $port -n 20000 -c 4 -t get -q 2>/dev/null | sed -n 's/.*GET: \([0-9.]*\) requests.*/\1/p')
    rps=$(checked "$rps" $s)
    kill $s; wait $s 2>/dev/null || true
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$bw1" "$bw4" "$lat" "$rps" >>"$work/rows"
}

source scripts/bench-lib.sh
commit=$(bench_commit)
started=$(date -u '+%Y-%m-%d %H:%M UTC')
run_case "kernel TCP (baseline)" "KRDMA_SDP_OFF=1" "KRDMA_SDP_OFF=1" 127.0.0.1
for dev in siw0 rxe0; do
    for spin in "" 0; do
        run_case "SDP $dev, embedded${spin:+, calls never poll}" \
            "LD_PRELOAD=$PRELOAD KRDMA_DEVICE=embedded KRDMA_SDP_DEVICE=$dev KRDMA_RXE_ADDR=127.0.77.1 ${spin:+KRDMA_SDP_SPIN_US=$spin}" \
            "LD_PRELOAD=$PRELOAD KRDMA_DEVICE=embedded KRDMA_SDP_DEVICE=$dev KRDMA_RXE_ADDR=127.0.77.2 ${spin:+KRDMA_SDP_SPIN_US=$spin}" \
            "$([ $dev = rxe0 ] && echo 127.0.77.1 || echo 127.0.0.1)"
    done
done
if [ "$(id -u)" = 0 ] && [ -e /dev/fuse ]; then
    "$dir/krdmad" --device "$work/krdma" --rxe-addr 127.0.77.9 >/dev/null 2>&1 &
    daemon=$!
    sleep 2
    for dev in siw0 rxe0; do
        run_case "SDP $dev, krdmad" \
            "LD_PRELOAD=$PRELOAD KRDMA_DEVICE=$work/krdma KRDMA_SDP_DEVICE=$dev" \
            "LD_PRELOAD=$PRELOAD KRDMA_DEVICE=$work/krdma KRDMA_SDP_DEVICE=$dev" \
            "$([ $dev = rxe0 ] && echo 127.0.77.9 || echo 127.0.0.1)"
    done
fi
run_case "kernel TCP (baseline, again)" "KRDMA_SDP_OFF=1" "KRDMA_SDP_OFF=1" 127.0.0.1

# Every figure with its ratio to the mean of the two kernel TCP baselines of this run
# (latency: a ratio below 1 is faster than TCP).
python3 - "$work/rows" >"$work/table" <<'PY'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
base = [r for r in rows if r[0].startswith("kernel TCP")]
def num(v):
    try: return float(v)
    except ValueError: return None
mean = [sum(num(r[i]) for r in base) / len(base) if all(num(r[i]) for r in base) else None for i in range(1, 5)]
print("Marked [TCP:n]: the offloaded server accepted n connections over TCP (the switch fell back).")
print()
print("| case | iperf3 1 stream (Gbit/s) | iperf3 4 streams (Gbit/s) | sockperf 64 B ping-pong, median one-way (µs) | redis-benchmark GET (req/s) |")
print("|---|---|---|---|---|")
for r in rows:
    cells = []
    for i, v in enumerate(r[1:5]):
        x = num(v)
        if x is None or mean[i] is None or r[0].startswith("kernel TCP"):
            cells.append(v or "?")
        else:
            cells.append("%s (%.2f×)" % (v, x / mean[i]))
    print("| %s | %s |" % (r[0], " | ".join(cells)))
PY

# The zero-copy threshold, measured: iperf3 (one stream, siw0 and rxe0, embedded) with
# 128 KiB and 1 MiB writes, zero copy off and from 128 KiB / 1 MiB (both modes: the
# reader's SinkAvail when it waits, the writer's SrcAvail otherwise).
{
    echo "| device, write size | zero copy off | from 128 KiB | from 1 MiB |"
    echo "|---|---|---|---|"
    for dev in siw0 rxe0; do
        ip=$([ $dev = rxe0 ] && echo 127.0.77.1 || echo 127.0.0.1)
        for len in 128K 1M; do
            row="| $dev, $len |"
            for th in 0 131072 1048576; do
                port=$((29000 + RANDOM % 2000))
                env LD_PRELOAD=$PRELOAD KRDMA_DEVICE=embedded KRDMA_SDP_DEVICE=$dev KRDMA_RXE_ADDR=127.0.77.1 \
                    KRDMA_SDP_ZCOPY_THRESHOLD=$th iperf3 -s -1 -p $port >/dev/null 2>&1 &
                s=$!
                sleep 1.5
                bw=$(env LD_PRELOAD=$PRELOAD KRDMA_DEVICE=embedded KRDMA_SDP_DEVICE=$dev KRDMA_RXE_ADDR=127.0.77.2 \
                    KRDMA_SDP_ZCOPY_THRESHOLD=$th iperf3 -c "$ip" -p $port -t "$SECS" -l $len -J |
                    python3 -c 'import json,sys; print("%.2f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9))') || bw="?"
                kill $s 2>/dev/null || true; wait $s 2>/dev/null || true
                row="$row $bw Gbit/s |"
            done
            echo "$row"
        done
    done
} >"$work/zcopy"

{
    echo "<!-- sdp:begin — generated by scripts/bench-sdp.sh; do not edit by hand -->"
    echo
    echo "Generated $started on commit $commit: $(nproc) vCPUs ($(bench_cpu)),"
    echo "Linux $(uname -r), $profile build, ${SECS} s per iperf3 and sockperf run. Unmodified"
    echo "programs through the preload library; each figure's ratio is to the mean of the two"
    echo "kernel TCP runs of the same run (latency: below 1 is faster than TCP)."
    echo
    cat "$work/table"
    echo
    echo "The zero-copy threshold (\`KRDMA_SDP_ZCOPY_THRESHOLD\`): iperf3, one stream, embedded,"
    echo "with 128 KiB and 1 MiB writes."
    echo
    cat "$work/zcopy"
    echo
    echo "<!-- sdp:end -->"
} >"$work/block"
cat "$work/block"
bench_write_block sdp "$work/block"
