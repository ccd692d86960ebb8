#!/usr/bin/env bash
# Fuzzes the readers of untrusted files with cargo-fuzz (libFuzzer + AddressSanitizer):
#   irpa            the .irpa reader (kv_core::irpa) and its writer round trip
#   gguf            the GGUF reader, tensor slices, dequantization, the importer's config reader
#   tokenizer_gguf  Tokenizer::from_gguf on arbitrary metadata, then encode/decode
#   tokenizer_text  the two real vocabularies on arbitrary text (encode/decode round trip)
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     (default: 20 s per target, every target)
#
# Seeds come from real inputs (fuzz/seed-gen: IREE's golden archive, the fixtures' archives,
# GgufWriter files of every type, the real models' headers and vocabularies, llama.cpp's golden
# texts) into .cache/fuzz/seeds; the corpus grows in .cache/fuzz/corpus, crashes land in
# .cache/fuzz/artifacts/TARGET/. A crash, an out-of-bounds access, a leak, a single allocation
# above -malloc_limit_mb or RSS above -rss_limit_mb fails the script. Only one Rust toolchain
# (stable) exists here: cargo-fuzz's nightly flags are allowed with RUSTC_BOOTSTRAP=1.
# scripts/setup.sh installs cargo-fuzz into .tools/cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
start=$SECONDS

secs="${1:-20}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(irpa gguf tokenizer_gguf tokenizer_text)
CARGO_FUZZ=.tools/cargo/bin/cargo-fuzz
[ -x "$CARGO_FUZZ" ] || { echo "fuzz: $CARGO_FUZZ missing; run scripts/setup.sh" >&2; exit 1; }
export PATH="$PWD/.tools/cargo/bin:$PATH" RUSTC_BOOTSTRAP=1
target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
fuzz_dir="$PWD/.cache/fuzz"
# Limits: the largest seed is ~640 KB; no reader may allocate 64 MiB at once from such an input.
limits=(-rss_limit_mb=2048 -malloc_limit_mb=64 -timeout=10)

echo "fuzz: seeds"
# seed-gen is a member of the main workspace (not of fuzz/'s), run as its test with the whole
# workspace selected: the features then resolve as in `cargo test --workspace`, whose build it
# reuses (`cargo run -p seed-gen` resolved them for seed-gen alone and rebuilt ~4 min of crates).
SEED_GEN_OUT="$fuzz_dir/seeds" nice -n 10 cargo test -q --workspace --test seeds -- --nocapture 2>&1 |
    grep '^seed-gen:' || { echo "fuzz: seed-gen failed" >&2; exit 1; }
echo "fuzz: building ${targets[*]} ($((SECONDS - start)) s)"
nice -n 10 cargo fuzz build --target-dir "$target_dir/fuzz"

summary=()
for t in "${targets[@]}"; do
    corpus="$fuzz_dir/corpus/$t"
    mkdir -p "$corpus" "$fuzz_dir/artifacts/$t"
    log="$fuzz_dir/$t.log"
    echo "fuzz: $t for $secs s ($((SECONDS - start)) s)"
    if ! nice -n 10 cargo fuzz run --target-dir "$target_dir/fuzz" "$t" "$corpus" "$fuzz_dir/seeds/$t" -- \
        -max_total_time="$secs" -print_final_stats=1 "${limits[@]}" \
        -artifact_prefix="$fuzz_dir/artifacts/$t/" >"$log" 2>&1; then
        grep -v '^#' "$log" | tail -60 >&2
        echo "fuzz: $t FAILED (log $log, inputs in $fuzz_dir/artifacts/$t/)" >&2
        exit 1
    fi
    runs=$(awk '/stat::number_of_executed_units/{print $2}' "$log")
    rss=$(awk '/stat::peak_rss_mb/{print $2}' "$log")
    # libFuzzer's own count (seeds that add coverage and the units it found), then what is on disk.
    corp=$(grep -o 'DONE .*corp: [0-9]*/[0-9a-zA-Z]*' "$log" | tail -1 | sed 's/.*corp: //')
    cov=$(grep -o 'DONE *cov: [0-9]*' "$log" | tail -1 | sed 's/.*cov: //')
    files=$(find "$corpus" -type f | wc -l)
    summary+=("$t: $runs executions in $secs s, corpus $corp (units/size; $files kept in $corpus), coverage $cov edges, peak RSS $rss MB")
done
printf 'fuzz: %s\n' "${summary[@]}"
echo "fuzz: passed in $((SECONDS - start)) s"
