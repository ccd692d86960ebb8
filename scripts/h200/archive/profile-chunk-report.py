#!/usr/bin/env python3
"""The table of docs/journal "Session 9 on the H200" from what profile-chunk-device.sh
returned: usage `profile-chunk-report.py WORK OUT` (WORK: profile-chunk.sh's folder, with
chunk-dispatches.json; OUT: the device run's files: dispatch.txt, chunk.ireeprof, prefill.ireeprof).
Needs iree-profile on PATH (scripts/env.sh)."""
import collections
import json
import re
import subprocess
import sys

work, out = sys.argv[1], sys.argv[2]
d = json.load(open(f"{work}/chunk-dispatches.json"))
uses = d["uses"]

# Alone: each dumped benchmark's median (µs per dispatch, --batch_size amortises the submit).
alone = {}
for line in open(f"{out}/dispatch.txt"):
    m = re.search(r"_fb_(\S+)/process_time/real_time_median\s+([\d.]+) us", line)
    if m:
        alone[m.group(1)] = float(m.group(2))


def events(bundle):
    text = subprocess.run(["iree-profile", "dispatch", "--dispatch_events", "--format=jsonl", bundle],
                          capture_output=True, text=True, check=True).stdout
    ev = [json.loads(l) for l in text.splitlines()]
    return sorted((e for e in ev if e.get("type") == "dispatch_event"), key=lambda e: e["start_tick"])


def timeline(ev, per_call, label):
    """Per call: span first dispatch start .. last dispatch end, summed dispatch time, submissions,
    gaps between submissions."""
    for c in range(len(ev) // per_call):
        e = ev[c * per_call:(c + 1) * per_call]
        span = (e[-1]["end_tick"] - e[0]["start_tick"]) / 1e6
        busy = sum(x["duration_ns"] for x in e) / 1e6
        subs = len({x["submission_id"] for x in e})
        gaps = [(b["start_tick"] - a["end_tick"]) / 1e6 for a, b in zip(e, e[1:])
                if a["submission_id"] != b["submission_id"]]
        gaps.sort()
        q = [round(gaps[int(p * (len(gaps) - 1))], 2) for p in (0, 0.5, 0.9, 1)] if gaps else []
        print(f"{label} call {c}: span {span:.1f} ms, dispatches {len(e)} busy {busy:.1f} ms, "
              f"submissions {subs}, gaps between them {sum(gaps):.1f} ms (min/median/p90/max {q})")


n = sum(uses.values())
ev = events(f"{out}/chunk.ireeprof")
timeline(ev, n, "chunk")
ctx = collections.defaultdict(list)
for e in ev:
    ctx[e["key"]].append(e["duration_ns"] / 1e3)
rows = []
for k, u in uses.items():
    c = ctx.get(k, [])
    rows.append((k, u, alone.get(k), sum(c) / len(c) if c else None))
rows.sort(key=lambda r: -(r[1] * (r[3] or 0)))
print(f"\n{n} dispatches of {len(uses)} kinds per chunk call")
print("| dispatch | uses | alone, µs each | × uses, ms | in the call, µs each | × uses, ms |")
print("|---|---|---|---|---|---|")
for k, u, a, c in rows:
    fa = f"{a:,.1f} | {u * a / 1e3:.2f}" if a is not None else "– | –"
    fc = f"{c:,.1f} | {u * c / 1e3:.2f}" if c is not None else "– | –"
    print(f"| `{k}` | {u} | {fa} | {fc} |")
print(f"| sum | {n} | | {sum(u * (a or 0) for _, u, a, _ in rows) / 1e3:.1f} | | "
      f"{sum(u * (c or 0) for _, u, _, c in rows) / 1e3:.1f} |")
try:
    pev = events(f"{out}/prefill.ireeprof")
    timeline(pev, len(pev) // 3, "prefill (128 rows)")
except (OSError, subprocess.CalledProcessError) as err:
    print("prefill profile:", err)
