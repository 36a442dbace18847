#!/bin/sh
# Run inside the interop guest (busybox sh) by scripts/interop-mlx.sh: krdmad serving the
# guest's kernel verbs device through the mlx provider, and what the kAL promises for a
# device whose fast path is the consumer's — its objects in `krdma stat`, a per-user quota
# that holds, and everything given back when a process holding them is killed.
# Expects /mnt/host/bin/krdma, /mnt/host/krdmad and /mnt/host/fuse.ko; DEV names the device.
set -u
DEV=${DEV:-ibv-rxe0}
K=/mnt/host/bin/krdma
fail() { echo "MLX-DAEMON FAIL: $*"; exit 1; }
grep -q fuse /proc/filesystems || insmod /mnt/host/fuse.ko || fail "no FUSE"
[ -e /dev/fuse ] || mknod /dev/fuse c 10 229
export KRDMA_RXE=off KRDMA_DEVICE=/tmp/krdma
# One QP per user: the second holder is refused until the first dies.
/mnt/host/krdmad --device /tmp/krdma --quota qps=1 >/tmp/krdmad.log 2>&1 &
for _ in $(seq 50); do grep -q ready /tmp/krdmad.log && break; sleep 0.1; done
grep -q ready /tmp/krdmad.log || { cat /tmp/krdmad.log; fail "krdmad did not start"; }
$K devices | grep -A30 "hca_id: $DEV" | grep -q "fast path:.*in the consumer" || fail "$DEV not listed as a consumer fast-path device"
# A holder: the IT-API pingpong example as a server, which makes its PZ, EVDs, endpoint
# (a QP) and LMR before it waits for a connection (IB and iWARP alike).
hold() { /mnt/host/bin/pingpong --device $DEV --server "$1" >"/tmp/holder$1.log" 2>&1 & }
row() { grep -E "│ [0-9]+ +┆ $1 " "$2"; }
hold 7490
HOLDER=$!
sleep 3
$K stat >/tmp/stat1.txt 2>&1
head -8 /tmp/stat1.txt
# The holder's row: a PD, a QP, an MR (at least) and pinned bytes.
row $HOLDER /tmp/stat1.txt | awk -F'┆' '{for (i = 1; i <= NF; i++) gsub(/[ │]/, "", $i);
    if ($4 >= 1 && $6 == 1 && $8 >= 1 && $11 + 0 > 0) ok = 1} END {exit !ok}' \
    || fail "the holder's mirrored objects are not in krdma stat"
echo "MLX-DAEMON: holder's PD, CQs, QP, MR and pinned bytes are in krdma stat"
# A second holder is refused its QP by the per-user quota (the kAL counts the refusal).
hold 7491
SECOND=$!
sleep 3
if kill -0 $SECOND 2>/dev/null; then fail "second QP allowed past quota qps=1"; fi
$K stat 2>&1 | grep -E "quota_refused_qps +┆ [1-9]" >/dev/null || fail "the quota did not refuse the second QP"
echo "MLX-DAEMON: second QP refused by the per-user quota ($(tail -1 /tmp/holder7491.log))"
kill -9 $HOLDER; wait $HOLDER 2>/dev/null
sleep 1
$K stat >/tmp/stat2.txt 2>&1
head -1 /tmp/stat2.txt
head -1 /tmp/stat2.txt | grep -q "1 context(s), 0 pinned bytes" || fail "killed holder's context or pins not released"
echo "MLX-DAEMON: killed holder's context and pins released"
hold 7492
THIRD=$!
sleep 3
$K stat >/tmp/stat3.txt 2>&1
row $THIRD /tmp/stat3.txt | awk -F'┆' '{gsub(/ /, "", $6); if ($6 == 1) ok = 1} END {exit !ok}' \
    || fail "quota not given back after the holder died"
kill -9 $THIRD
echo "MLX-DAEMON: quota given back; a new holder gets its QP"
echo "MLX-DAEMON OK"
