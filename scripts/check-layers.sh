#!/usr/bin/env bash
# The crate graph follows the OpenRDMA layers (docs/architecture.md, "Crates"); cargo's own
# dependency tree is the evidence, checked on every test run:
#  - the kAL names no provider and no tool; the ABI crate names neither kAL nor uAL;
#  - the uAL, IT-API, uDAPL provider and SDP preload library built without their default
#    `embedded` feature link no kAL, no engine (siw, rxe) and no FUSE: such a libitapi.so
#    reaches RDMA only through /dev/krdma and, for devices whose fast path is the
#    consumer's, through their user verbs provider (mlx's user half, rnicpi::user);
#  - and they still compile that way.
set -euo pipefail
cd "$(dirname "$0")/.."

fail=0
deps() { cargo tree -q -e normal --prefix none "$@" | sed 's/ .*//' | sort -u; }
forbid() { # package, pattern, extra cargo-tree args...
    local pkg=$1 pat=$2; shift 2
    local hit
    hit=$(deps -p "$pkg" "$@" | grep -Ex "$pat" || true)
    if [ -n "$hit" ]; then
        echo "layering: $pkg $* depends on: $(echo $hit)" >&2
        fail=1
    fi
}
forbid krdma-abi 'krdma-(kal|ual|siw|rxe|mlx|stack|tools)'
forbid krdma-kal 'krdma-(ual|siw|rxe|mlx|stack|tools)|clap'
for p in krdma-ual krdma-itapi krdma-itapi-capi krdma-dapl-provider krdma-sdp-preload; do
    forbid "$p" 'krdma-(kal|siw|rxe|stack|tools)|fuser|clap' --no-default-features
done
[ $fail = 0 ] || exit 1
cargo check -q --profile ci -p krdma-ual -p krdma-itapi-capi -p krdma-dapl-provider \
    -p krdma-sdp-preload --no-default-features
bash "$(dirname "$0")/crate-graph.sh" --check
echo "layering: ok"
