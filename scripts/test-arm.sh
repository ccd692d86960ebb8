#!/usr/bin/env bash
# ARM: the pure-Rust crates' tests cross-built for aarch64 and armv7 Linux and run under
# qemu-user (long run only: SKAINET_ARM_LONG=1, scripts/test-long.sh arm); the IREE runtime
# cross-built for aarch64 Linux with the JNI libraries linked against it and their exports checked, and the IREE conformance suite run on it (aarch64 modules,
# local-sync and local-task) under qemu-user; the Android targets built as far as this machine
# allows (no NDK: the pure-Rust crates compile for them, nothing native is linked). scripts/setup.sh installs the
# cross compilers, qemu and the Rust targets.
#
# Linkers and runners are set here, per target, not in a cargo config, so host builds are unaffected.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
start=$SECONDS
stage() { echo "test-arm: $* ($((SECONDS - start)) s)"; }

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -L /usr/aarch64-linux-gnu"
export CARGO_TARGET_ARMV7_UNKNOWN_LINUX_GNUEABIHF_LINKER=arm-linux-gnueabihf-gcc
export CARGO_TARGET_ARMV7_UNKNOWN_LINUX_GNUEABIHF_RUNNER="qemu-arm-static -L /usr/arm-linux-gnueabihf"
# The conformance problems draw from a fresh seed each run, printed with the command that replays
# it (SKAINET_CONFORMANCE_SEED=N); set it to repeat a run.

# 1. Pure-Rust tests under qemu (the conformance suite without its IREE backends): kv-core,
#    fixtures and the reference's own tests on armv7 (32-bit sizes, where portability bugs live)
#    and aarch64, and the conformance suite's reference and property tests on both. Long only
#    (scripts/test-long.sh arm): armv7's took 176 s of a fresh CI run (session 26), and CI keeps
#    32-bit Android type-checked (stage 4) and the aarch64 reference running under qemu (stage 3:
#    iree_arm compares every IREE call with it).
targets=()
[ -n "${SKAINET_ARM_LONG:-}" ] && targets=(aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf)
for target in "${targets[@]}"; do
    stage "$target: kv-core, fixtures, backend-reference tests"
    # Not the doc-tests (cargo runs cross doc-tests since 1.89): the host's run covers them.
    cargo test --target "$target" -p kv-core -p fixtures -p backend-reference --lib --tests
    if [ -n "${SKAINET_ARM_LONG:-}" ]; then
        stage "$target: conformance reference + properties (--no-default-features)"
        cargo test --target "$target" -p conformance --no-default-features --test reference --test properties
    fi
done

# 2. The IREE runtime cross-built for aarch64 Linux, and the JNI libraries linked against it.
target=aarch64-unknown-linux-gnu
export CMAKE_TOOLCHAIN_FILE="$PWD/crates/jni/cmake/aarch64-linux-gnu.cmake"
export IREE_HOST_BIN_DIR="$PWD/.tools/venv/bin"
export BINDGEN_EXTRA_CLANG_ARGS_aarch64_unknown_linux_gnu="--sysroot=/usr/aarch64-linux-gnu"
stage "$target: IREE runtime + JNI libraries"
# The JNI libraries and stage 3's suite select the same packages, so that their shared crates
# resolve one set of features and build once for this target (CI time, issue 34).
arm_packages=(-p skainet-iree-kv -p skainet-iree-redecode -p conformance)
cargo build --target "$target" "${arm_packages[@]}"
prefix=Java_sk_ainet_transformers_iree_android
# Per library: each class's count of exports and the total (the kv library also exports
# IreeKvSnapshotFile's 3 methods and the app-level Engine's 5 and Conversation's 6 beside the seed's 10).
for lib in "kv:24:IreeKvSession=10 IreeKvSnapshotFile=3 Engine=5 Conversation=6" "redecode:4:IreeRedecodeSession=4"; do
    IFS=: read -r name total classes <<<"$lib"
    so="${CARGO_TARGET_DIR:-target}/$target/debug/libskainet_iree_$name.so"
    file "$so" | grep -q 'ARM aarch64' || { echo "test-arm: $so is not an aarch64 ELF" >&2; exit 1; }
    got=$(aarch64-linux-gnu-nm -D --defined-only "$so" | grep ' T Java_' | awk '{print $3}')
    ok=$([ "$(echo "$got" | wc -l)" = "$total" ] && echo yes || echo no)
    for entry in $classes; do
        class=${entry%=*} count=${entry#*=}
        [ "$(echo "$got" | grep -c "^${prefix}_${class}_")" = "$count" ] || ok=no
    done
    if [ "$ok" != yes ]; then
        echo "test-arm: $so exports:" >&2; echo "$got" >&2; exit 1
    fi
    echo "test-arm: $so: aarch64, exactly $total JNI exports"
done

# 3. The IREE conformance suite on that runtime, under qemu (crates/conformance/tests/iree_arm.rs):
#    the fixtures' graphs compiled for the aarch64 triple (the emulated test binary runs the host's
#    iree-compile; exports are cached in .cache/artifacts), run on local-sync and local-task and
#    compared with the FP32 reference like on x86. Fewer property cases than on x86 (qemu is slow).
stage "$target: IREE conformance on local-sync and local-task under qemu"
# SKAINET_ARM_LONG=1 (scripts/test-long.sh arm) adds the problems CI leaves to local-task.
SKAINET_IREE_CASES="${SKAINET_IREE_ARM_CASES:-2}" cargo test --target "$target" "${arm_packages[@]}" --test iree_arm \
    ${SKAINET_ARM_LONG:+-- --include-ignored}
# The app-level API's Rust side (crates/jni/tests/app.rs: the quickstart, cancel and a catalog file
# through skainet_jni::app on the android-arm64 contract 2 export). Long only: building the test
# (llguidance, the exporter) for aarch64 took 512 s cold on 2 loaded cores; the run took 57 s.
if [ -n "${SKAINET_ARM_LONG:-}" ]; then
    stage "$target: the app-level API (Engine, Conversation) under qemu"
    cargo test --target "$target" -p skainet-jni --features fixture --test app
fi
unset CMAKE_TOOLCHAIN_FILE

# 4. Android: no NDK here, so no .so can be linked and the IREE runtime cannot be cross-built;
#    the pure-Rust crates are type-checked for both Android ABIs (`cargo check`: what the target
#    changes is cfg'd code and type sizes, which checking sees; their machine code is the Linux
#    targets', built and run above).
for target in aarch64-linux-android armv7-linux-androideabi; do
    stage "$target: check kv-core, backend-reference (no native code)"
    cargo check --target "$target" -p kv-core -p backend-reference
done
stage "passed"
