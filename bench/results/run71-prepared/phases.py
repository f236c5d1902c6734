#!/usr/bin/env python3
"""Phases of one token's expert gate/up (moe_gate_up_stream) from a decode step's timeline
recorded with 8 marks a block (LILY_CUDA_TIMELINE_MARKS=8 and the kernel folder that prepare.sh
makes from probe-marks.patch beside this file: marks 3-7 in the kernel, taken by each block's
thread 0, warp 0). Marks: 0 at the
wait, 1 past it, 2 launch_dependents (x staged), 3 the router's logits landed, 4 routing known
(the block's barrier after it), 5 warp 0's first row landed, 6 that row summed and written,
7 the block's rows all done (a barrier). Per launch of the step: each mark's earliest, median and
latest block, in us after the launch's release (its first block past mark 1), and the next
launch's release. Usage: phases.py PATH (PATH.json beside it, as tools/timeline.py reads)."""
import importlib.util
import json
import statistics
import sys

spec = importlib.util.spec_from_file_location("timeline", "tools/timeline.py")
tl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tl)

path = sys.argv[1]
meta = json.load(open(path + ".json"))
step = [dict(s, blocks=min(s["blocks"], meta["blocks_per_launch"])) for s in meta["step"]]
ls = tl.launches(path, meta)
step_ls, first = tl.find_step(ls, step)
blocks, marks = meta["blocks_per_launch"], meta["marks"]
raw = open(path, "rb").read()


def block_marks(grid):
    """Each mark's times, over the blocks of launch `grid` that stored it."""
    gids, ts = tl.slot_records(raw, meta, grid % meta["launch_slots"])
    return [[ts[b * marks + m] for b in range(blocks) if gids[b * marks + m] == grid] for m in range(marks)]


print("| # | launch | mark | blocks | first | median | last |")
print("|---:|---|---|---:|---:|---:|---:|")
names = ["wait", "release", "trigger (staged)", "logits landed", "routed", "row 1 landed", "row 1 summed", "block done"]
summary = {m: [] for m in range(marks)}
nexts = []
for k, cur in enumerate(step_ls):
    if cur is None or not step[k]["label"].startswith("moe_gate_up_stream"):
        continue
    rel = cur["release"]
    bm = block_marks(cur["grid"])
    for m in range(marks):
        v = [(t - rel) * 1e-3 for t in bm[m]]
        if not v:
            continue
        row = (min(v), statistics.median(v), max(v))
        summary[m].append(row)
        print(f"| {k} | {step[k]['label']} | {m} {names[m]} | {len(v)} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} |")
    nxt = next((l for l in step_ls[k + 1:] if l), None)
    if nxt:
        nexts.append((nxt["release"] - rel) * 1e-3)
        print(f"| {k} | next release | | | {nexts[-1]:.2f} | | |")
print()
print("medians over the step's launches (us after release):")
print("| mark | first | median | last |")
print("|---|---:|---:|---:|")
for m in range(marks):
    if summary[m]:
        c = list(zip(*summary[m]))
        print(f"| {m} {names[m]} | {statistics.median(c[0]):.2f} | {statistics.median(c[1]):.2f} | {statistics.median(c[2]):.2f} |")
if nexts:
    print(f"| next release | {statistics.median(nexts):.2f} | | |")
