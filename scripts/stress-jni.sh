#!/usr/bin/env bash
# The JNI stress test (kotlin/src/test/java/.../JniStressTest.java) for longer than CI runs it:
# THREADS threads (default 8) create, use (prefill, chunk, step), snapshot, restore, release and
# destroy KV sessions at random for SECONDS (default 120) with wrong handles mixed in; every wrong
# call must throw, every replayed utterance must give the Rust API's ids, and RSS must stay flat.
#
#   scripts/stress-jni.sh [SECONDS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
SKAINET_JNI_STRESS_ONLY=1 SKAINET_JNI_STRESS_SECONDS="${1:-120}" SKAINET_JNI_STRESS_THREADS="${2:-8}" \
    exec ./scripts/test-jni.sh
