# What the benchmark scripts that write a generated block of docs/benchmarks.md share.
# Sourced (from the repository's root) by scripts/bench.sh, bench-fastpath.sh,
# bench-libfabric.sh and bench-sdp.sh.

# The short commit measured, marked when the code (not docs/) has uncommitted changes.
bench_commit() {
    local c
    c=$(git rev-parse --short HEAD)
    git diff --quiet HEAD -- . ':!docs' || c="$c (with uncommitted changes)"
    echo "$c"
}

# A / B to two decimals, then SUFFIX (if given); "—" when either is missing or not positive.
bench_ratio() { # A B [SUFFIX]
    awk -v a="$1" -v b="$2" -v s="${3:-}" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f%s", a / b, s; else print "—" }'
}

# Wait up to 10 s for krdmad to serve DEV (a krdma FUSE mount there, not just the file
# it creates first); fail with a message otherwise.
bench_wait_served() { # DEV
    for _ in $(seq 100); do
        awk -v d="$1" '$1 == "krdma" && $2 == d { found = 1 } END { exit !found }' /proc/mounts && return 0
        sleep 0.1
    done
    echo "krdmad did not serve $1 (root and FUSE needed)" >&2
    return 1
}

# The CPU model, as /proc/cpuinfo names it.
bench_cpu() {
    sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1
}

# Replace the block between the `NAME:begin` and `NAME:end` markers of docs/benchmarks.md
# with the contents of FILE (which carries the markers itself).
bench_write_block() { # NAME FILE
    python3 - "$1" "$2" docs/benchmarks.md <<'PY'
import re, sys
name, block, path = sys.argv[1], open(sys.argv[2]).read().rstrip("\n"), sys.argv[3]
doc = open(path).read()
pat = re.compile(r"<!-- %s:begin.*?<!-- %s:end -->" % (name, name), re.S)
if not pat.search(doc):
    sys.exit("%s has no %s:begin/%s:end block" % (path, name, name))
open(path, "w").write(pat.sub(lambda _: block, doc, count=1))
PY
    echo "docs/benchmarks.md: generated $1 block replaced" >&2
}
