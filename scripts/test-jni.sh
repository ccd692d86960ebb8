#!/usr/bin/env bash
# The JNI libraries (crates/jni) on a real JVM: checks that each .so exports exactly the
# CONTRACT §5 symbols (plus snapshot files and the app-level Engine/Conversation), exports a
# fixture model and the Rust API's ids and tool calls (jni-fixture), compiles the
# Kotlin classes and tests with kotlinc (scripts/setup.sh installs it) and the Java test with javac,
# and runs both against target/debug/libskainet_iree_{kv,redecode}.so, then a 15 s JNI stress test
# (JniStressTest.java; SKAINET_JNI_STRESS_SECONDS / _THREADS, SKAINET_JNI_STRESS_ONLY=1 runs only it).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
start=$SECONDS

KOTLIN_HOME=.tools/kotlin/node_modules/kotlin-compiler
KOTLINC="$KOTLIN_HOME/bin/kotlinc"
STDLIB="$KOTLIN_HOME/lib/kotlin-stdlib.jar"
[ -x "$KOTLINC" ] || { echo "test-jni: $KOTLINC missing; run scripts/setup.sh" >&2; exit 1; }
OUT="${CARGO_TARGET_DIR:-target}/jni-test"
LIBS="${CARGO_TARGET_DIR:-target}/debug"

# With the workspace selected, so that the features resolve for the workspace as `cargo test
# --workspace` resolves them (bar dev-dependencies: a few crates from bindgen up rebuild):
# `-p skainet-iree-kv -p skainet-iree-redecode` resolved them for these packages alone and
# rebuilt 19 crates, kv-core, tokenizer and llguidance among them (~3 min; CI time, issue 34).
cargo build --workspace --lib

# Exactly the ABI of CONTRACT §5 plus IreeKvSnapshotFile, nothing more, nothing less.
prefix=Java_sk_ainet_transformers_iree_android
expect_kv=$( (printf "${prefix}_IreeKvSession_%s\n" nativeCreate nativePrefill nativeChunk nativeStep \
    nativeSnapshot nativeRestore nativeReleaseSnapshot nativeReleasePrefill nativePosition nativeDestroy
    # Beside the seed's ABI: snapshot files (IreeKvSnapshotFile), in the same library.
    printf "${prefix}_IreeKvSnapshotFile_%s\n" nativeSave nativeLoad nativeSnapshotPosition
    # And the app-level API (Engine, Conversation: docs/android.md).
    printf "${prefix}_Engine_%s\n" nativeOpen nativeInfo nativeClose nativeBeginDeviceProfile nativeEndDeviceProfile
    printf "${prefix}_Conversation_%s\n" nativeCreate nativeCatalogSource nativeSend nativeCancel \
        nativeSaveCatalog nativeClose) | sort)
expect_redecode=$(printf "${prefix}_IreeRedecodeSession_%s\n" nativeCreate nativeCreateWithTopology \
    nativeStep nativeDestroy | sort)
check_exports() { # lib expected [nm]
    local got
    got=$("${3:-nm}" -D --defined-only "$1" | grep ' T Java_' | awk '{print $3}' | sort)
    if [ "$got" != "$2" ]; then
        echo "test-jni: $1 exports differ from CONTRACT §5:" >&2
        diff <(echo "$2") <(echo "$got") >&2 || true
        exit 1
    fi
    echo "test-jni: $1 exports exactly $(echo "$got" | wc -l) JNI symbols"
}
check_exports "$LIBS/libskainet_iree_kv.so" "$expect_kv"
check_exports "$LIBS/libskainet_iree_redecode.so" "$expect_redecode"

# The same for the helper binary alone: only skainet-jni is rebuilt, with its `fixture` feature.
cargo build -q --workspace --bin jni-fixture --features skainet-jni/fixture
"$LIBS/jni-fixture" "$OUT/fixture"

rm -rf "$OUT/classes"
mkdir -p "$OUT/classes"
echo "test-jni: kotlinc"
# kotlinc's own status decides (a pipe into grep would hide it): a failed compile that left
# classes of an earlier run behind, or wrote some before failing, is still a failure.
kotlinc_log="$OUT/kotlinc.log"
kotlinc_status=0
"$KOTLINC" -nowarn -jvm-target 17 -d "$OUT/classes" kotlin/src/main/kotlin kotlin/src/test/kotlin \
    >"$kotlinc_log" 2>&1 || kotlinc_status=$?
grep -v '^warning: unable to find kotlin-stdlib' "$kotlinc_log" || true
if [ "$kotlinc_status" -ne 0 ]; then
    echo "test-jni: kotlinc failed (exit $kotlinc_status)" >&2
    exit 1
fi
[ -f "$OUT/classes/sk/ainet/transformers/iree/android/JniTestKt.class" ] || { echo "test-jni: kotlinc wrote no JniTestKt.class" >&2; exit 1; }
javac -d "$OUT/classes" -cp "$OUT/classes:$STDLIB" $(find kotlin/src/test/java -name '*.java')

run() {
    java -Xcheck:jni -Djava.library.path="$LIBS" -cp "$OUT/classes:$STDLIB" "$@" "$OUT/fixture/fixture.properties"
}
if [ -z "${SKAINET_JNI_STRESS_ONLY:-}" ]; then
    run sk.ainet.transformers.iree.android.JniTestKt
    run sk.ainet.transformers.iree.android.JavaInteropTest
    # The app-level API; its quickstart must be docs/android.md's, line for line.
    quickstart() { sed -n '/quickstart:begin/,/quickstart:end/p' "$1" | sed '1d;$d'; }
    if ! diff <(quickstart kotlin/src/test/kotlin/sk/ainet/transformers/iree/android/JniEngineTest.kt) \
        <(quickstart docs/android.md) >&2; then
        echo "test-jni: docs/android.md's quickstart differs from the one JniEngineTest.kt runs" >&2
        exit 1
    fi
    run sk.ainet.transformers.iree.android.JniEngineTestKt
fi
# 8 threads creating, using, snapshotting, restoring, releasing and destroying sessions at random
# with wrong handles mixed in (scripts/stress-jni.sh runs it for minutes). A fixed Java heap keeps
# the RSS it samples about native memory.
# The library logs every refused call to stderr: kept in a file, shown when the test fails.
stress_log="$OUT/stress-stderr.log"
if ! run -Xms64m -Xmx64m -Dskainet.stress.seconds="${SKAINET_JNI_STRESS_SECONDS:-15}" \
    -Dskainet.stress.threads="${SKAINET_JNI_STRESS_THREADS:-8}" sk.ainet.transformers.iree.android.JniStressTest \
    2>"$stress_log"; then
    tail -40 "$stress_log" >&2
    echo "test-jni: stress test failed (stderr in $stress_log)" >&2
    exit 1
fi
echo "test-jni: stress stderr: $(wc -l <"$stress_log") lines ($(grep -c '^E/' "$stress_log" || true) refused calls logged)"
echo "test-jni: passed in $((SECONDS - start)) s"
