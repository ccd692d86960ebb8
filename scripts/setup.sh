#!/usr/bin/env bash
# Installs every tool the project needs on a fresh Debian 12 machine, idempotently.
# Everything lands under .tools/ (Python venv with the pinned IREE compiler/runtime, cmake, ninja)
# or comes from Debian packages. Source scripts/env.sh afterwards (the other scripts do).
set -euo pipefail
cd "$(dirname "$0")/.."

IREE_VERSION=3.13.0

need_apt=()
# tmux: the pseudo-terminal that crates/cli/tests/chat.rs types `skainet-kv chat` into.
for pkg in clang libclang-dev mesa-vulkan-drivers libvulkan1 vulkan-tools tmux; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup: apt-get install ${need_apt[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

if [ ! -x .tools/venv/bin/python ]; then
    python3 -m venv .tools/venv
fi
want="iree-base-compiler==$IREE_VERSION iree-base-runtime==$IREE_VERSION cmake==3.31.6 ninja==1.13.0 numpy"
if ! .tools/venv/bin/python -c "import iree.compiler, iree.runtime, cmake, ninja, numpy" 2>/dev/null \
   || [ "$(.tools/venv/bin/pip show iree-base-compiler 2>/dev/null | awk '/^Version/{print $2}')" != "$IREE_VERSION" ]; then
    echo "setup: pip install $want"
    .tools/venv/bin/pip install -q --disable-pip-version-check $want
fi
echo "setup: tools ready in .tools/venv"

# JNI tests (scripts/test-jni.sh): kotlinc from npm (Maven Central is not reachable here).
KOTLIN_VERSION=2.4.20
if [ "$(node -p "require('./.tools/kotlin/node_modules/kotlin-compiler/package.json').version" 2>/dev/null)" != "$KOTLIN_VERSION" ]; then
    echo "setup: npm install kotlin-compiler@$KOTLIN_VERSION"
    mkdir -p .tools/kotlin
    npm install --silent --no-audit --no-fund --prefix .tools/kotlin "kotlin-compiler@$KOTLIN_VERSION"
fi

# ARM (scripts/test-arm.sh): Rust targets, cross linkers and libc (g++ for the IREE runtime's CMake
# project), qemu-user.
need_arm=()
for pkg in gcc-aarch64-linux-gnu g++-aarch64-linux-gnu gcc-arm-linux-gnueabihf qemu-user-static libc6-dev-arm64-cross libc6-dev-armhf-cross; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_arm+=("$pkg")
done
if [ ${#need_arm[@]} -gt 0 ]; then
    echo "setup: apt-get install ${need_arm[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_arm[@]}"
fi
arm_targets="aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf aarch64-linux-android armv7-linux-androideabi"
installed_targets=$(rustup target list --installed)
for t in $arm_targets; do
    echo "$installed_targets" | grep -qx "$t" || rustup target add "$t"
done

# Test oracle of crates/gguf (dequantization against the Python `gguf` package on real tensors).
GGUF_PY_VERSION=0.19.0
if [ "$(.tools/venv/bin/pip show gguf 2>/dev/null | awk '/^Version/{print $2}')" != "$GGUF_PY_VERSION" ]; then
    echo "setup: pip install gguf==$GGUF_PY_VERSION"
    .tools/venv/bin/pip install -q --disable-pip-version-check "gguf==$GGUF_PY_VERSION"
fi

# The real client of `skainet-kv serve`: OpenAI's Python package drives the server in
# crates/server/tests/openai_client.rs (scripts/openai-client-test.py).
OPENAI_PY_VERSION=3.51.0
if [ "$(.tools/venv/bin/pip show openai 2>/dev/null | awk '/^Version/{print $2}')" != "$OPENAI_PY_VERSION" ]; then
    echo "setup: pip install openai==$OPENAI_PY_VERSION"
    .tools/venv/bin/pip install -q --disable-pip-version-check "openai==$OPENAI_PY_VERSION"
fi

# Fuzzing (scripts/fuzz.sh): cargo-fuzz from crates.io into .tools/cargo (it runs on the stable
# toolchain with RUSTC_BOOTSTRAP=1; the sanitizer runtimes ship with the stable std).
CARGO_FUZZ_VERSION=0.13.2
if [ "$(.tools/cargo/bin/cargo-fuzz --version 2>/dev/null | awk '{print $2}')" != "$CARGO_FUZZ_VERSION" ]; then
    echo "setup: cargo install cargo-fuzz@$CARGO_FUZZ_VERSION"
    cargo install -q --locked --root .tools/cargo "cargo-fuzz@$CARGO_FUZZ_VERSION"
fi

# IREE runtime tools the compiler wheel lacks (iree-encode-parameters, for data-tiled CPU exports),
# built from our runtime's own IREE sources into .tools/bin.
scripts/build-iree-tools.sh
