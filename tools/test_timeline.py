#!/usr/bin/env python3
"""Tests of timeline.py on hand-made buffers in the layout cuda/timeline.rs writes (small
dimensions: the analysis reads them from the metadata, as it does for the real buffer).

    python3 tools/test_timeline.py
"""

import json
import math
import os
import struct
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timeline  # noqa: E402

SLOTS, BLOCKS, MARKS = 16, 4, 3


def write(path, marks, step, nmarks=MARKS):
    """marks: (launch id, block, mark, ns) stores, in the order the GPU would make them."""
    buf = bytearray(SLOTS * BLOCKS * nmarks * 16)
    for grid, block, mark, t in marks:
        slot = ((grid % SLOTS) * BLOCKS + block) * nmarks + mark
        buf[slot * 16:slot * 16 + 16] = struct.pack("<QQ", grid, t)
    with open(path, "wb") as f:
        f.write(bytes(buf))
    return {"launch_slots": SLOTS, "blocks_per_launch": BLOCKS, "marks": nmarks,
            "step": [{"label": l, "blocks": b} for l, b in step]}


def kernel(grid, blocks, release_ns, arrive_ns=(), trigger_ns=None):
    """Every block arrives at arrive_ns[b] (default 100 ns before the release), returns from its
    wait at the release (block b b ns later) and triggers at trigger_ns (default +300 ns)."""
    out = []
    for b in range(blocks):
        arrive = arrive_ns[b] if b < len(arrive_ns) else release_ns - 100
        out += [(grid, b, 0, arrive), (grid, b, 1, max(arrive, release_ns) + b),
                (grid, b, 2, (trigger_ns or release_ns + 300) + b)]
    return out


class TimelineTest(unittest.TestCase):
    def analyse(self, marks, step):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "tl.bin")
            meta = write(path, marks, step)
            ls = timeline.launches(timeline.read_buffer(path), meta)
        step_ls, first = timeline.find_step(ls, meta["step"])
        rows = timeline.rows_of(meta["step"], step_ls) if step_ls else None
        return ls, step_ls, first, rows

    def test_critical_path_arrival_and_trigger(self):
        step = [("embed[b]", 1), ("gemv[b]", 3), ("moe", 2)]
        # An older launch (id 4) left four blocks in slot 4; the step's first launch (id 20,
        # slot 4) overwrites three of them and must not count the fourth.
        marks = kernel(4, 4, 1_000)
        marks += kernel(20, 1, 10_000)
        marks += kernel(21, 3, 12_000, arrive_ns=(11_000, 11_500, 12_700))  # one block late
        marks += kernel(22, 2, 15_500, trigger_ns=16_000)
        ls, step_ls, first, rows = self.analyse(marks, step)
        self.assertEqual(first, 20)
        self.assertEqual([l["blocks"] for l in step_ls], [1, 3, 2])
        label, blocks, crit, arrive, late, trig = rows[1]
        self.assertEqual((label, blocks), ("gemv[b]", 3))
        self.assertAlmostEqual(crit, 3.5)       # 15,500 - 12,000 ns
        self.assertAlmostEqual(arrive, 1.0)     # 11,000 - 10,000
        self.assertAlmostEqual(late, 0.7)       # 12,700 - 12,000
        self.assertAlmostEqual(trig, 0.302)     # block 2's trigger, 12,302
        self.assertTrue(math.isnan(rows[2][2]))  # the step's last launch has no next release
        fams = timeline.families(rows)
        self.assertEqual([f[0] for f in fams], ["gemv", "embed"])

    def test_a_launch_that_stores_nothing_is_skipped(self):
        step = [("a", 1), ("no_wait", 2), ("b", 1), ("c", 1)]
        marks = kernel(7, 1, 1_000) + kernel(9, 1, 4_000) + kernel(10, 1, 5_000)
        _, step_ls, first, rows = self.analyse(marks, step)
        self.assertEqual(first, 7)
        self.assertIsNone(step_ls[1])
        self.assertAlmostEqual(rows[0][2], 3.0)  # a's time runs to b's release
        self.assertTrue(all(math.isnan(v) for v in rows[1][2:]))

    def test_a_step_whose_block_counts_differ_is_not_found(self):
        step = [("a", 1), ("b", 2)]
        _, step_ls, first, _ = self.analyse(kernel(3, 1, 1_000) + kernel(4, 3, 2_000), step)
        self.assertIsNone(step_ls)
        self.assertIsNone(first)

    def test_a_probes_marks_inside_the_labelled_launches(self):
        # Five marks a block; the two "moe" launches carry a probe's mark 3 (block b at 1,000 +
        # 100 b ns after the release, then 3,000 + b) and mark 4 only in block 0.
        step = [("moe[e]", 3), ("down", 1), ("moe[e]", 3), ("down", 1)]
        marks = []
        for grid, release in ((30, 10_000), (32, 20_000)):
            marks += kernel(grid, 3, release)
            marks += [(grid, b, 3, release + b + 1_000 + 100 * b) for b in range(3)]
            marks += [(grid, 0, 4, release + 2_000)]
        marks += kernel(31, 1, 15_000) + kernel(33, 1, 24_000)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "tl.bin")
            meta = write(path, marks, step, nmarks=5)
            raw = timeline.read_buffer(path)
            step_ls, first = timeline.find_step(timeline.launches(raw, meta), meta["step"])
            self.assertEqual(first, 30)
            count, rows, nxt = timeline.phases(raw, meta, meta["step"], step_ls, "moe")
        self.assertEqual(count, 2)
        by_mark = {r[0]: r[1:] for r in rows}
        self.assertEqual(sorted(by_mark), [0, 1, 2, 3, 4])
        for got, want in zip(by_mark[3], (1.0, 1.101, 1.202)):
            self.assertAlmostEqual(got, want)
        self.assertAlmostEqual(by_mark[4][0], 2.0)
        self.assertAlmostEqual(nxt, 4.5)  # releases 5,000 and 4,000 ns after


if __name__ == "__main__":
    unittest.main()
