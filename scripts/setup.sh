#!/usr/bin/env bash
# Installs every tool the project needs on a fresh Debian 12 machine, idempotently.
# Everything lands under .tools/ (Python venv with the pinned IREE compiler/runtime, cmake, ninja)
# or comes from Debian packages. Source scripts/env.sh afterwards (the other scripts do).
set -euo pipefail
cd "$(dirname "$0")/.."

IREE_VERSION=3.13.0

need_apt=()
for pkg in clang libclang-dev mesa-vulkan-drivers libvulkan1 vulkan-tools; do
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
