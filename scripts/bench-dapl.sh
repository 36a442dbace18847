#!/usr/bin/env bash
# uDAPL benchmark (not a test): dapltest -T P RDMA Write throughput and dtest's 8-byte
# message ping-pong latency over krdma's DAT provider, siw0 and rxe0, embedded and
# through krdmad (root), next to raw TCP loopback measured in the same run.
#
#   bash scripts/bench-dapl.sh          # builds release, needs dapl2-utils (installs as root)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v dtest >/dev/null || { apt-get update -qq && apt-get install -y -qq dapl2-utils libdapl2 >/dev/null; }
cargo build --release -q -p krdma-dapl-provider -p krdma-stack -p krdma-tools
T=$(mktemp -d)
trap 'kill $DAEMON 2>/dev/null || true; umount -l $T/krdma 2>/dev/null || true; rm -rf $T' EXIT
DAEMON=
./target/release/krdma dat-conf --lib target/release/libdaplkrdma.so --install --conf $T/dat.conf >/dev/null
export DAT_OVERRIDE=$T/dat.conf

echo "== raw TCP loopback (same run)"
python3 - <<'PY'
import socket, threading, time
def serve(l):
    c, _ = l.accept()
    while True:
        d = c.recv(1 << 16)
        if not d: break
        if len(d) == 8 and d[:4] == b'ping': c.sendall(d)
l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen(1)
threading.Thread(target=serve, args=(l,), daemon=True).start()
s = socket.create_connection(l.getsockname()); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
n = 2000; t = time.perf_counter()
for i in range(n):
    s.sendall(b'ping' + i.to_bytes(4, 'little')); s.recv(8)
print(f"raw TCP 8 B ping-pong: {(time.perf_counter()-t)/n/2*1e6:.1f} us one-way")
l2 = socket.socket(); l2.bind(('127.0.0.1', 0)); l2.listen(1)
def sink(l):
    c, _ = l.accept()
    while c.recv(1 << 20): pass
threading.Thread(target=sink, args=(l2,), daemon=True).start()
s2 = socket.create_connection(l2.getsockname()); buf = b'x' * 65536; total = 2000 * 65536
t = time.perf_counter()
for _ in range(2000): s2.sendall(buf)
s2.close(); dt = time.perf_counter() - t
print(f"raw TCP 64 KiB stream: {total/dt/2**20:.0f} MB/s")
PY

run() { # door dev addr
    local door=$1 dev=$2 addr=$3 env=(KRDMA_DEVICE=$1)
    [ "$door" = embedded ] || env=(KRDMA_DEVICE=$T/krdma)
    env "${env[@]}" KRDMA_RXE_ADDR=127.0.0.81 dapltest -T S -D krdma-$dev >/dev/null 2>&1 &
    local srv=$!; sleep 1
    env "${env[@]}" KRDMA_RXE_ADDR=127.0.0.82 dapltest -T P -D krdma-$dev -s $addr -i 4000 RW 65536 1 | grep -E "Bandwidth" | sed "s/^/$dev $door dapltest -T P RW 64 KiB: /"
    env "${env[@]}" KRDMA_RXE_ADDR=127.0.0.82 dapltest -T Q -D krdma-$dev -s $addr >/dev/null 2>&1 || true
    wait $srv || true
    env "${env[@]}" KRDMA_RXE_ADDR=127.0.0.81 dtest -P krdma-$dev -s -b 8 >/dev/null 2>&1 &
    srv=$!; sleep 1
    env "${env[@]}" KRDMA_RXE_ADDR=127.0.0.82 dtest -P krdma-$dev -h $addr -b 8 | grep "Message PingPong" | sed "s/^[0-9]*: /$dev $door dtest 8 B /"
    wait $srv || true
}
echo "== krdma uDAPL"
run embedded siw0 127.0.0.1
run embedded rxe0 127.0.0.81
if [ "$(id -u)" = 0 ]; then
    ./target/release/krdmad --device $T/krdma --rxe-addr 127.0.0.80 >/dev/null 2>&1 &
    DAEMON=$!; sleep 2
    run daemon siw0 127.0.0.1
    run daemon rxe0 127.0.0.80
fi
