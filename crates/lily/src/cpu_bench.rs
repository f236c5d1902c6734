//! `lily bench-cpu`: this machine's memory read bandwidth and the 4-bit matrix-vector product's
//! throughput on a matrix larger than the caches, so docs/performance.md can state the product
//! as a fraction of the bandwidth it is bound by.

use std::time::Instant;

use anyhow::Result;
use engine::backend::cpu::CpuBackend;
use engine::backend::cpu::quant;
use engine::checkpoint::{HostSlice, QWeight};
use half::bf16;
use rayon::prelude::*;
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct CpuBenchArgs {
    /// Threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Size of the bandwidth buffer in MiB.
    #[arg(long, default_value_t = 1024)]
    pub buffer_mib: usize,
    /// Rows of the quantized matrix (columns: --cols).
    #[arg(long, default_value_t = 65536)]
    pub rows: usize,
    #[arg(long, default_value_t = 4096)]
    pub cols: usize,
    /// Timed repetitions (the best is reported, and the median).
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
}

fn best_and_median(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[0], v[v.len() / 2])
}

/// A cheap deterministic fill (the values do not matter, only that pages are touched).
fn fill_u32(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .into_par_iter()
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed))
        .collect()
}

pub fn run(a: CpuBenchArgs) -> Result<()> {
    anyhow::ensure!(a.cols.is_multiple_of(64), "--cols must be a multiple of 64");
    anyhow::ensure!(a.reps >= 1, "--reps must be at least 1");
    let cpu = CpuBackend::new(a.threads)?;
    let threads = cpu.threads();

    // Memory read bandwidth (a parallel sum over a buffer far larger than the caches) and the
    // 4-bit product `[1, cols] x [rows, cols]^T`, timed alternately so that both see the same
    // state of a shared machine's memory system.
    let words = a.buffer_mib * 1024 * 1024 / 8;
    let buf: Vec<u64> = cpu.install(|| (0..words as u64).into_par_iter().collect());
    let bytes = (words * 8) as f64;
    let (rows, cols) = (a.rows, a.cols);
    let w = cpu.install(|| QWeight {
        name: "bench".into(),
        codes: HostSlice::from_vec(fill_u32(rows * cols / 8, 1)),
        scales: HostSlice::from_vec(
            (0..rows * cols / 64)
                .map(|i| bf16::from_f32(0.001 + (i % 7) as f32 * 1e-4))
                .collect(),
        ),
        biases: HostSlice::from_vec(
            (0..rows * cols / 64)
                .map(|i| bf16::from_f32(-0.01 - (i % 5) as f32 * 1e-3))
                .collect(),
        ),
        rows,
        cols,
        bits: 4,
        group_size: 64,
    });
    let wbytes = (rows * cols / 2 + 2 * 2 * rows * cols / 64) as f64;
    let x: Vec<f32> = (0..cols).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
    let mut bw_times = Vec::new();
    let mut gemv_times = Vec::new();
    let mut sink = 0u64;
    let mut check = 0.0f32;
    for rep in 0..=a.reps {
        let t = Instant::now();
        sink ^= cpu.install(|| {
            buf.par_chunks(1 << 16)
                .map(|c| c.iter().fold(0u64, |s, v| s.wrapping_add(*v)))
                .reduce(|| 0, u64::wrapping_add)
        });
        let bw = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let y = cpu.install(|| quant::qmatmul(cpu.simd(), &x, 1, &w));
        let gv = t.elapsed().as_secs_f64();
        check += y[rows / 2];
        if rep > 0 {
            // The first round also faults pages in.
            bw_times.push(bw);
            gemv_times.push(gv);
        }
    }
    let ratios: Vec<f64> = bw_times
        .iter()
        .zip(&gemv_times)
        .map(|(b, g)| (wbytes / g) / (bytes / b))
        .collect();
    let (bw_best, bw_med) = best_and_median(bw_times);
    let (gv_best, gv_med) = best_and_median(gemv_times);
    let (_, ratio_med) = best_and_median(ratios);

    let report = json!({
        "threads": threads,
        "simd": format!("{:?}", cpu.simd()),
        "memory_read": {"bytes": bytes, "best_gb_s": bytes / bw_best / 1e9, "median_gb_s": bytes / bw_med / 1e9},
        "q4_gemv": {
            "rows": rows, "cols": cols, "weight_bytes": wbytes,
            "best_ms": gv_best * 1e3, "median_ms": gv_med * 1e3,
            "best_gb_s": wbytes / gv_best / 1e9, "median_gb_s": wbytes / gv_med / 1e9,
            "fraction_of_bandwidth_best": (wbytes / gv_best) / (bytes / bw_best),
            "fraction_of_bandwidth_median_paired": ratio_med,
        },
        "checksum": format!("{sink:x}/{check}"),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
