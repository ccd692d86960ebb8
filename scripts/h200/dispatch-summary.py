"""Prints each dispatch kind of an `iree-profile dispatch --format=jsonl` file: count, GPU time,
last workgroup count x size; then the sum."""
import json
import sys

total = 0
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("type") != "dispatch_group":
        continue
    total += d["total_ns"]
    key, n, us = d["key"][:64], d["count"], d["total_ns"] / 1000
    print(f"   {key:64s} x{n:<3d} {us:8.1f} us  wg {d['last_workgroup_count']} x {d['last_workgroup_size']}")
print(f"   sum {total / 1000:.1f} us")
