#!/bin/sh
# Run inside the interop guest (busybox sh) by scripts/interop-mlx.sh: krdma over the
# kernel's device through the mlx provider (DEV, e.g. ibv-rxe0) against rdma-core's own
# tools on the same kernel device, in both roles — ibv_rc_pingpong, perftest 4.5 with and
# without -R, rping. Expects /mnt/host/bin/krdma. Prints "RDMACORE OK" when all passed.
set -u
DEV=${DEV:-ibv-rxe0}
KDEV=${DEV#ibv-}
K="env KRDMA_RXE=off /mnt/host/bin/krdma"
IP=10.77.0.11
N=${N:-50}
ok=0 bad=0 port=19000
# pair NAME 'SERVER CMD' 'CLIENT CMD': the server first, both must exit 0.
pair() {
    name=$1
    sh -c "$2" >/tmp/$name.server 2>&1 &
    sp=$!
    sleep 2
    if sh -c "$3" >/tmp/$name.client 2>&1 && wait $sp; then
        echo "RDMACORE PASS $name"; ok=$((ok + 1))
    else
        echo "RDMACORE FAIL $name"; bad=$((bad + 1))
        tail -n 4 /tmp/$name.server /tmp/$name.client
        kill $sp 2>/dev/null; wait $sp 2>/dev/null
    fi
    port=$((port + 1))
}
if [ "$KDEV" = rxe0 ]; then
    # The guest's IPv4 GID is index 1.
    pair pingpong-rdmacore-server "ibv_rc_pingpong -d rxe0 -g 1 -n $N -p $port" \
        "$K pingpong -d $DEV -g 1 -n $N -p $port $IP"
    pair pingpong-krdma-server "$K pingpong -d $DEV -g 1 -n $N -p $port" \
        "ibv_rc_pingpong -d rxe0 -g 1 -n $N -p $port $IP"
    cms="none -R" X="-x 1"
else
    cms="-R" X="" # iWARP: connection management only, no GID index to choose
fi
for cm in $cms; do
    [ "$cm" = none ] && cm=""
    for t in write_bw read_bw send_bw send_lat; do
        k=$(echo $t | tr _ -)
        pair "perf-$k-rdmacore-server${cm:+-cm}" "ib_$t -d $KDEV $X $cm -n $N -p $port" \
            "$K perf $k -d $DEV $X $cm -n $N -p $port $IP"
        pair "perf-$k-krdma-server${cm:+-cm}" "$K perf $k -d $DEV $X $cm -n $N -p $port" \
            "ib_$t -d $KDEV $X $cm -n $N -p $port $IP"
    done
done
pair rping-rdmacore-server "rping -s -a $IP -p $port -C 5 -v" \
    "$K rping -c -a $IP -p $port -C 5 -v -V --device $DEV"
pair rping-krdma-server "$K rping -s -a $IP -p $port -C 5 -v --device $DEV" \
    "rping -c -a $IP -p $port -C 5 -v -V"
# uDAPL: dtest through the guest's libdaplofa (its /etc/dat.conf entry ofa-v2-eth0) against
# dtest through krdma's DAT provider on the same device (/mnt/host/bin/dat.conf names it
# ofa-v2-eth0 too: dtest's client takes the provider name from its server). dtest exits 0
# when it fails; a side passes only when it says PASSED.
if [ -f /mnt/host/bin/dat.conf ]; then
    D="dtest -P ofa-v2-eth0 -b 4096 -B 10"
    KD="env DAT_OVERRIDE=/mnt/host/bin/dat.conf KRDMA_RXE=off $D"
    passed() { echo "$1 >/tmp/dt.\$\$ 2>&1; grep -q 'Complete. PASSED' /tmp/dt.\$\$"; }
    pair dapl-ofa-server "$(passed "$D -s")" "$(passed "$KD -h $IP")"
    pair dapl-krdma-server "$(passed "$KD -s")" "$(passed "$D -h $IP")"
fi
echo "RDMACORE RESULT $ok passed, $bad failed"
[ $bad = 0 ] && echo "RDMACORE OK"
