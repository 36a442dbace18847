#!/usr/bin/env bash
# The main job: installs what the build needs (scripts/build-deps.sh), then runs
# `krdma demo` — real RDMA traffic over siw0 and rxe0 on loopback (embedded kAL), with
# bandwidth and latency against raw TCP and UDP measured in the same run. Arguments go
# to `krdma demo` (e.g. --markdown).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/build-deps.sh
exec cargo run --release --bin krdma -- demo "$@"
