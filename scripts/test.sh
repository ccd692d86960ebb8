#!/usr/bin/env bash
# Every test of the project, from a fresh machine: installs the tools, then checks format and lints
# and runs the whole test suite (kv-core, reference, conformance on every backend, export, IREE),
# the JNI tests (with a short stress run), the ARM tests under qemu and a short fuzzing run.
# The long versions (every conformance problem on every suite, many random cases, long fuzzing,
# the concurrent-cache bar) are scripts/test-long.sh. Each stage prints its wall time, so that a
# CI log shows where the budget goes.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
stage() { # NAME COMMAND...
    local name=$1 began=$SECONDS
    shift
    echo "test: $name ..."
    "$@"
    echo "test: $name: $((SECONDS - began)) s (total $((SECONDS - start)) s)"
}
stage setup ./scripts/setup.sh
source scripts/env.sh

stage fmt cargo fmt --all -- --check
stage clippy cargo clippy --workspace --all-targets -- -D warnings
stage "cargo test" cargo test --workspace
stage jni ./scripts/test-jni.sh
stage arm ./scripts/test-arm.sh
stage fuzz ./scripts/fuzz.sh "${SKAINET_FUZZ_SECONDS:-10}"
echo "test: passed in $((SECONDS - start)) s"
