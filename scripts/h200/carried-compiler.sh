#!/usr/bin/env bash
# Stands in for iree-compile on the lent GPU machine, which has no compiler: there, `skainet-kv
# export` writes what the modules read (the twin's archive, whose projections an export fuses) and
# this copies the module prepare.sh compiled from the same MLIR (CARRIED_MODULES/<module>.vmfb),
# refusing if the MLIR emitted there is not the one that module was compiled from.
set -euo pipefail
out= mlir=
while [ $# -gt 0 ]; do
  case $1 in
    -o) out=$2; shift 2 ;;
    *.mlir) mlir=$1; shift ;;
    *) shift ;;
  esac
done
name=$(basename "$out")
want=$(cat "$CARRIED_MODULES/${name%.vmfb}.mlir.sha256")
got=$(sha256sum "$mlir" | cut -d' ' -f1)
if [ "$want" != "$got" ]; then
  echo "carried-compiler: $mlir is not the MLIR $name was compiled from" >&2
  exit 1
fi
cp "$CARRIED_MODULES/$name" "$out"
