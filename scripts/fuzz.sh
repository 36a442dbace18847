#!/usr/bin/env bash
# Coverage-guided fuzzing of krdma's parsers and engines (cargo-fuzz, libFuzzer).
#
#   bash scripts/fuzz.sh short [seconds]        every target for a short while (default 15 s
#                                               each; part of scripts/test.sh); fails on any
#                                               crash, and first replays every stored crash
#   bash scripts/fuzz.sh long TARGET [seconds]  one target for long (default 3600 s); new
#                                               corpus entries land in tests/fuzz/corpus
#   bash scripts/fuzz.sh seed                   (re)write the corpora seeded from the captures
#   bash scripts/fuzz.sh list                   the targets
#
# The corpora under tests/fuzz/corpus/<target>/ are kept in the repository; a crash found
# by a long run lands in tests/fuzz/artifacts/<target>/ and belongs in the repository too,
# next to the fix: every short run replays it.
#
# No sanitizer: AddressSanitizer needs a nightly compiler, which these machines do not
# have. The targets check what matters themselves (no panic, no write outside a
# registration) and the code under test has no `unsafe` on the paths fuzzed.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_DIR=tests/fuzz

command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked

targets() { sed -n 's/^name = "\(.*\)"$/\1/p' "$FUZZ_DIR/Cargo.toml" | grep -v '^krdma-fuzz$'; }

run() { # target, extra libFuzzer args...
    local t=$1; shift
    local work rc=0; work=$(mktemp -d)
    mkdir -p "$FUZZ_DIR/corpus/$t" "$FUZZ_DIR/artifacts/$t"
    # New inputs go to the scratch directory first; the kept corpus is read, not written.
    cargo fuzz run --fuzz-dir "$FUZZ_DIR" -s none "$t" "$work" "$FUZZ_DIR/corpus/$t" -- \
        -rss_limit_mb=4096 -timeout=10 -artifact_prefix="$FUZZ_DIR/artifacts/$t/" "$@" || rc=$?
    rm -rf "$work"
    return $rc
}

replay() { # target: every stored crash must now pass
    local t=$1
    local dir="$FUZZ_DIR/artifacts/$t"
    [ -d "$dir" ] || return 0
    local files=("$dir"/*)
    [ -e "${files[0]}" ] || return 0
    echo "replaying ${#files[@]} stored artifact(s) of $t"
    cargo fuzz run --fuzz-dir "$FUZZ_DIR" -s none "$t" "${files[@]}" -- -runs=1
}

case "${1:-short}" in
short)
    secs=${2:-${FUZZ_SECONDS:-15}}
    cargo fuzz build --fuzz-dir "$FUZZ_DIR" -s none
    for t in $(targets); do
        replay "$t"
        echo "fuzzing $t for ${secs}s"
        log=$(mktemp)
        if ! run "$t" -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1; then
            tail -n 60 "$log" >&2
            echo "fuzz target $t failed; the input is in $FUZZ_DIR/artifacts/$t/" >&2
            exit 1
        fi
        grep -E "^stat::(number_of_executed_units|peak_rss_mb)" "$log" | tr '\n' ' '
        echo
        rm -f "$log"
    done
    ;;
long)
    t=${2:?target}
    secs=${3:-3600}
    mkdir -p "$FUZZ_DIR/artifacts/$t"
    cargo fuzz run --fuzz-dir "$FUZZ_DIR" -s none "$t" "$FUZZ_DIR/corpus/$t" -- \
        -rss_limit_mb=4096 -timeout=10 -artifact_prefix="$FUZZ_DIR/artifacts/$t/" \
        -max_total_time="$secs" -print_final_stats=1
    # Keep the kept corpus small: minimise it to the inputs that add coverage.
    cargo fuzz cmin --fuzz-dir "$FUZZ_DIR" -s none "$t" "$FUZZ_DIR/corpus/$t"
    ;;
seed)
    # The capture tests of the providers write what they parse when asked to.
    KRDMA_FUZZ_SEEDS="$PWD/$FUZZ_DIR/corpus" cargo test -q -p krdma-siw -p krdma-rxe --test captures
    # Other targets seed themselves from the captures in their own way (see each target's
    # doc); then every corpus is minimised to the inputs that add coverage.
    for t in $(targets); do
        [ -d "$FUZZ_DIR/corpus/$t" ] && cargo fuzz cmin --fuzz-dir "$FUZZ_DIR" -s none "$t" "$FUZZ_DIR/corpus/$t"
    done
    ;;
list)
    targets
    ;;
*)
    sed -n '2,15p' "$0"
    exit 2
    ;;
esac
