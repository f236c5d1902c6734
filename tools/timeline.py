#!/usr/bin/env python3
"""Reads a decode step's timeline (`LILY_CUDA_TIMELINE=path lily bench --device cuda ...`, the
engine's cuda/timeline.rs) and prints, for each launch of the recorded step (its CUDA graph keeps
its launch ids, so each slot holds the marks of the graph's last replay):

  crit   the next launch's release minus this launch's release (a release: the first of its
         blocks to return from its wait for the launch before): what the step's critical path
         spends from this kernel's inputs being ready to the next kernel's (its work after the
         wait, its tail, the boundary)
  arrive its first block at its wait, after the previous launch's release (negative: waiting
         before the inputs were ready, its weights requested)
  late   its last block at its wait, after its own release (positive: blocks that could not
         start, or run their part before the wait, until the inputs were ready; a block of the
         next kernel waits for room on an SM: registers, shared memory)
  trig   its last block's launch_dependents, after its release (the next kernel can launch only
         then)

then crit and late summed by kernel family. Microseconds, on the GPU's global timer; the marks
themselves make the step ~7% slower (run42).
Usage: python3 tools/timeline.py PATH [--launches-json OUT] [--from-launches IN] [--phases PREFIX]
  PATH.json (written beside PATH) holds the recorded step's launches; OUT keeps every launch's
  marks for another look, which IN reads instead of PATH. PREFIX: a probe's marks inside the
  launches whose label starts with it (LILY_CUDA_TIMELINE_MARKS, marks 3 and up in a kernel
  folder): each mark's earliest, median and latest block after the launch's release, as the
  median over those launches, and the next launch's release (reads PATH).
"""
import json
import statistics
import sys
from array import array
from collections import defaultdict


def slot_records(raw, meta, s):
    """Slot s of the buffer's bytes as (launch ids, times), block-major and mark-minor (block b's
    mark m at index b * marks + m); None where nothing was stored."""
    per_slot = meta["blocks_per_launch"] * meta["marks"] * 2
    chunk = raw[s * per_slot * 8:(s + 1) * per_slot * 8]
    if not chunk.strip(b"\0"):
        return None
    seg = array("Q")
    seg.frombytes(chunk)
    if sys.byteorder != "little":
        seg.byteswap()
    return seg[0::2], seg[1::2]


def block_marks(records, marks, grid):
    """For each mark, the (block, time) pairs of launch `grid` in a slot's records (blocks that
    an older launch in the same slot left are skipped)."""
    gids, ts = records
    return [[(b, t) for b, (g, t) in enumerate(zip(gids[m::marks], ts[m::marks])) if g == grid]
            for m in range(marks)]


def read_buffer(path):
    """The buffer's bytes (hundreds of MB with a probe's marks: read once, then passed on)."""
    with open(path, "rb") as f:
        return f.read()


def launches(raw, meta):
    out = []
    for s in range(meta["launch_slots"]):
        records = slot_records(raw, meta, s)
        if records is None:
            continue
        # The slot's last launch (ids grow); an older launch's leftover blocks are skipped.
        grid = max(records[0])
        hits = block_marks(records, meta["marks"], grid)
        times = [[t for _, t in h] for h in hits]
        seen = {b for h in hits for b, _ in h}
        if not times[1]:
            continue
        out.append({
            "grid": grid,
            "blocks": len(seen),
            "arrive_min": min(times[0]) if times[0] else None,
            "arrive_max": max(times[0]) if times[0] else None,
            "release": min(times[1]),
            "trigger_max": max(times[2]) if times[2] else None,
        })
    out.sort(key=lambda l: l["grid"])
    return out


def find_step(ls, step):
    """The recorded step's launches (None where a launch stored nothing), the first one's id."""
    n = len(step)
    want = [s["blocks"] for s in step]
    # A replayed CUDA graph's kernels keep the launch ids they were given when it was recorded
    # (seen on the H200's driver): each slot holds its kernel's marks from the graph's last
    # replay. The step is the last run of consecutive ids whose block counts are the recorded
    # step's (blocks that leave before their wait store nothing, so a launch may show fewer).
    fits = lambda c, w: c == w or 0 < c < w
    by_id = {l["grid"]: l for l in ls}
    for l in reversed(ls):
        g = l["grid"]
        if g + n - 1 in by_id and all(fits(by_id[g + k]["blocks"], want[k]) for k in range(n) if g + k in by_id):
            return [by_id.get(g + k) for k in range(n)], g
    return None, None


def rows_of(step, step_ls):
    """(label, blocks, crit, arrive, late, trig) a launch, in microseconds; NaN where unknown."""
    nan, us = float("nan"), 1e-3
    rows = []
    for k, cur in enumerate(step_ls):
        if cur is None:  # stored nothing: the launch before it takes its time too
            rows.append((step[k]["label"], step[k]["blocks"], nan, nan, nan, nan))
            continue
        nxt = next((l for l in step_ls[k + 1:] if l), None)
        prev = step_ls[k - 1] if k > 0 else None
        crit = (nxt["release"] - cur["release"]) * us if nxt else nan
        arrive = (cur["arrive_min"] - prev["release"]) * us if prev and cur["arrive_min"] else nan
        late = (cur["arrive_max"] - cur["release"]) * us if cur["arrive_max"] else nan
        trig = (cur["trigger_max"] - cur["release"]) * us if cur["trigger_max"] else nan
        rows.append((step[k]["label"], step[k]["blocks"], crit, arrive, late, trig))
    return rows


def families(rows):
    """Per family (the label up to its first '['): (launches, crit summed, median crit, late,
    trig), largest first; launches without a crit (nothing stored, the step's last) left out."""
    fam = defaultdict(list)
    for label, _, crit, _, late, trig in rows:
        if crit == crit:
            fam[label.split("[")[0]].append((crit, late, trig))
    out = []
    for name, v in fam.items():
        med = lambda i: statistics.median(x[i] for x in v)
        out.append((name, len(v), sum(x[0] for x in v), med(0), med(1), med(2)))
    return sorted(out, key=lambda f: -f[2])


def phases(raw, meta, step, step_ls, prefix):
    """The marks of the step's launches labelled `prefix`...: (launches, rows, next) where a row
    is (mark, first, median, last), each the median over the launches of that mark's earliest,
    median and latest block in us after the launch's release (marks no block stored left out),
    and next the median of the next launch's release after it (NaN if none)."""
    per_mark, nexts, count = defaultdict(list), [], 0
    for k, cur in enumerate(step_ls):
        if cur is None or not step[k]["label"].startswith(prefix):
            continue
        count += 1
        records = slot_records(raw, meta, cur["grid"] % meta["launch_slots"])
        for m, hits in enumerate(block_marks(records, meta["marks"], cur["grid"])):
            at = [(t - cur["release"]) * 1e-3 for _, t in hits]
            if at:
                per_mark[m].append((min(at), statistics.median(at), max(at)))
        nxt = next((l for l in step_ls[k + 1:] if l), None)
        if nxt:
            nexts.append((nxt["release"] - cur["release"]) * 1e-3)
    rows = [(m, *(statistics.median(x[i] for x in per_mark[m]) for i in range(3))) for m in sorted(per_mark)]
    return count, rows, statistics.median(nexts) if nexts else float("nan")


def main():
    args = sys.argv[1:]
    opts = {}
    for flag in ("--launches-json", "--from-launches", "--phases"):
        if flag in args:
            i = args.index(flag)
            opts[flag] = args[i + 1]
            del args[i:i + 2]
    dump, source = opts.get("--launches-json"), opts.get("--from-launches")
    if len(args) != 1:
        sys.exit(__doc__)
    path = args[0]
    with open(path + ".json") as f:
        meta = json.load(f)
    step = meta["step"]
    if not step:
        sys.exit("no recorded decode step in " + path + ".json")
    step = [dict(s, blocks=min(s["blocks"], meta["blocks_per_launch"])) for s in step]
    prefix = opts.get("--phases")
    raw = read_buffer(path) if prefix or not source else None
    if source:
        with open(source) as f:
            ls = json.load(f)
    else:
        ls = launches(raw, meta)
    if dump:
        with open(dump, "w") as f:
            json.dump(ls, f)
    step_ls, first = find_step(ls, step)
    if step_ls is None:
        sys.exit(f"no run of {len(step)} launches with the recorded step's block counts among {len(ls)}")
    n = len(step)
    rows = rows_of(step, step_ls)
    present = [l for l in step_ls if l]
    total = (present[-1]["release"] - present[0]["release"]) * 1e-3
    print(f"one step of {n} launches (ids {first}..{first + n - 1}, the graph's last replay); "
          f"{total:.1f} us from the first launch's release to the last's")
    print("| # | launch | blocks | crit | arrive | late | trig |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for k, (label, blocks, crit, arrive, late, trig) in enumerate(rows):
        print(f"| {k} | {label} | {blocks} | {crit:.2f} | {arrive:.2f} | {late:.2f} | {trig:.2f} |")
    print()
    print("| family | launches | crit, us a step | median crit | median late | median trig |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, count, crit, mcrit, mlate, mtrig in families(rows):
        print(f"| {name} | {count} | {crit:.1f} | {mcrit:.2f} | {mlate:.2f} | {mtrig:.2f} |")
    if prefix:
        count, marks, nxt = phases(raw, meta, step, step_ls, prefix)
        print()
        print(f"marks of the {count} launches labelled {prefix}..., us after each one's release "
              "(medians over the launches; 0 wait, 1 release, 2 trigger, 3 and up the probe's)")
        print("| mark | first block | median block | last block |")
        print("|---:|---:|---:|---:|")
        for m, first_b, med_b, last_b in marks:
            print(f"| {m} | {first_b:.2f} | {med_b:.2f} | {last_b:.2f} |")
        print(f"| next release | {nxt:.2f} | | |")


if __name__ == "__main__":
    main()
