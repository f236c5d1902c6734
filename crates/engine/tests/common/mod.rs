//! Helpers shared by the op-parity tests (CPU and CUDA): random inputs and the error measure.

#![allow(dead_code)] // each test binary uses its own subset

use engine::backend::cuda::CudaBackend;
use engine::checkpoint::{HostSlice, QWeight};
use half::bf16;
use rand::Rng;
use rand::rngs::StdRng;

/// `n` values uniform in `[-scale, scale)`.
pub fn randn(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
        .collect()
}

/// A random MLX affine quantized matrix: random codes, small positive scales, negative biases.
pub fn qweight(rng: &mut StdRng, rows: usize, cols: usize, bits: u32) -> QWeight {
    let words = rows * cols * bits as usize / 32;
    let groups = rows * cols / 64;
    QWeight {
        name: format!("random[{rows}x{cols}]q{bits}"),
        codes: HostSlice::from_vec((0..words).map(|_| rng.random::<u32>()).collect()),
        scales: HostSlice::from_vec(
            (0..groups)
                .map(|_| bf16::from_f32(rng.random::<f32>() * 0.02 + 0.001))
                .collect(),
        ),
        biases: HostSlice::from_vec(
            (0..groups)
                .map(|_| bf16::from_f32(-rng.random::<f32>() * 0.1))
                .collect(),
        ),
        rows,
        cols,
        bits,
        group_size: 64,
    }
}

/// Normalised mean squared error: sum((a-e)^2) / sum(e^2).
pub fn nmse(a: &[f32], e: &[f32]) -> f64 {
    assert_eq!(a.len(), e.len(), "length mismatch");
    let num: f64 = a.iter().zip(e).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = e
        .iter()
        .map(|y| (*y as f64).powi(2))
        .sum::<f64>()
        .max(1e-30);
    num / den
}

/// The GPU backend, or `None` after saying why the test is skipped.
pub fn cuda_or_skip(test: &str) -> Option<CudaBackend> {
    CudaBackend::new(0)
        .map_err(|e| skip_without_gpu(test, e))
        .ok()
}

/// Says why a GPU test is skipped. Written to the stderr handle itself: the harness captures
/// `eprintln!` of passing tests, and a skip must be visible. On the GPU machine LILY_REQUIRE_GPU=1
/// makes it a failure, so that a kernel that does not compile there cannot pass as a skip.
pub fn skip_without_gpu(test: &str, e: impl std::fmt::Display) {
    if std::env::var_os("LILY_REQUIRE_GPU").is_some() {
        panic!("{test}: no usable GPU, and LILY_REQUIRE_GPU is set: {e}");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: no usable GPU ({e})");
}
