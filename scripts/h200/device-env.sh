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

# The archive of the variant in $D/$1 beside its modules: the twin's own when the export keeps
# the source's parameters, else the one the same export writes there (fused projections), with
# the carried modules standing in for the compiler (carried-compiler.sh).
twin_archive() {
  local v=$D/$1 bin=$D/bin/skainet-kv
  if ! grep -q '"fusedProjections": true' $v/manifest.json; then
    ln -f $D/cache/fixtures/gemma3-270m-shape-1/model.irpa $v/model.irpa
    return
  fi
  # A variant carrying the binary that exported it (an A/B of builds whose archives differ:
  # session 28's fused gate/up) writes its archive with that binary.
  if [ -x $v/skainet-kv ]; then
    bin=$v/skainet-kv
  else
    # Variants exported with the same flags by two builds (an A/B of emitted forms) read the
    # same archive: the one written for the first, since only the carried binary's MLIR passes
    # carried-compiler.sh.
    local other
    for other in $D/*/export-args.txt; do
      other=$(dirname "$other")
      if [ "$other" != "$v" ] && [ ! -x "$other/skainet-kv" ] && [ -f "$other/model.irpa" ] && cmp -s "$other/export-args.txt" "$v/export-args.txt"; then
        ln -f "$other/model.irpa" "$v/model.irpa"
        return
      fi
    done
  fi
  local tmp=$v.export
  rm -rf $tmp
  IREE_COMPILE=$PWD/scripts/h200/carried-compiler.sh CARRIED_MODULES=$v \
    xargs -a $v/export-args.txt -d '\n' $bin export --model $TWIN --out $tmp >/dev/null &&
    mv $tmp/model.irpa $v/model.irpa && rm -rf $tmp
}

# Runs `diverge` (the command line after LABEL and TIMEOUT) and prints its last lines. Its exit
# status is the verdict (a token that is not a near-tie of the reference at any step, K/V out of
# tolerance, or a timeout): a failure is printed at once and remembered, and diverge_verdict, the
# script's last command, then fails the script, after every other measurement has run.
DIVERGE_FAILED=""
check_diverge() {
  local label=$1 limit=$2 out status
  shift 2
  out=$(timeout "$limit" "$@" 2>&1)
  status=$?
  if [ $status -eq 0 ]; then
    printf '%s\n' "$out" | tail -3
  else
    printf '%s\n' "$out" | tail -20
    echo "DIVERGE FAILED: $label (exit $status)"
    DIVERGE_FAILED="$DIVERGE_FAILED $label"
  fi
}
diverge_verdict() {
  if [ -n "$DIVERGE_FAILED" ]; then
    echo "diverge failed for:$DIVERGE_FAILED" >&2
    return 1
  fi
}
