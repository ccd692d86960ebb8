#!/usr/bin/env bash
# The binary under random argument vectors and damaged artifacts (crates/cli/tests/fuzz_cli.rs),
# longer than CI's run: no panic, no signal, no hang, one `error:` line per failure, never exit 0
# with another model's output.
#
#   scripts/fuzz-cli.sh [CASES] [DAMAGED]      (default 400 argument vectors, 60 damaged exports)
#   SKAINET_CLI_FUZZ_SEED=N scripts/fuzz-cli.sh   replays a run (each prints its seed)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
source scripts/env.sh
export SKAINET_CLI_FUZZ_CASES="${1:-400}" SKAINET_CLI_FUZZ_DAMAGE="${2:-60}"
cargo test -p skainet-kv --test fuzz_cli -- --nocapture --test-threads 1
