#!/usr/bin/env bash
# Builds the IREE runtime tools the pinned compiler wheel does not ship, from the same IREE
# sources our runtime is built from (the eerie-sys crate), into .tools/bin/. Idempotent.
#
#   iree-encode-parameters  runs the parameter encoder modules `export` makes for data-tiled CPU
#                           modules (crates/export/src/encode.rs)
#
# ~1 min on 2 cores the first time (CMake configure + the runtime libraries the tool links).
#
#   scripts/build-iree-tools.sh vulkan   instead: iree-run-module and iree-profile with the Vulkan
#     driver and our patch of its allocator (crates/iree-runtime-sys/cmake/CMakeLists.txt), into
#     .tools/bin-vulkan/, for the H200 runs (scripts/h200/prepare.sh carries them): the wheel's tools
#     cannot load a 335 MB parameter on a GPU without resizable BAR. ~5 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

EERIE_SYS=eerie-sys-0.5.0   # must match crates/iree-runtime-sys/build/locate.rs
TOOLS="iree-encode-parameters"
BIN="$SKAINET_KV_TOOLS/bin"
VULKAN=OFF
build="$SKAINET_KV_TOOLS/iree-tools-build"
if [ "${1:-}" = vulkan ]; then
    TOOLS="iree-run-module iree-profile"
    BIN="$SKAINET_KV_TOOLS/bin-vulkan"
    VULKAN=ON
    build="$SKAINET_KV_TOOLS/iree-tools-vulkan-build"
fi
STAMP="$BIN/.iree-tools-$EERIE_SYS"

have_all() { for t in $TOOLS; do [ -x "$BIN/$t" ] || return 1; done; }
if [ -f "$STAMP" ] && have_all; then
    exit 0
fi

cargo fetch -q
src=""
for dir in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"$EERIE_SYS"/iree; do
    [ -f "$dir/runtime/src/iree/runtime/api.h" ] && src="$dir" && break
done
[ -n "$src" ] || { echo "build-iree-tools: $EERIE_SYS not found in the cargo registry after cargo fetch" >&2; exit 1; }

echo "build-iree-tools: building $TOOLS from $src"
cmake -G Ninja -S crates/iree-runtime-sys/cmake -B "$build" -DCMAKE_BUILD_TYPE=Release \
    -DIREE_RUNTIME_SYS_SOURCE_DIR="$src" -DIREE_HAL_DRIVER_VULKAN=$VULKAN >"$build.log" 2>&1 \
    || { echo "build-iree-tools: cmake configure failed; see $build.log" >&2; exit 1; }
# shellcheck disable=SC2086
cmake --build "$build" --target $TOOLS >>"$build.log" 2>&1 \
    || { echo "build-iree-tools: build failed; see $build.log" >&2; exit 1; }
mkdir -p "$BIN"
for t in $TOOLS; do
    cp "$(find "$build" -name "$t" -type f -perm -u+x | head -1)" "$BIN/$t"
done
touch "$STAMP"
echo "build-iree-tools: $TOOLS in $BIN"
