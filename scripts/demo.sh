#!/usr/bin/env bash
# The main job from a fresh machine: installs the tools, builds, and runs `skainet-kv demo` on the
# embedded tiny model. Extra arguments go to the demo (e.g. --json, --backend iree-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
source scripts/env.sh
cargo run --release -q -p skainet-kv -- demo "$@"
