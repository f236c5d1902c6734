//! CUDA kernels against the CPU reference on random inputs (NMSE, as llama.cpp's
//! test-backend-ops does). Needs a GPU: without one each test prints SKIPPED and why.

use std::io::Write;

use common::{nmse, qweight};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use engine::backend::cpu::reference as r;
use engine::backend::cuda::device::CudaDevice;
use engine::checkpoint::QWeight;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;

fn device_or_skip(test: &str) -> Option<CudaDevice> {
    match CudaDevice::open(0) {
        Ok(d) => Some(d),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: no usable GPU ({e})");
            None
        }
    }
}

/// y = w x on the GPU with the q4/q8 GEMV kernel; returns y and the kernel time in ms
/// (median of `reps` launches).
fn gpu_gemv(dev: &CudaDevice, w: &QWeight, x: &[f32], reps: usize) -> (Vec<f32>, f32) {
    let s = &dev.stream;
    let as_u16 = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
    let codes = s.clone_htod(&w.codes[..]).expect("codes");
    let scales = s.clone_htod(&as_u16(&w.scales)).expect("scales");
    let biases = s.clone_htod(&as_u16(&w.biases)).expect("biases");
    let xd = s.clone_htod(x).expect("x");
    let mut y = s.alloc_zeros::<f32>(w.rows).expect("y");
    let f = dev
        .function(
            "quant",
            if w.bits == 4 {
                "q4_gemv_f32"
            } else {
                "q8_gemv_f32"
            },
        )
        .expect("kernel");
    let (rows, cols) = (w.rows as i32, w.cols as i32);
    let threads = 256u32;
    // 8 warps per block, 4 rows per warp (ROWS_PER_WARP); x staged in shared memory.
    let rows_per_block = (threads / 32) * 4;
    let cfg = LaunchConfig {
        grid_dim: ((w.rows as u32).div_ceil(rows_per_block), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 4 * w.cols as u32,
    };
    let mut times = Vec::new();
    for _ in 0..reps.max(1) {
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = dev.ctx.new_event(timed).expect("event");
        let stop = dev.ctx.new_event(timed).expect("event");
        start.record(s).expect("record");
        let mut b = s.launch_builder(&f);
        b.arg(&codes)
            .arg(&scales)
            .arg(&biases)
            .arg(&xd)
            .arg(&mut y)
            .arg(&rows)
            .arg(&cols);
        // SAFETY: the argument list matches the kernel's signature, and the grid covers one
        // warp per row with buffers of exactly those sizes.
        unsafe { b.launch(cfg) }.expect("launch");
        stop.record(s).expect("record");
        s.synchronize().expect("sync");
        times.push(start.elapsed_ms(&stop).expect("elapsed"));
    }
    times.sort_by(|a, b| a.total_cmp(b));
    (s.clone_dtoh(&y).expect("download"), times[times.len() / 2])
}

#[test]
fn quantized_gemv_matches_the_cpu_reference() {
    let Some(dev) = device_or_skip("quantized_gemv_matches_the_cpu_reference") else {
        return;
    };
    eprintln!("device {} ({})", dev.name, dev.arch);
    let mut rng = StdRng::seed_from_u64(11);
    for bits in [4, 8] {
        for (rows, cols) in [
            (1, 64),
            (3, 128),
            (65, 192),
            (257, 2048),
            (512, 4096),
            (1000, 512),
        ] {
            let w = qweight(&mut rng, rows, cols, bits);
            let x: Vec<f32> = (0..cols).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
            let (got, _) = gpu_gemv(&dev, &w, &x, 1);
            let err = nmse(&got, &r::qmatmul(&x, 1, &w));
            assert!(err < 1e-10, "q{bits} {rows}x{cols}: nmse {err:e}");
        }
    }
}

#[test]
fn quantized_gemv_bandwidth_is_reported() {
    // A measurement, printed for docs/performance.md; nothing is asserted about its speed.
    let Some(dev) = device_or_skip("quantized_gemv_bandwidth_is_reported") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(12);
    let (rows, cols) = (248_320, 2048); // the lm_head of Qwen3.6-35B-A3B
    let w = qweight(&mut rng, rows, cols, 4);
    let x: Vec<f32> = (0..cols).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
    let (got, ms) = gpu_gemv(&dev, &w, &x, 20);
    let expect = r::qmatmul(&x, 1, &w);
    assert!(nmse(&got, &expect) < 1e-10);
    let bytes = (rows * cols / 2 + 4 * rows * cols / 64) as f64;
    let _ = writeln!(
        std::io::stderr(),
        "q4 GEMV {rows}x{cols} on {}: {ms:.3} ms, {:.0} GB/s",
        dev.name,
        bytes / (ms as f64 * 1e-3) / 1e9
    );
}
