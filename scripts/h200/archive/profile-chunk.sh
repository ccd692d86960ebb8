#!/usr/bin/env bash
# Prepares a per-dispatch profile of contract 2's chunk graph (`gemma_prefill_with_past`, 32 rows
# over the caches) for the H200 (docs/journal, "Session 9 on the H200"), following
# shared/notes/PERFORMANCE.md's recipe:
#   1. export the FunctionGemma-geometry twin as prepare.sh's `i16-ampere-v2` variant (keeps the
#      MLIR);
#   2. compile that MLIR again with the export's flags, once to flow (to count each dispatch's uses
#      in the chunk function) and once with --iree-hal-dump-executable-benchmarks-to;
#   3. compile the dumped benchmarks of the chunk function's dispatches, each alone, for the same
#      target;
#   4. write what the device needs into $DEV (ignored, < 64 MiB), by default .cache/prof-device
#      (the device tool copies the main checkout: in a worktree whose .cache links to main's, that
#      is where it travels from): those vmfbs, the export's vmfb
#      and the bare chunk / step functions' arguments, the release binary (it regenerates the
#      twin's archive there), IREE's benchmark and profile tools, the Vulkan loader debs, and
#      scripts/h200/archive/profile-chunk-device.sh as run.sh.
# Then, with the device tool: `bash .cache/prof-device/run.sh`, carry [".cache/prof-device"]; it
# writes run.log, the dispatch benchmarks' medians and two HAL profile bundles under $OUT, which
# scripts/h200/archive/profile-chunk-report.py turned into the table of docs/journal, session 9.
# WORK (default /tmp/prof) keeps the export, the flow IR and the dumped benchmarks.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source scripts/env.sh
WORK=${WORK:-/tmp/prof}
DEV=${DEV:-.cache/prof-device}
TWIN=gemma3-270m-shape:1
CHUNK_FN=gemma_prefill_with_past
# The export's compile flags: compile::compile_with (`--iree-input-type=stablehlo`), the Vulkan
# target's flags, and the manifest's provenance.compileFlags (checked below).
FLAGS=(--iree-input-type=stablehlo --iree-hal-target-device=vulkan --iree-vulkan-target=ampere
  --iree-opt-const-expr-hoisting=false)
mkdir -p "$WORK"

if [ ! -f "$WORK/v2/manifest.json" ]; then
  # (projections apart: the device links the twin's own archive, profile-chunk-device.sh)
  ./target/release/skainet-kv export --model $TWIN --out "$WORK/v2" --targets vulkan --weight-storage i16 \
    --vulkan-target ampere --contract 2 --projections apart
fi
python3 - "$WORK/v2/manifest.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))["provenance"]
assert p["compileFlags"] == "--iree-opt-const-expr-hoisting=false", p
assert p["targets"] == "vulkan-ampere" and p["weightFormat"] == "I16", p
PY
MLIR=$WORK/v2/gemma.mlir

[ -f "$WORK/flow.mlir" ] || iree-compile "${FLAGS[@]}" --compile-to=flow "$MLIR" -o "$WORK/flow.mlir"
if [ ! -f "$WORK/full.vmfb" ]; then
  rm -rf "$WORK/bench"
  iree-compile "${FLAGS[@]}" --iree-hal-dump-executable-benchmarks-to="$WORK/bench" "$MLIR" -o "$WORK/full.vmfb"
fi

# The chunk function's dispatches (uses per call) and the dumped benchmarks that hold them.
python3 - "$WORK" "$CHUNK_FN" <<'PY'
import collections, glob, json, os, re, sys
work, fn = sys.argv[1], sys.argv[2]
lines = open(f"{work}/flow.mlir").read().splitlines()
start = next(i for i, l in enumerate(lines) if re.match(rf"\s*util\.func public @{fn}\(", l))
indent = len(lines[start]) - len(lines[start].lstrip())
end = next(i for i in range(start + 1, len(lines)) if lines[i] == " " * indent + "}")
body = lines[start:end]
uses = collections.Counter()
others = collections.Counter()
for l in body:
    m = re.search(r"flow\.dispatch @([\w$.-]+)::@([\w$.-]+)", l)
    if m:
        uses[m.group(2)] += 1
        continue
    m = re.search(r"= (flow\.tensor\.\w+)", l)
    if m:
        others[m.group(1)] += 1
bench = {}
for path in sorted(glob.glob(f"{work}/bench/*.mlir")):
    text = open(path).read()
    for name in uses:
        if re.search(rf"@{re.escape(name)}\b", text):
            bench.setdefault(name, []).append(os.path.basename(path))
json.dump({"function": fn, "uses": uses, "tensor_ops": others, "bench": bench},
          open(f"{work}/chunk-dispatches.json", "w"), indent=1)
print(f"{fn}: {sum(uses.values())} dispatches of {len(uses)} kinds; flow.tensor ops: {dict(others)}")
missing = [n for n in uses if n not in bench]
print(f"dumped benchmarks found for {len(uses) - len(missing)} kinds; none for {missing}")
PY

rm -rf "$DEV" && mkdir -p "$DEV/dispatch" "$DEV/chunk" "$DEV/bin" "$DEV/tools" "$DEV/gl"
python3 - "$WORK" <<'PY' >"$WORK/bench-files.txt"
import json, sys
d = json.load(open(f"{sys.argv[1]}/chunk-dispatches.json"))
print("\n".join(sorted({f for fs in d["bench"].values() for f in fs})))
PY
failed=0
while read -r f; do
  out="$DEV/dispatch/${f%.mlir}.vmfb"
  if ! iree-compile --iree-hal-target-device=vulkan --iree-vulkan-target=ampere "$WORK/bench/$f" -o "$out" 2>"$WORK/bench-$f.err"; then
    echo "FAILED to compile $f: $(grep -m1 error: "$WORK/bench-$f.err")"
    failed=$((failed + 1))
  fi
done <"$WORK/bench-files.txt"
echo "dispatch benchmarks: $(ls "$DEV/dispatch" | wc -l) compiled, $failed failed"
cp "$WORK/chunk-dispatches.json" "$DEV/"

cp "$WORK/v2/"*.vmfb "$WORK/v2/manifest.json" "$DEV/chunk/"
cp target/release/skainet-kv "$DEV/bin/"
for t in iree-benchmark-module iree-profile; do
  cp .tools/venv/lib/python3.*/site-packages/iree/_runtime_libs/$t "$DEV/tools/"
done
GL=${GL:-.gl} # the Vulkan loader debs (prepare.sh downloads them)
cp "$GL"/*.deb "$DEV/gl/"
cp scripts/h200/archive/profile-chunk-device.sh "$DEV/run.sh"

# Arguments of the bare chunk, step and 128-row prefill functions (as prepare.sh's step-args.txt): pos = 200,
# tokens 7, every f32 input 0.01 (caches and select included: the timing does not depend on them).
python3 - "$DEV/chunk" <<'PY'
import glob, re, subprocess, sys
d = sys.argv[1]
vmfb = glob.glob(f"{d}/*.vmfb")[0]
dump = subprocess.run(["iree-dump-module", vmfb], capture_output=True, text=True).stdout
for fn, out in [("gemma_prefill_with_past", "chunk-args.txt"), ("gemma_with_past", "step-args.txt"),
                ("gemma_prefill_at", "prefill-args.txt")]:
    decl = next(l for l in dump.splitlines() if f"sync func @{fn}(" in l)
    inputs = decl.split("(", 1)[1].split(") ->")[0]
    args = []
    for i, m in enumerate(re.finditer(r"tensor<([^>]*)>", inputs)):
        t = m.group(1)
        assert "?" not in t, decl
        if t.endswith("i32"):
            args.append(f"--input={t}=200" if i == 2 else f"--input={t}=7")
        else:
            args.append(f"--input={t}=0.01")
    open(f"{d}/{out}", "w").write(" ".join(args))
    print(fn, len(args), "inputs")
PY
du -sh "$DEV"
git check-ignore -q "$DEV" && echo "$DEV is ignored by git: carry it" || echo "$DEV is not ignored"
