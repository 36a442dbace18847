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
# A server that holds a PD, CQ, QP and MR while it waits for its peer's TCP exchange.
$K pingpong -d $DEV -g 1 -p 18600 >/tmp/holder.log 2>&1 &
HOLDER=$!
sleep 2
$K stat > /tmp/stat1.txt 2>&1
cat /tmp/stat1.txt | head -8
# The holder's row: PDs 1, CQs 1, QPs 1, MRs 1, pinned > 0.
grep -E "│ [0-9]+ +┆ $HOLDER " /tmp/stat1.txt | awk -F'┆' '{gsub(/ /,""); if ($4==1 && $5==1 && $6==1 && $8==1 && $11+0>0) ok=1} END {exit !ok}' \
    || fail "the holder's mirrored objects are not in krdma stat"
echo "MLX-DAEMON: holder's PD, CQ, QP, MR and pinned bytes are in krdma stat"
if $K pingpong -d $DEV -g 1 -p 18601 >/tmp/second.log 2>&1; then fail "second QP allowed past quota qps=1"; fi
grep -qi "quota" /tmp/second.log || { cat /tmp/second.log; fail "second holder not refused by the quota"; }
echo "MLX-DAEMON: second QP refused by the per-user quota: $(tail -1 /tmp/second.log)"
kill -9 $HOLDER; wait $HOLDER 2>/dev/null
sleep 1
$K stat > /tmp/stat2.txt 2>&1
head -1 /tmp/stat2.txt
head -1 /tmp/stat2.txt | grep -q "1 context(s), 0 pinned bytes" || fail "killed holder's context or pins not released"
echo "MLX-DAEMON: killed holder's context and pins released"
$K pingpong -d $DEV -g 1 -p 18602 >/tmp/third.log 2>&1 &
THIRD=$!
sleep 2
$K stat 2>&1 | grep -qE "┆ $THIRD " || fail "quota not given back after the holder died"
kill -9 $THIRD
echo "MLX-DAEMON: quota given back; a new holder gets its QP"
echo "MLX-DAEMON OK"
