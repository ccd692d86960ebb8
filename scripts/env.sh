# Source me: puts the project's tools first on PATH. Idempotent.
_skv_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case ":$PATH:" in *":$_skv_root/.tools/venv/bin:"*) ;; *) export PATH="$_skv_root/.tools/venv/bin:$PATH" ;; esac
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
export SKAINET_KV_TOOLS="$_skv_root/.tools"
