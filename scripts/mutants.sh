#!/usr/bin/env bash
# Mutation testing (docs/testing.md, "Mutation testing"): how many small bugs planted in the code
# whose bugs would be silent the tests catch. cargo-mutants, pinned, from crates.io into
# .tools/cargo; not part of CI (each mutant is a rebuild: hours for the whole set on 2 cores).
#
#   scripts/mutants.sh                 every mutant of the files below
#   scripts/mutants.sh diverge         only kv-core/src/diverge.rs (75 mutants, 10-25 min on 2 cores)
#   scripts/mutants.sh shared [ARGS]   the other files; ARGS go to cargo-mutants, e.g.
#                                      --shard 0/10 --sharding round-robin (a tenth, mutant i
#                                      on shard i % 10: spread over every file)
#                                      or -F 'top_k' (mutants whose name matches)
#
# The mutated code: kv-core's window plans, masks, RoPE, the diverge judge, sampling and
# snapshot files, and the reference backend's forward. The tests: kv-core's, backend-reference's
# and the conformance suite on the reference backend (`--no-default-features`: without the `iree`
# feature the suite builds no IREE, and its IREE suites compile to nothing). diverge.rs runs
# against kv-core's tests only: no other of those crates calls it, so the rest could catch
# nothing more and would only cost a rebuild per mutant.
#
# Results land in .cache/mutants/GROUP/mutants.out (caught.txt, missed.txt, timeout.txt,
# unviable.txt, outcomes.json); the script exits non-zero when a mutant was missed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

CARGO_MUTANTS_VERSION=27.1.0
if [ "$(.tools/cargo/bin/cargo-mutants mutants --version 2>/dev/null | awk '{print $2}')" != "$CARGO_MUTANTS_VERSION" ]; then
    echo "mutants: cargo install cargo-mutants@$CARGO_MUTANTS_VERSION"
    cargo install -q --locked --root .tools/cargo "cargo-mutants@$CARGO_MUTANTS_VERSION"
fi
export PATH="$PWD/.tools/cargo/bin:$PATH"
# Debug info stays: conformance's crash_report test reads the faulting test's name from a
# backtrace, which inlined frames lose without it (a build without it failed that test for every
# mutant, so every mutant counted as caught).

group="${1:-all}"
shift || true
case "$group" in
    diverge | shared | all) ;;
    *)
        echo "mutants: unknown group '$group' (diverge, shared or all)" >&2
        exit 2
        ;;
esac
shared_files=(
    -f crates/kv-core/src/window.rs
    -f crates/kv-core/src/mask.rs
    -f crates/kv-core/src/rope.rs
    -f crates/kv-core/src/sampling.rs
    -f crates/kv-core/src/snapshot_file.rs
    -f crates/backend-reference/src/forward.rs
)
# `layer_forward` returns three arrays: cargo-mutants offers the product of ndarray constructors
# for them (1,000 replacements, none of which type-checks: unviable, each a failed build).
# Whole-function replacements of the forward are still tried on every other function.
shared_exclude=(-E 'replace ReferenceModel::layer_forward -> \(Array2<f32>, Array3<f32>, Array3<f32>\) with')
# --gitignore: the scratch copy leaves out .cache and .tools (GBs). --timeout: the baseline
# cargo-mutants times runs only the mutated packages' tests (not conformance's), so its derived
# timeout is no bound for the mutants' runs; the three crates' tests take ~10 s unmutated.
common=(--no-shuffle -j 1 --gitignore true --timeout 120)

run() {
    local name="$1"
    shift
    echo "mutants: $name"
    mkdir -p ".cache/mutants/$name"
    nice -n 10 cargo mutants "${common[@]}" -o ".cache/mutants/$name" "$@"
}

# cargo-mutants checks the unmutated tree with the mutated packages' tests only (not
# conformance's): run all three here first, or a test that always fails would catch every mutant.
echo "mutants: the tests, unmutated"
cargo test -q -p kv-core -p backend-reference -p conformance --no-default-features >/dev/null

status=0
case "$group" in
    diverge | all)
        run diverge -f crates/kv-core/src/diverge.rs --test-package kv-core "$@" || status=$?
        ;;
esac
case "$group" in
    shared | all)
        run shared "${shared_files[@]}" "${shared_exclude[@]}" \
            --test-package kv-core --test-package backend-reference --test-package conformance \
            --no-default-features "$@" || status=$?
        ;;
esac
for out in .cache/mutants/*/mutants.out; do
    [ -d "$out" ] || continue
    printf 'mutants: %s: ' "$(basename "$(dirname "$out")")"
    for kind in caught missed timeout unviable; do
        printf '%s %s  ' "$kind" "$(wc -l <"$out/$kind.txt" 2>/dev/null || echo 0)"
    done
    echo
done
exit "$status"
