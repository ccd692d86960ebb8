#!/usr/bin/env bash
# Every test of the project, from a fresh machine: installs the tools, then checks format and lints
# and runs the whole test suite (kv-core, reference, conformance on every backend, export, IREE),
# the JNI tests (with a short stress run), the ARM tests under qemu and a short fuzzing run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source scripts/env.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
./scripts/test-jni.sh
./scripts/test-arm.sh
./scripts/fuzz.sh "${SKAINET_FUZZ_SECONDS:-20}"
