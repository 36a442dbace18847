#!/usr/bin/env bash
# What building krdma needs beyond a Rust toolchain, installed when missing (Debian; as
# root): a C compiler, and for providers/mlx — whose binding, rdma-mummy-sys, compiles
# small dlopen stubs with cmake and generates its bindings with libclang — cmake and
# libclang. rdma-core itself is NOT needed to build or run (libibverbs is loaded at run
# time when present). Sourced by scripts/demo.sh and scripts/test.sh.
build_apt=()
command -v cc >/dev/null || build_apt+=(gcc)
command -v cmake >/dev/null || build_apt+=(cmake)
# The package, not just a libclang.so: bindgen also needs clang's own headers
# (libclang-common-*-dev), which a runtime-only libclang lacks.
dpkg-query -W -f='${Status}' libclang-dev 2>/dev/null | grep -q 'ok installed' || build_apt+=(libclang-dev)
if [ ${#build_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${build_apt[@]}" >/dev/null
    else
        echo "krdma needs ${build_apt[*]} to build (install them as root: apt-get install ${build_apt[*]})" >&2
        exit 1
    fi
fi
