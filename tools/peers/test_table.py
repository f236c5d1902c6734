#!/usr/bin/env python3
"""Tests of table.py on hand-made inputs in the formats lily bench and llama-bench write.

    python3 tools/peers/test_table.py
"""

import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import table  # noqa: E402


def lily_report(n, prefill_secs, decode_secs, steps=64):
    # The shape of crates/lily/src/bench.rs's report (fields table.py reads, plus a few).
    return {
        "schema_version": 1,
        "meta": {"engine": "lily", "crate_version": "0.1.0", "source_id": "abc123",
                 "harness": "lily bench", "device": "cuda (NVIDIA H200)", "model": "/tmp/x"},
        "workload": {"prompt_len": n, "prompt_kind": "u32_golden_ratio_hash_mod_vocab",
                     "decode_steps": steps, "decode_mode": "sequential"},
        "results": {
            "prefill": {"wall_secs": prefill_secs, "tok_s": n / prefill_secs, "first_token_id": 7},
            "decode": {"wall_secs": decode_secs, "tok_s": steps / decode_secs,
                       "step_wall_secs": [decode_secs / steps] * steps,
                       "token_digest": "0123456789abcdef", "token_ids": [1] * steps},
        },
    }


def llama_line(n_prompt, n_gen, n_depth, avg_ts, sd=1.0):
    # llama-bench -o jsonl: one object per test, fields as llama-bench.cpp prints them.
    return json.dumps({
        "build_commit": "deadbee", "build_number": 1, "cpu_info": "x", "gpu_info": "NVIDIA H200",
        "backends": "CUDA", "model_filename": "/tmp/m.gguf", "model_type": "qwen35moe 35B.A3B Q4_K - Medium",
        "model_size": 21156000000, "model_n_params": 34661000000, "n_batch": 4096, "n_ubatch": 2048,
        "n_threads": 16, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99, "flash_attn": 1,
        "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth, "test_time": "2026-11-29T12:00:00Z",
        "avg_ns": 1, "stddev_ns": 1, "avg_ts": avg_ts, "stddev_ts": sd,
        "samples_ns": [1, 1, 1], "samples_ts": [avg_ts] * 3,
    })


class TableTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        d = self.d = self.tmp.name
        for n, pre, dec in [(256, 0.1, 0.5), (4096, 1.0, 0.8)]:
            with open(os.path.join(d, f"lily-ctx{n}.json"), "w") as f:
                json.dump(lily_report(n, pre, dec), f)
        with open(os.path.join(d, "lily-ctx131072.fail"), "w") as f:
            f.write("timeout after 300 s\n")
        with open(os.path.join(d, "llama-pp.jsonl"), "w") as f:
            f.write(llama_line(256, 0, 0, 5000.0) + "\n")
            f.write("not json: ignored\n")
            f.write(llama_line(4096, 0, 0, 8000.0) + "\n")
            f.write(llama_line(4096, 0, 0, 8660.0) + "\n")   # a rerun replaces the first
        with open(os.path.join(d, "llama-tg.jsonl"), "w") as f:
            f.write(llama_line(0, 64, 256, 200.0) + "\n")
            f.write(llama_line(0, 64, 4096, 160.0) + "\n")
            f.write(llama_line(0, 64, 131072, 100.0) + "\n")
        with open(os.path.join(d, "machine.txt"), "w") as f:
            f.write("NVIDIA H200\n")

    def tearDown(self):
        self.tmp.cleanup()

    def test_rows(self):
        res = table.build(self.d)
        self.assertEqual([r["context"] for r in res["rows"]], [256, 4096, 131072])
        r = res["rows"][1]
        self.assertAlmostEqual(r["lily"]["prefill_tok_s"], 4096.0)
        self.assertAlmostEqual(r["lily"]["decode_tok_s"], 80.0)
        self.assertEqual(r["llama_cpp"]["prefill"]["tok_s"], 8660.0)
        self.assertAlmostEqual(r["ratio_lily_over_llama_cpp"]["prefill"], 4096.0 / 8660.0)
        self.assertAlmostEqual(r["ratio_lily_over_llama_cpp"]["decode"], 80.0 / 160.0)
        self.assertAlmostEqual(r["decode_limit_tok_s"], 4.3e12 / (1.67e9 + 4096 * 20480))
        last = res["rows"][2]
        self.assertIsNone(last["lily"])
        self.assertEqual(last["lily_failure"], "timeout after 300 s")
        self.assertIsNone(last["llama_cpp"]["prefill"])
        self.assertEqual(last["llama_cpp"]["decode"]["tok_s"], 100.0)
        self.assertEqual(res["meta"]["llama_cpp"]["build_commit"], "deadbee")
        self.assertEqual(res["machine"], "NVIDIA H200")

    def test_limit_at_empty_context(self):
        # the number quoted in the constants' comment
        self.assertAlmostEqual(table.decode_limit(0), 2575, delta=1)

    def test_markdown_and_files(self):
        out_json = os.path.join(self.d, "out.json")
        out_md = os.path.join(self.d, "out.md")
        with open(os.devnull, "w") as devnull:
            old, sys.stdout = sys.stdout, devnull
            try:
                rc = table.main([self.d, "--json-out", out_json, "--md-out", out_md])
            finally:
                sys.stdout = old
        self.assertEqual(rc, 0)
        with open(out_json) as f:
            self.assertEqual(len(json.load(f)["rows"]), 3)
        with open(out_md) as f:
            lines = f.read().splitlines()
        self.assertTrue(lines[0].startswith("| context | lily prefill | llama.cpp prefill | ratio |"))
        self.assertEqual(lines[3], "| 4,096 | 4,096 | 8,660 | 0.47x | 80.0 | 160.0 | 0.50x | 2,452 | 3.3% / 6.5% |")
        self.assertIn("| 131,072 | timeout | - | - | timeout | 100.0 | - |", lines[4])
        self.assertTrue(any("-ub 2048 -b 4096" in ln for ln in lines))

    def test_mlx_columns_only_when_present(self):
        self.assertNotIn("mlx-lm", table.markdown(table.build(self.d)))
        with open(os.path.join(self.d, "mlx-lm.jsonl"), "w") as f:
            f.write(json.dumps({"context": 256, "prefill_tok_s": 320.0, "decode_tok_s": 64.0,
                                "mlx": "0.32.4", "mlx_lm": "0.32.2"}) + "\n")
        res = table.build(self.d)
        md = table.markdown(res)
        self.assertIn("mlx-lm decode", md)
        # lily at 256: 2,560 tok/s prefill and 128 decode (setUp), so 8x and 2x mlx-lm's
        self.assertEqual(res["rows"][0]["ratio_lily_over_mlx_lm"], {"prefill": 8.0, "decode": 2.0})
        self.assertIn("| 320.0 | 8.0x | 64.0 | 2.0x |", md)
        self.assertIn("mlx-lm on CUDA (mlx 0.32.4, mlx-lm 0.32.2)", md)

    def test_llama_source(self):
        # a git checkout's commit as llama-bench reports it; the sdist's tree reports "unknown",
        # and the source line bench_h200.sh writes into machine.txt names it instead
        self.assertIn("llama.cpp deadbee (", table.markdown(table.build(self.d)))
        machine = "gpu: NVIDIA H200\nllama.cpp: llama-cpp-python 0.3.36 sdist\ndate: x"
        self.assertEqual(table.llama_source({"build_commit": "unknown"}, machine),
                         "from llama-cpp-python 0.3.36 sdist")
        self.assertEqual(table.llama_source({"build_commit": "unknown"}, None), "unknown")

    def test_empty_dir(self):
        with tempfile.TemporaryDirectory() as d:
            res = table.build(d)
            self.assertEqual(res["rows"], [])
            self.assertIn("| context |", table.markdown(res))


if __name__ == "__main__":
    unittest.main()
