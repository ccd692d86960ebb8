# Source me: puts the project's tools first on PATH and points the crates at the checkout's
# folders. Idempotent.
#
# The crates never derive a path from the checkout (crates/kv-paths): without these variables a
# built binary uses the platform's directories (~/.cache/skainet-kv, ~/.local/share/skainet-kv).
# Developer builds, tests, CI and the scripts choose the checkout's .cache and .tools here; a
# SKAINET_KV_CACHE already set (a worktree's own, the device scripts') is kept.
_skv_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case ":$PATH:" in *":$_skv_root/.tools/venv/bin:"*) ;; *) export PATH="$_skv_root/.tools/venv/bin:$PATH" ;; esac
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
export SKAINET_KV_TOOLS="$_skv_root/.tools"
export SKAINET_KV_CACHE="${SKAINET_KV_CACHE:-$_skv_root/.cache}"
