#!/usr/bin/env bash
# Every test of the project, from a fresh machine: installs the tools, then checks format and lints
# and runs the whole test suite (kv-core, reference, conformance on every backend, export, IREE).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source scripts/env.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# One test thread: IREE sessions opened concurrently on several threads of one process
# intermittently fail with "ref type mismatch" at module init (seen ~1 in 6 runs of the
# three-session conformance suite; never single-threaded). Tracked as an open bug, not hidden:
# see the closing note and docs/benchmarks.md.
RUST_TEST_THREADS=1 cargo test --workspace
./scripts/test-jni.sh
./scripts/test-arm.sh
