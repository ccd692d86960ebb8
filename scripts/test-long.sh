#!/usr/bin/env bash
# The long versions of what CI runs short (scripts/test.sh keeps CI inside its time budget):
#   - the conformance problems a suite leaves to another suite in CI (`#[ignore]`d there,
#     `conformance_suite!(.., long: [..])`), here on every suite;
#   - the IREE conformance suites with many more random cases (SKAINET_IREE_CASES, default 50);
#   - the ARM tests with every problem on both executors under qemu (scripts/test-arm.sh), and
#     the app-level API's Rust side (Engine, Conversation) on an android-arm64 export;
#   - the concurrent cache fills at the issue's bar (20 rounds of 6 processes);
#   - the binary under random arguments and damaged artifacts (scripts/fuzz-cli.sh);
#   - a real model's app export (`export --target android-arm64`: SmolLM2-135M compiled for
#     aarch64, its tokenizer copied and read back; crates/cli/tests/android_export.rs);
#   - docs/android.md's Kotlin quickstart on SmolLM2-135M's contract 2 export (host JVM);
#   - the file readers under libFuzzer (scripts/fuzz.sh, 10 minutes a target);
#   - the allowed-token mask's exact ties on lavapipe and the CPU, and a v2 export made before
#     the mask (compiled for the test) refusing one;
#   - `serve` under load (scripts/bench-serve.sh: the fixture and SmolLM2-135M, with and without
#     prefix caching; figures in docs/server.md);
#   - `--model PATH.gguf` on real GGUF files under names the project does not know: a scripted
#     `chat` on IREE CPU (SmolLM2-135M) and Gemma 3 270M's ids equal to its store name's.
# Hours on 2 cores. Each part prints its own seed or figures.
#
#   scripts/test-long.sh [PART...]     PART: conformance | cases | arm | caches | fuzz-cli | android | masks | fuzz | engine | serve | gguf
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
source scripts/env.sh
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(conformance cases arm caches fuzz-cli android masks fuzz engine serve gguf)
for part in "${parts[@]}"; do
    echo "test-long: $part"
    case "$part" in
        conformance) cargo test -p conformance -- --include-ignored ;;
        cases) SKAINET_IREE_CASES="${SKAINET_IREE_CASES:-50}" cargo test -p conformance ;;
        arm) SKAINET_ARM_LONG=1 ./scripts/test-arm.sh ;;
        caches) SKAINET_KV_RACE_ROUNDS="${SKAINET_KV_RACE_ROUNDS:-20}" cargo test -p skainet-kv --test caches ;;
        fuzz-cli) ./scripts/fuzz-cli.sh ;;
        android) cargo test -p skainet-kv --test android_export -- --include-ignored ;;
        gguf) cargo test -p skainet-kv --test gguf_models -- --include-ignored ;;
        engine)
            # docs/android.md's quickstart (Kotlin, host JVM) on SmolLM2-135M's contract 2 export
            # with its tokenizer.gguf: three requests, each the call its words ask for.
            source scripts/env.sh
            out="${CARGO_TARGET_DIR:-target}/jni-test"
            ./scripts/test-jni.sh   # builds the library and the classes the quickstart runs from
            cargo run -q -p skainet-kv -- export --model smollm2-135m --weights q4 --contract 2 --top-k 40 --targets cpu \
                --out "$out/smollm2-engine"
            kotlin=.tools/kotlin/node_modules/kotlin-compiler/lib/kotlin-stdlib.jar
            java -Xcheck:jni -Djava.library.path="${CARGO_TARGET_DIR:-target}/debug" -cp "$out/classes:$kotlin" \
                sk.ainet.transformers.iree.android.JniEngineTestKt --real "$out/smollm2-engine" data/tools/phone-assistant.json ;;
        fuzz) ./scripts/fuzz.sh "${SKAINET_FUZZ_SECONDS:-600}" ;;
        masks)
            cargo test -p export --test v2 -- --ignored allowed_mask
            cargo test -p backend-iree --test v2 -- --ignored v2_exports_before_the_mask ;;
        serve)
            # Bounded: 100 requests on the fixture, 12 on SmolLM2-135M (IREE CPU; ~15 min, an
            # uncached prompt costing ~20 s on a loaded 2-core machine), each with and without the
            # prefix cache; fails on any request that is not answered 200.
            out=$(REQUESTS=100 ./scripts/bench-serve.sh tiny-gemma3:7 | tee /dev/stderr)
            [ "$(grep -c '"statuses":{"200":100}' <<<"$out")" = 4 ]
            out=$(REQUESTS=12 ./scripts/bench-serve.sh smollm2-135m | tee /dev/stderr)
            [ "$(grep -c '"statuses":{"200":12}' <<<"$out")" = 4 ] ;;
        *) echo "test-long: unknown part $part (conformance | cases | arm | caches | fuzz-cli | android | masks | fuzz | engine | serve)" >&2; exit 2 ;;
    esac
done
echo "test-long: passed"
