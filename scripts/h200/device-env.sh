# Sourced by the scripts that run on the lent GPU machine (run.sh, profile-step.sh): from the
# repository root, installs the Vulkan loader carried in .gl, points the CLI's cache at
# .cache/device (D), prints the GPU and generates the FunctionGemma twin's archive (TWIN).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export XDG_RUNTIME_DIR=/tmp
D=.cache/device
export SKAINET_KV_CACHE=$PWD/$D/cache
TWIN=gemma3-270m-shape:1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$D/bin/skainet-kv inspect --model $TWIN >/dev/null # generates the twin's archive
