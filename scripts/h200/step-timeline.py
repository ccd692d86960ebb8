#!/usr/bin/env python3
"""Where a decode step's GPU time goes, from a device profile of our own session.

    skainet-kv bench ... --device-profile P.ireeprof
    python3 scripts/h200/step-timeline.py P.ireeprof [--iree-profile PATH] [--top N]
    python3 scripts/h200/step-timeline.py A.ireeprof --against B.ireeprof   # an A/B by kind

Reads every dispatch event (`iree-profile dispatch --dispatch_events --format=jsonl`), groups
them by queue submission (one submission = one call of a graph), and for each kind of call
(named by the function most of its dispatches come from: `gemma_with_past` is the step) prints
the medians over its calls of:
  - span: first dispatch's start to the last one's end, on the device's clock (the host's for
    the CPU drivers, whose dispatches run on worker threads);
  - busy: the union of the dispatches' intervals (the GPU running at least one);
  - idle: span - busy, the time between dependent dispatches (barriers, launches);
  - levels: runs of dispatches that overlap in time (a new level starts after every earlier
    dispatch ended), the dependent chain the command buffer's barriers make;
and the kinds of dispatch that take the most of a call (median duration x count a call).
Then the device's time between calls (a decode step's previous call ended -> the step began:
what the host's work and its waits leave the GPU idle), and how the queue issued each kind of
operation (Vulkan profiles record queue events: `native`, or `software_defer`, held by the host
until it observed the signals the operation waits on, with the median time from its submission
to its release). A chain of `software_defer` operations (session 30: every queue allocation of
a call, and so every call after it) cannot run ahead of the host.
With --against, each kind of call of A is followed by B's figures and the kinds of dispatch
whose time a call moved most between them (dispatch names without IREE's ordinal, which
differs between two exports).

Dispatches are named by the executable IREE kept: the step's LM head and argmax stages are the
prefill graph's executables when their code is the same (`gemma_prefill_at_dispatch_*`).
"""
import argparse
import collections
import glob
import json
import os
import re
import statistics
import subprocess
import sys


def events(path, tool):
    out = subprocess.run([tool, "dispatch", "--dispatch_events", "--format=jsonl", path],
                         capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        d = json.loads(line)
        if d.get("type") == "dispatch_event" and d.get("valid"):
            yield d
        elif d.get("type") == "host_dispatch_event" and d.get("valid"):
            # The CPU drivers time a dispatch on the host's clock (its threads' execution).
            d["start_tick"], d["end_tick"] = d["start_host_time_ns"], d["end_host_time_ns"]
            yield d


def function_of(key):
    return key.split("_dispatch_")[0]


def analyse(calls):
    spans, busys, levels_n = [], [], []
    for evs in calls:
        evs = sorted(evs, key=lambda e: e["start_tick"])
        start = evs[0]["start_tick"]
        end = max(e["end_tick"] for e in evs)
        busy, cur_s, cur_e, levels = 0, None, None, 0
        for e in evs:
            if cur_e is None or e["start_tick"] >= cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = e["start_tick"], e["end_tick"]
                levels += 1
            else:
                cur_e = max(cur_e, e["end_tick"])
        busy += cur_e - cur_s
        spans.append(end - start)
        busys.append(busy)
        levels_n.append(levels)
    return statistics.median(spans), statistics.median(busys), statistics.median(levels_n)


def calls_by_kind(path, tool):
    by_submission = collections.defaultdict(list)
    for e in events(path, tool):
        by_submission[(e["queue_ordinal"], e["submission_id"])].append(e)
    by_kind = collections.defaultdict(list)
    for evs in by_submission.values():
        kind = collections.Counter(function_of(e["key"]) for e in evs).most_common(1)[0][0]
        by_kind[kind].append(evs)
    return by_kind


def summary(calls):
    span, busy, levels = analyse(calls)
    per_call = statistics.median(len(c) for c in calls)
    return (f"{len(calls)} calls, {per_call:.0f} dispatches a call, medians: "
            f"span {span / 1e3:.1f} us, busy {busy / 1e3:.1f} us, idle {(span - busy) / 1e3:.1f} us "
            f"({100 * (span - busy) / max(span, 1):.0f}%), {levels:.0f} levels "
            f"({span / max(levels, 1) / 1e3:.1f} us a level)")


def per_call_time(calls, strip_ordinal=False):
    """Each kind of dispatch's median duration x its count a call, in ns: {key: (share, med, n)}."""
    durations = collections.defaultdict(list)
    for c in calls:
        for e in c:
            key = re.sub(r"_dispatch_\d+_", "_", e["key"]) if strip_ordinal else e["key"]
            durations[key].append(e["end_tick"] - e["start_tick"])
    out = {}
    for key, ds in durations.items():
        med = statistics.median(ds)
        n = len(ds) / len(calls)
        out[key] = (med * n, med, n)
    return out


def idle_between(by_kind):
    """Median device time from the end of the previous call to the start of each call, by kind."""
    calls = []
    for kind, cs in by_kind.items():
        for evs in cs:
            calls.append((min(e["start_tick"] for e in evs), max(e["end_tick"] for e in evs), kind))
    calls.sort()
    gaps = collections.defaultdict(list)
    for (_, end, _), (start, _, kind) in zip(calls, calls[1:]):
        gaps[kind].append(max(start - end, 0))
    return {kind: statistics.median(g) for kind, g in gaps.items()}


def queue_operations(path, tool):
    """{(op, strategy): [submit-to-ready ns]} of the profile's queue events (none: not recorded)."""
    out = subprocess.run([tool, "queue", "--format=jsonl", path], capture_output=True, text=True).stdout
    ops = collections.defaultdict(list)
    for line in out.splitlines():
        d = json.loads(line)
        if d.get("type") == "queue_event":
            ready = d.get("ready_host_time_ns", d["host_time_ns"])
            ops[(d["op"], d.get("dependency_strategy", "?"))].append(ready - d["host_time_ns"])
    return ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--against", default=None, help="a second profile: print B beside A")
    ap.add_argument("--iree-profile", default=None)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    tool = args.iree_profile or os.environ.get("IREE_PROFILE")
    if not tool:
        here = os.path.dirname(os.path.abspath(__file__))
        found = glob.glob(os.path.join(here, "../../.tools/venv/lib/python3.*/site-packages/iree/_runtime_libs/iree-profile"))
        tool = found[0] if found else "iree-profile"
    a = calls_by_kind(args.profile, tool)
    b = calls_by_kind(args.against, tool) if args.against else None
    for kind, calls in sorted(a.items(), key=lambda kv: -len(kv[1])):
        print(f"{kind}: {summary(calls)}")
        if b is None:
            rows = sorted(per_call_time(calls).items(), key=lambda kv: -kv[1][0])
            for key, (share, med, n) in rows[:args.top]:
                print(f"  {share / 1e3:8.1f} us a call = {n:5.1f} x {med / 1e3:7.1f} us  {key}")
            continue
        if kind not in b:
            print("  B: no such calls")
            continue
        print(f"  B: {summary(b[kind])}")
        ta, tb = per_call_time(calls, True), per_call_time(b[kind], True)
        keys = set(ta) | set(tb)
        moved = sorted(keys, key=lambda k: -abs(ta.get(k, (0,))[0] - tb.get(k, (0,))[0]))
        for key in moved[:args.top]:
            sa, sb = ta.get(key, (0, 0, 0)), tb.get(key, (0, 0, 0))
            print(f"  {sa[0] / 1e3:8.1f} -> {sb[0] / 1e3:8.1f} us a call "
                  f"({sa[2]:4.1f} x {sa[1] / 1e3:6.1f} -> {sb[2]:4.1f} x {sb[1] / 1e3:6.1f} us)  {key}")
    gaps = idle_between(a)
    for kind, calls in sorted(a.items(), key=lambda kv: -len(kv[1])):
        if kind in gaps:
            print(f"between calls: {gaps[kind] / 1e3:.1f} us of device idle before each {kind} (median)")
    for (op, strategy), waits in sorted(queue_operations(args.profile, tool).items()):
        print(f"queue: {len(waits)} {op} issued {strategy}, submit to ready {statistics.median(waits) / 1e3:.1f} us (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
