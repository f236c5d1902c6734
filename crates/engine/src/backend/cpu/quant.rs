//! Fast CPU products with MLX affine 4/8-bit weights, with run-time SIMD dispatch.
//!
//! Decode (few rows of x): a matrix-vector product straight from the packed codes. Per group
//! `y += scale * sum(q * x) + bias * sum(x)`, with `sum(x)` computed once per group. The AVX2
//! kernel loads eight u32 words (one 4-bit group) and peels one code from each lane per shift,
//! so it consumes x in a lane-strided order: x is permuted once per call to match.
//! Prefill (many rows): rows of the weight are dequantized into f32 tiles once and reused for
//! every token, then multiplied with an AVX2 register-tiled kernel.

use rayon::prelude::*;

use crate::checkpoint::QWeight;

/// SIMD level picked at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    Scalar,
    Avx2,
}

impl Simd {
    pub fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            if std::env::var_os("LILY_CPU_SIMD").is_some_and(|v| v == "scalar") {
                return Simd::Scalar;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Simd::Avx2;
            }
        }
        Simd::Scalar
    }
}

/// x rearranged for the lane-strided kernels, plus per-group sums.
struct PreparedX {
    xp: Vec<f32>,
    sumx: Vec<f32>,
}

fn prepare_x(x: &[f32], bits: u32, group: usize) -> PreparedX {
    let per = 32 / bits as usize;
    let block = 8 * per; // elements covered by eight u32 words
    let mut xp = vec![0.0f32; x.len()];
    for (src, dst) in x.chunks_exact(block).zip(xp.chunks_exact_mut(block)) {
        for w in 0..8 {
            for j in 0..per {
                dst[j * 8 + w] = src[w * per + j];
            }
        }
    }
    if bits == 4 {
        // The 4-bit kernels read codes as 1 + q/16 and so take 16·x (exact: a power of two).
        xp.iter_mut().for_each(|v| *v *= 16.0);
    }
    let sumx = x.chunks(group).map(|g| g.iter().sum()).collect();
    PreparedX { xp, sumx }
}

/// Words, scales and biases of row `r`.
fn row_parts(w: &QWeight, r: usize) -> (&[u32], &[half::bf16], &[half::bf16]) {
    let wpr = w.words_per_row();
    let gpr = w.groups_per_row();
    (
        &w.codes[r * wpr..(r + 1) * wpr],
        &w.scales[r * gpr..(r + 1) * gpr],
        &w.biases[r * gpr..(r + 1) * gpr],
    )
}

/// One output of the matrix-vector product, scalar, in the natural element order.
fn dot_row_scalar(w: &QWeight, r: usize, x: &[f32], sumx: &[f32]) -> f32 {
    let (words, scales, biases) = row_parts(w, r);
    let per = 32 / w.bits as usize;
    let mask = (1u32 << w.bits) - 1;
    let wpg = w.group_size / per;
    let mut total = 0.0f32;
    for g in 0..scales.len() {
        let mut acc = 0.0f32;
        for (wi, &word) in words[g * wpg..(g + 1) * wpg].iter().enumerate() {
            for j in 0..per {
                let q = (word >> (w.bits as usize * j)) & mask;
                acc += q as f32 * x[g * w.group_size + wi * per + j];
            }
        }
        total += scales[g].to_f32() * acc + biases[g].to_f32() * sumx[g];
    }
    total
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::bf16;

    /// How far ahead (in u32 words, 8 KiB) the 4-bit kernel prefetches each row's codes: four
    /// rows are four streams, and the hardware prefetcher alone left the product short of the
    /// memory bandwidth (measured in docs/performance.md).
    const PREFETCH_WORDS: usize = 2048;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// `acc += sum_j (1 + q_j/16) * xg[8j..8j+8]` for the eight nibbles `q_j` of each u32 lane of
    /// `v`. Each nibble is moved into mantissa bits 19..22 under the exponent of 1.0 (one shift,
    /// one and, one or per eight codes), which avoids the int-to-float conversion that competes
    /// with the FMAs for ports. The floats are made one at a time, right before their FMA, so
    /// the caller's accumulators stay in the sixteen ymm registers.
    /// `dot = sum((1 + q/16) * 16x) - 16 sum(x)`; the kernels fold the `-16 sum(x)` into the bias.
    macro_rules! fma_nibbles {
        ($acc:expr, $v:expr, $xg:expr) => {{
            let mask = _mm256_set1_epi32(0x0078_0000);
            let one = _mm256_set1_epi32(0x3F80_0000);
            let v = $v;
            macro_rules! step {
                ($j:literal, $t:expr) => {
                    $acc = _mm256_fmadd_ps(
                        _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256($t, mask), one)),
                        _mm256_loadu_ps($xg.add($j * 8)),
                        $acc,
                    );
                };
            }
            step!(0, _mm256_slli_epi32::<19>(v));
            step!(1, _mm256_slli_epi32::<15>(v));
            step!(2, _mm256_slli_epi32::<11>(v));
            step!(3, _mm256_slli_epi32::<7>(v));
            step!(4, _mm256_slli_epi32::<3>(v));
            step!(5, _mm256_srli_epi32::<1>(v));
            step!(6, _mm256_srli_epi32::<5>(v));
            step!(7, _mm256_srli_epi32::<9>(v));
        }};
    }

    /// One output of a 4-bit product; `xp` is 16·x permuted by `prepare_x`.
    #[target_feature(enable = "avx2,fma")]
    pub fn dot_row_q4(
        words: &[u32],
        scales: &[bf16],
        biases: &[bf16],
        xp: &[f32],
        sumx: &[f32],
    ) -> f32 {
        let groups = scales.len();
        assert!(words.len() >= groups * 8 && xp.len() >= groups * 64 && sumx.len() >= groups);
        let mut total = _mm256_setzero_ps();
        let mut bias_acc = 0.0f32;
        for g in 0..groups {
            // SAFETY: the assert above bounds every access: 8 words and 64 floats per group.
            unsafe {
                let v = _mm256_loadu_si256(words.as_ptr().add(g * 8) as *const __m256i);
                let xg = xp.as_ptr().add(g * 64);
                let mut acc = _mm256_setzero_ps();
                fma_nibbles!(acc, v, xg);
                total = _mm256_fmadd_ps(acc, _mm256_set1_ps(scales[g].to_f32()), total);
            }
            bias_acc += (biases[g].to_f32() - 16.0 * scales[g].to_f32()) * sumx[g];
        }
        hsum(total) + bias_acc
    }

    /// Four consecutive rows of a 4-bit product at once: `words`, `scales`, `biases` hold the
    /// four rows back to back. Sharing each x load across four independent FMA chains keeps the
    /// ports busy instead of waiting on one chain's latency.
    #[target_feature(enable = "avx2,fma")]
    pub fn dot4_rows_q4(
        words: &[u32],
        scales: &[bf16],
        biases: &[bf16],
        xp: &[f32],
        sumx: &[f32],
    ) -> [f32; 4] {
        let groups = scales.len() / 4;
        let wpr = groups * 8;
        assert!(
            words.len() >= 4 * wpr
                && biases.len() >= 4 * groups
                && xp.len() >= groups * 64
                && sumx.len() >= groups
        );
        let mut total = [_mm256_setzero_ps(); 4];
        let mut bias_acc = [0.0f32; 4];
        for g in 0..groups {
            // SAFETY: the assert above bounds every access: row r's group g is words
            // [r*wpr + g*8, +8) and floats [g*64, +64).
            unsafe {
                let xg = xp.as_ptr().add(g * 64);
                // One FMA chain per row: four independent chains of eight per group keep both
                // FMA pipes busy without spilling accumulators out of the registers.
                for r in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(
                        words
                            .as_ptr()
                            .wrapping_add(r * wpr + g * 8 + PREFETCH_WORDS)
                            as *const i8,
                    );
                }
                let w = words.as_ptr().add(g * 8);
                let v0 = _mm256_loadu_si256(w as *const __m256i);
                let v1 = _mm256_loadu_si256(w.add(wpr) as *const __m256i);
                let v2 = _mm256_loadu_si256(w.add(2 * wpr) as *const __m256i);
                let v3 = _mm256_loadu_si256(w.add(3 * wpr) as *const __m256i);
                let (mut a0, mut a1, mut a2, mut a3) = (
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                    _mm256_setzero_ps(),
                );
                let mask = _mm256_set1_epi32(0x0078_0000);
                let one = _mm256_set1_epi32(0x3F80_0000);
                // Nibble j of every lane as the float 1 + q/16 (see fma_nibbles!), the four rows
                // interleaved so their independent FMA chains overlap.
                macro_rules! step {
                    ($j:literal, $shift:ident, $n:literal) => {{
                        let xv = _mm256_loadu_ps(xg.add($j * 8));
                        let f = |v| {
                            _mm256_castsi256_ps(_mm256_or_si256(
                                _mm256_and_si256($shift::<$n>(v), mask),
                                one,
                            ))
                        };
                        a0 = _mm256_fmadd_ps(f(v0), xv, a0);
                        a1 = _mm256_fmadd_ps(f(v1), xv, a1);
                        a2 = _mm256_fmadd_ps(f(v2), xv, a2);
                        a3 = _mm256_fmadd_ps(f(v3), xv, a3);
                    }};
                }
                step!(0, _mm256_slli_epi32, 19);
                step!(1, _mm256_slli_epi32, 15);
                step!(2, _mm256_slli_epi32, 11);
                step!(3, _mm256_slli_epi32, 7);
                step!(4, _mm256_slli_epi32, 3);
                step!(5, _mm256_srli_epi32, 1);
                step!(6, _mm256_srli_epi32, 5);
                step!(7, _mm256_srli_epi32, 9);
                let acc = [a0, a1, a2, a3];
                for r in 0..4 {
                    total[r] = _mm256_fmadd_ps(
                        acc[r],
                        _mm256_set1_ps(scales[r * groups + g].to_f32()),
                        total[r],
                    );
                }
            }
            for (r, b) in bias_acc.iter_mut().enumerate() {
                let (s, bi) = (
                    scales[r * groups + g].to_f32(),
                    biases[r * groups + g].to_f32(),
                );
                *b += (bi - 16.0 * s) * sumx[g];
            }
        }
        [
            hsum(total[0]) + bias_acc[0],
            hsum(total[1]) + bias_acc[1],
            hsum(total[2]) + bias_acc[2],
            hsum(total[3]) + bias_acc[3],
        ]
    }

    /// One output of an 8-bit product (two 8-word blocks per group of 64).
    #[target_feature(enable = "avx2,fma")]
    pub fn dot_row_q8(
        words: &[u32],
        scales: &[bf16],
        biases: &[bf16],
        xp: &[f32],
        sumx: &[f32],
    ) -> f32 {
        let groups = scales.len();
        assert!(words.len() >= groups * 16 && xp.len() >= groups * 64 && sumx.len() >= groups);
        let mask = _mm256_set1_epi32(0xFF);
        let mut total = _mm256_setzero_ps();
        let mut bias_acc = 0.0f32;
        for g in 0..groups {
            // SAFETY: bounded by the assert above: 16 words and 64 floats per group.
            unsafe {
                let mut a0 = _mm256_setzero_ps();
                let mut a1 = _mm256_setzero_ps();
                for blk in 0..2 {
                    let mut v =
                        _mm256_loadu_si256(words.as_ptr().add(g * 16 + blk * 8) as *const __m256i);
                    let xg = xp.as_ptr().add(g * 64 + blk * 32);
                    for j in (0..4).step_by(2) {
                        let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
                        v = _mm256_srli_epi32::<8>(v);
                        let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
                        v = _mm256_srli_epi32::<8>(v);
                        a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xg.add(j * 8)), a0);
                        a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xg.add(j * 8 + 8)), a1);
                    }
                }
                total = _mm256_fmadd_ps(
                    _mm256_add_ps(a0, a1),
                    _mm256_set1_ps(scales[g].to_f32()),
                    total,
                );
            }
            bias_acc += biases[g].to_f32() * sumx[g];
        }
        hsum(total) + bias_acc
    }

    /// `out[t][r] = dot(x[t], w[r])` for a tile of dequantized weight rows `w` `[R, k]` and all
    /// tokens `x` `[T, k]`; `out` has row stride `ldo`. Two tokens by four rows per register tile.
    #[target_feature(enable = "avx2,fma")]
    pub fn gemm_tile(
        x: &[f32],
        t: usize,
        w: &[f32],
        rows: usize,
        k: usize,
        out: &mut [f32],
        ldo: usize,
    ) {
        assert!(k.is_multiple_of(8) && x.len() >= t * k && w.len() >= rows * k);
        assert!(t == 0 || out.len() >= (t - 1) * ldo + rows);
        let mut i = 0;
        while i < t {
            let ti = (t - i).min(2);
            let mut r = 0;
            while r < rows {
                let ri = (rows - r).min(4);
                let mut acc = [[_mm256_setzero_ps(); 4]; 2];
                let mut c = 0;
                while c < k {
                    // SAFETY: i+a < t, r+b < rows and c+8 <= k, within the asserted lengths.
                    unsafe {
                        let mut wv = [_mm256_setzero_ps(); 4];
                        for (b, wvb) in wv.iter_mut().enumerate().take(ri) {
                            *wvb = _mm256_loadu_ps(w.as_ptr().add((r + b) * k + c));
                        }
                        for (a, acc_a) in acc.iter_mut().enumerate().take(ti) {
                            let xv = _mm256_loadu_ps(x.as_ptr().add((i + a) * k + c));
                            for b in 0..ri {
                                acc_a[b] = _mm256_fmadd_ps(xv, wv[b], acc_a[b]);
                            }
                        }
                    }
                    c += 8;
                }
                for (a, acc_a) in acc.iter().enumerate().take(ti) {
                    for (b, acc_ab) in acc_a.iter().enumerate().take(ri) {
                        out[(i + a) * ldo + r + b] = hsum(*acc_ab);
                    }
                }
                r += ri;
            }
            i += ti;
        }
    }
}

/// Dequantizes rows `r0..r0+n` into `out` `[n, cols]`.
fn dequant_rows(w: &QWeight, r0: usize, n: usize, out: &mut [f32]) {
    let per = 32 / w.bits as usize;
    let mask = (1u32 << w.bits) - 1;
    for r in 0..n {
        let (words, scales, biases) = row_parts(w, r0 + r);
        let dst = &mut out[r * w.cols..(r + 1) * w.cols];
        for (c, word) in words.iter().enumerate() {
            let g = c * per / w.group_size;
            let (s, b) = (scales[g].to_f32(), biases[g].to_f32());
            for j in 0..per {
                dst[c * per + j] = s * ((word >> (w.bits as usize * j)) & mask) as f32 + b;
            }
        }
    }
}

/// Rows of the weight handled by one parallel task.
const ROWS_PER_TASK: usize = 64;
/// Up to this many tokens the product runs as matrix-vector products from the packed codes.
const GEMV_MAX_TOKENS: usize = 2;

/// `y[t][n] = sum_k x[t][k] * w[n][k]` for rows `rows` of `w`, written to `out[t][n - rows.start]`
/// (row stride `ldo`). Runs on the current rayon pool.
pub fn qmatmul_rows(
    simd: Simd,
    x: &[f32],
    t: usize,
    w: &QWeight,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    ldo: usize,
) {
    let k = w.cols;
    let n = rows.len();
    debug_assert!(x.len() >= t * k && out.len() >= t.saturating_sub(1) * ldo + n);
    if t <= GEMV_MAX_TOKENS {
        for i in 0..t {
            let xi = &x[i * k..(i + 1) * k];
            let prep = if simd == Simd::Avx2 {
                prepare_x(xi, w.bits, w.group_size)
            } else {
                PreparedX {
                    xp: Vec::new(),
                    sumx: xi.chunks(w.group_size).map(|g| g.iter().sum()).collect(),
                }
            };
            let oi = &mut out[i * ldo..i * ldo + n];
            oi.par_chunks_mut(ROWS_PER_TASK)
                .enumerate()
                .for_each(|(ci, chunk)| {
                    let r0 = rows.start + ci * ROWS_PER_TASK;
                    let mut j = 0;
                    while j < chunk.len() {
                        let four = if j + 4 <= chunk.len() {
                            dot4_rows(simd, w, r0 + j, &prep)
                        } else {
                            None
                        };
                        if let Some(four) = four {
                            chunk[j..j + 4].copy_from_slice(&four);
                            j += 4;
                        } else {
                            chunk[j] = dot_row(simd, w, r0 + j, xi, &prep);
                            j += 1;
                        }
                    }
                });
        }
        return;
    }
    // Prefill: each task dequantizes its rows once and multiplies them with every token.
    let chunks: Vec<(usize, Vec<f32>)> = (0..n)
        .into_par_iter()
        .step_by(ROWS_PER_TASK)
        .map(|start| {
            let len = ROWS_PER_TASK.min(n - start);
            let mut tile = vec![0.0f32; len * k];
            dequant_rows(w, rows.start + start, len, &mut tile);
            let mut part = vec![0.0f32; t * len];
            gemm(simd, x, t, &tile, len, k, &mut part, len);
            (start, part)
        })
        .collect();
    for (start, part) in chunks {
        let len = part.len() / t;
        for i in 0..t {
            out[i * ldo + start..i * ldo + start + len]
                .copy_from_slice(&part[i * len..(i + 1) * len]);
        }
    }
}

/// Rows `r..r+4` at once where a four-row kernel exists (4-bit on AVX2).
fn dot4_rows(simd: Simd, w: &QWeight, r: usize, prep: &PreparedX) -> Option<[f32; 4]> {
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2 && w.bits == 4 && r + 4 <= w.rows {
        let (wpr, gpr) = (w.words_per_row(), w.groups_per_row());
        let words = &w.codes[r * wpr..(r + 4) * wpr];
        let scales = &w.scales[r * gpr..(r + 4) * gpr];
        let biases = &w.biases[r * gpr..(r + 4) * gpr];
        // SAFETY: Simd::Avx2 is only chosen after detecting avx2 and fma.
        return Some(unsafe { avx2::dot4_rows_q4(words, scales, biases, &prep.xp, &prep.sumx) });
    }
    let _ = (simd, w, r, prep);
    None
}

fn dot_row(simd: Simd, w: &QWeight, r: usize, x: &[f32], prep: &PreparedX) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2 {
        let (words, scales, biases) = row_parts(w, r);
        // SAFETY: Simd::Avx2 is only chosen after detecting avx2 and fma.
        return unsafe {
            match w.bits {
                4 => avx2::dot_row_q4(words, scales, biases, &prep.xp, &prep.sumx),
                _ => avx2::dot_row_q8(words, scales, biases, &prep.xp, &prep.sumx),
            }
        };
    }
    let _ = simd;
    dot_row_scalar(w, r, x, &prep.sumx)
}

/// `out[t][r] = dot(x[t], tile[r])`.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    simd: Simd,
    x: &[f32],
    t: usize,
    tile: &[f32],
    rows: usize,
    k: usize,
    out: &mut [f32],
    ldo: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2 && k.is_multiple_of(8) {
        // SAFETY: Simd::Avx2 is only chosen after detecting avx2 and fma.
        unsafe { avx2::gemm_tile(x, t, tile, rows, k, out, ldo) };
        return;
    }
    let _ = simd;
    for i in 0..t {
        for r in 0..rows {
            out[i * ldo + r] = x[i * k..(i + 1) * k]
                .iter()
                .zip(&tile[r * k..(r + 1) * k])
                .map(|(a, b)| a * b)
                .sum();
        }
    }
}

/// The whole product `[T, K] x [N, K]^T`.
pub fn qmatmul(simd: Simd, x: &[f32], t: usize, w: &QWeight) -> Vec<f32> {
    let mut out = vec![0.0f32; t * w.rows];
    qmatmul_rows(simd, x, t, w, 0..w.rows, &mut out, w.rows);
    out
}

/// Rows of `w` for `tokens`, dequantized (the embedding lookup).
pub fn embed(w: &QWeight, tokens: &[u32]) -> Vec<f32> {
    let mut out = vec![0.0f32; tokens.len() * w.cols];
    for (i, &tok) in tokens.iter().enumerate() {
        dequant_rows(w, tok as usize, 1, &mut out[i * w.cols..(i + 1) * w.cols]);
    }
    out
}
