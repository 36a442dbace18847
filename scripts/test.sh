#!/usr/bin/env bash
# Runs every test of the workspace. Installs what the tests need first (idempotent), so it
# works on a fresh machine. Tests that need root + FUSE run when we are root (CI is root)
# and fail loudly under CI=true when those are missing, never silently skip there.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/build-deps.sh

need_apt=()
command -v tshark >/dev/null || need_apt+=(tshark)
command -v setpriv >/dev/null || need_apt+=(util-linux)
command -v nm >/dev/null || need_apt+=(binutils)
# scripts/crate-graph.sh (run by the layering check) reads cargo metadata with python3.
command -v python3 >/dev/null || need_apt+=(python3)
command -v ethtool >/dev/null || need_apt+=(ethtool)
command -v ip >/dev/null || need_apt+=(iproute2)
# Debian's uDAPL: libdat2 and the unmodified test programs the dapl tests run.
# (Each checked by what it ships: a machine may hold the programs without the headers.)
command -v dtest >/dev/null || need_apt+=(dapl2-utils libdapl2)
[ -e /usr/include/dat2/udat.h ] || need_apt+=(libdapl-dev)
command -v stdbuf >/dev/null || need_apt+=(coreutils)
# Unmodified programs the SDP preload library is tested with (tests/tests/sdp_programs.rs).
command -v iperf3 >/dev/null || need_apt+=(iperf3)
command -v sockperf >/dev/null || need_apt+=(sockperf)
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-benchmark >/dev/null || need_apt+=(redis-tools)
[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null || need_apt+=(nginx)
command -v curl >/dev/null || need_apt+=(curl)
command -v wrk >/dev/null || need_apt+=(wrk)
# providers/mlx: its tests resolve symbols in the installed libibverbs/librdmacm (no RDMA
# device is needed: none are listed).
[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || [ -e /usr/lib64/libibverbs.so.1 ] || need_apt+=(libibverbs1 ibverbs-providers)
[ -e /usr/lib/x86_64-linux-gnu/librdmacm.so.1 ] || [ -e /usr/lib64/librdmacm.so.1 ] || need_apt+=(librdmacm1)
if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
    else
        echo "note: missing ${need_apt[*]} (install them as root for the full suite)" >&2
    fi
fi
command -v cargo-nextest >/dev/null || cargo install cargo-nextest --locked

# The FUSE daemon tests mount private instances under /tmp; make sure /dev/fuse exists.
if [ "$(id -u)" = 0 ] && [ ! -e /dev/fuse ]; then
    mknod -m 666 /dev/fuse c 10 229 || true
fi
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# `ci` profile: optimised (the data path is exercised with real traffic) but with debug
# assertions and overflow checks on.
cargo test --workspace --doc --profile ci
# The end-to-end tests run the workspace's programs (krdmad, krdma, ...) and load its
# libraries (the DAT provider, the SDP preload library) from target/ci:
# build them all first (cargo builds a package's binaries for tests of that package only).
cargo build --workspace --lib --bins --profile ci
# The crates follow the layers (no provider in the kAL, none in a daemon-only uAL); its
# compile check reuses the dependencies just built.
bash scripts/check-layers.sh
cargo nextest run --workspace --cargo-profile ci --no-fail-fast "$@"

# Short coverage-guided fuzz runs of every target (replaying every stored crash first).
bash scripts/fuzz.sh short
