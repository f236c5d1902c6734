//! The backend seam. The model graph (model/qwen3_5_moe.rs) is written once against this trait;
//! every buffer it touches lives on the backend's device and is passed by handle, so a step never
//! reads activations back to the host. The CPU backend's buffers are host memory; a GPU backend's
//! are device memory. Each op here has a plain reference implementation (backend/cpu/reference.rs)
//! that the fast implementations are tested against.

pub mod cpu;
pub mod cuda;

use crate::checkpoint::QWeight;
use crate::error::{Error, Result};
use crate::model::state::DecodeState;
use crate::sampler::SamplingParams;

/// Shape facts of one Gated DeltaNet layer that the ops need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
}

impl GdnShape {
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// Shape facts of one gated full-attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
}

/// How `Backend::profile` times kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProfileMode {
    /// Each launch replayed on its own after the run (decode: kernels of a few microseconds,
    /// whose in-stream timing would be mostly launch gaps).
    Isolated,
    /// Each launch timed where it runs, by events around it (prefill: long kernels).
    InPlace,
}

/// The cost of one kernel (at one grid size) within a profiled run.
#[derive(Clone, Debug)]
pub struct KernelCost {
    pub kernel: String,
    pub launches: usize,
    /// Summed over the launches, each timed on its own.
    pub micros: f64,
    /// Weight bytes the launches stream (quantized products only; 0 elsewhere).
    pub weight_bytes: u64,
}

/// One sampled token asked of the backend: the request's parameters and the draw in [0, 1) the
/// host took from its seeded generator, with the penalties' inputs.
#[derive(Clone, Debug)]
pub struct DeviceSampling<'a> {
    pub params: &'a SamplingParams,
    pub u: f64,
    /// For `Backend::sample`: what the penalties subtract from each generated token's logit
    /// (the parameters' own penalty fields are not read).
    pub penalties: &'a [(u32, f32)],
    /// For `Backend::queue_decode_step` with penalties, at a `StepInput::Host` step: each token
    /// generated so far (the fed token included) and how often, by id (the later steps of the
    /// chain count on the device; they get none).
    pub generated: &'a [(u32, u32)],
}

/// What `Backend::sample` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSample {
    /// The token, chosen where the logits are (only its id was read back).
    Chosen(u32),
    /// The host must read the row and sample it; `penalised` says whether the penalties have
    /// already been applied to the row.
    RowNeeded { penalised: bool },
}

/// The token a chained decode step feeds (`Backend::queue_decode_step`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepInput {
    /// A token the host knows (the one picked from the prompt's logits).
    Host(u32),
    /// The token the previously queued step chose on the device, never read back first.
    Chosen,
}

/// A chained step's model graph: `forward(state, token)` (`Backend::queue_decode_step`).
pub type StepForward<'a, B> =
    dyn FnMut(&mut DecodeState<B>, u32) -> Result<<B as Backend>::Tensor> + 'a;

/// A queued decode step whose chosen token has not been read yet (`Backend::chosen_token`): the
/// position it fed.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a queued step's token is read with Backend::chosen_token"]
pub struct QueuedStep {
    pub pos: usize,
}

pub trait Backend: Send + Sync + 'static {
    /// A 2-D activation `[rows, cols]` (rows = tokens), device-resident.
    type Tensor: Send;
    /// A quantized weight matrix (or a stack of expert matrices) on the device.
    type QMatrix: Send + Sync;
    /// A small dense f32 parameter (norm gains, conv taps, gate constants).
    type Vector: Send + Sync;
    /// The conv window and recurrent state of one GDN layer.
    type GdnState: Send;
    /// The K and V cache of one attention layer.
    type KvCache: Send;
    /// The experts chosen for each token and their mixing weights.
    type Routing: Send;

    fn name(&self) -> String;

    // ---- memory
    fn upload_qmatrix(&self, w: QWeight) -> Result<Self::QMatrix>;
    fn upload_vector(&self, v: &[f32]) -> Result<Self::Vector>;
    fn upload_tensor(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Tensor>;
    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    fn tensor_shape(&self, t: &Self::Tensor) -> (usize, usize);
    fn new_gdn_state(&self, shape: &GdnShape) -> Result<Self::GdnState>;
    fn new_kv_cache(&self, shape: &AttnShape, max_seq: usize) -> Result<Self::KvCache>;
    /// Zero state and window (a fresh sequence).
    fn reset_gdn_state(&self, state: &mut Self::GdnState) -> Result<()>;
    /// A copy of the state (for the session prefix cache).
    fn clone_gdn_state(&self, state: &Self::GdnState) -> Result<Self::GdnState>;
    /// A copy of the first `len` positions of the cache, with room for `max_seq`.
    fn clone_kv_cache(
        &self,
        cache: &Self::KvCache,
        len: usize,
        max_seq: usize,
    ) -> Result<Self::KvCache>;
    /// Device bytes held by a state (for cache budgets).
    fn gdn_state_bytes(&self, state: &Self::GdnState) -> usize;
    fn kv_cache_bytes(&self, cache: &Self::KvCache) -> usize;

    // ---- dense ops
    /// Rows `tokens` of the quantized embedding table, dequantized.
    fn embed(&self, table: &Self::QMatrix, tokens: &[u32]) -> Result<Self::Tensor>;
    /// `x * rsqrt(mean(x^2) + eps) * w` per row.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32) -> Result<Self::Tensor>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// `x @ w^T` with `w` quantized: `[T, K] x [N, K] -> [T, N]`, f32 accumulation.
    fn qmatmul(&self, x: &Self::Tensor, w: &Self::QMatrix) -> Result<Self::Tensor>;
    /// `x @ w^T` for several matrices that read the same input (a layer's input projections):
    /// one launch on a GPU where their bit widths agree.
    fn qmatmul_many(&self, x: &Self::Tensor, ws: &[&Self::QMatrix]) -> Result<Vec<Self::Tensor>> {
        ws.iter().map(|w| self.qmatmul(x, w)).collect()
    }
    /// A GDN layer's in-projections: `qmatmul_many`, then `conv1d_silu` of the first product
    /// (the q, k and v channels) with the taps `conv` and the state's window. A GPU takes one
    /// token's conv in the products' launch.
    fn qmatmul_many_conv1d_silu(
        &self,
        x: &Self::Tensor,
        ws: &[&Self::QMatrix],
        conv: &Self::Vector,
        state: &mut Self::GdnState,
        shape: &GdnShape,
    ) -> Result<Vec<Self::Tensor>> {
        let mut outs = self.qmatmul_many(x, ws)?;
        let Some(channels) = outs.first_mut() else {
            return Err(Error::Backend(
                "qmatmul_many_conv1d_silu: no matrices".into(),
            ));
        };
        *channels = self.conv1d_silu(channels, conv, state, shape)?;
        Ok(outs)
    }
    /// The residual add fused with the next norm: `x += y`, then `rmsnorm(x) * w`.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Vector,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.add_assign(x, y)?;
        self.rms_norm(x, w, eps)
    }
    /// A mixer's output projection into the residual, fused with the next norm: `x += y @ p^T`,
    /// then `rmsnorm(x) * w`.
    fn qmatmul_add_rms_norm(
        &self,
        y: &Self::Tensor,
        p: &Self::QMatrix,
        x: &mut Self::Tensor,
        w: &Self::Vector,
        eps: f32,
    ) -> Result<Self::Tensor> {
        let projected = self.qmatmul(y, p)?;
        self.add_rms_norm(x, &projected, w, eps)
    }
    /// `silu(g) * u`, elementwise.
    fn swiglu(&self, g: &Self::Tensor, u: &Self::Tensor) -> Result<Self::Tensor>;
    /// The last row of `x` (only the last prompt position needs logits).
    fn last_row(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// First index of the maximum of each row (NaN never wins), read back to the host.
    fn argmax_rows(&self, x: &Self::Tensor) -> Result<Vec<u32>>;
    /// `argmax_rows` of a one-row tensor (a logits row): the greedy token.
    fn argmax_row(&self, x: &Self::Tensor) -> Result<u32> {
        self.argmax_rows(x)?
            .first()
            .copied()
            .ok_or_else(|| Error::Backend("argmax of empty logits".into()))
    }

    // ---- Gated DeltaNet
    /// Causal depthwise conv over `x` `[T, C]` continuing from the state's window (taps
    /// `w` tap-major `[K, C]`), then SiLU. Updates the window.
    fn conv1d_silu(
        &self,
        x: &Self::Tensor,
        w: &Self::Vector,
        state: &mut Self::GdnState,
        shape: &GdnShape,
    ) -> Result<Self::Tensor>;
    /// The gated delta rule over `T` tokens: `qkv` is the conv output `[T, C]` (q, k, v
    /// channels), `a`/`b` `[T, Hv]` the gate projections. L2-normalises q and k, computes
    /// decay `exp(-exp(a_log) * softplus(a + dt_bias))` and `beta = sigmoid(b)`, runs the f32
    /// recurrence in the state and returns `y` `[T, Hv*Dv]`.
    #[allow(clippy::too_many_arguments)]
    fn gdn_recurrence(
        &self,
        qkv: &Self::Tensor,
        a: &Self::Tensor,
        b: &Self::Tensor,
        a_log: &Self::Vector,
        dt_bias: &Self::Vector,
        state: &mut Self::GdnState,
        shape: &GdnShape,
    ) -> Result<Self::Tensor>;
    /// `gdn_recurrence`, then `gated_rms_norm` of its output with `z` and the gains `norm` per
    /// value head: a GDN layer's mixer up to its output projection (on a GPU for one token, the
    /// norm is left to that projection).
    #[allow(clippy::too_many_arguments)]
    fn gdn_recurrence_gated_norm(
        &self,
        qkv: &Self::Tensor,
        a: &Self::Tensor,
        b: &Self::Tensor,
        [a_log, dt_bias, norm]: [&Self::Vector; 3],
        z: &Self::Tensor,
        state: &mut Self::GdnState,
        shape: &GdnShape,
        eps: f32,
    ) -> Result<Self::Tensor> {
        let y = self.gdn_recurrence(qkv, a, b, a_log, dt_bias, state, shape)?;
        self.gated_rms_norm(&y, z, norm, shape.value_dim, eps)
    }
    /// Per head of `dim`: `rmsnorm(y) * w * silu(z)`.
    fn gated_rms_norm(
        &self,
        y: &Self::Tensor,
        z: &Self::Tensor,
        w: &Self::Vector,
        dim: usize,
        eps: f32,
    ) -> Result<Self::Tensor>;

    // ---- gated full attention
    /// Splits the per-head interleaved `[q | gate]` projection into q `[T, H*D]` and gate `[T, H*D]`.
    fn split_q_gate(
        &self,
        qg: &Self::Tensor,
        heads: usize,
        head_dim: usize,
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// Per head of `dim`: `rmsnorm(x) * w`.
    fn head_rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Vector,
        dim: usize,
        eps: f32,
    ) -> Result<Self::Tensor>;
    /// Rotate-half RoPE on the first `rotary_dim` dims of each head; row t is at position `pos0 + t`.
    fn rope(&self, x: &mut Self::Tensor, shape: &AttnShape, pos0: usize) -> Result<()>;
    /// Writes k and v rows into the cache at positions `pos0..pos0+T`, each value as
    /// `cpu::reference::kv_value` rounds it (f16).
    fn kv_append(
        &self,
        cache: &mut Self::KvCache,
        k: &Self::Tensor,
        v: &Self::Tensor,
        pos0: usize,
    ) -> Result<()>;
    /// The attention layer's inputs from its projections: q and gate split from `q_gate`
    /// (`split_q_gate`), q and k normed per head by `norms` = [q_norm, k_norm] and rotated, k and
    /// v appended to the cache at `pos0`. Returns (q, gate). A GPU may do it in one launch.
    #[allow(clippy::too_many_arguments)]
    fn attn_prep(
        &self,
        q_gate: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        norms: [&Self::Vector; 2],
        cache: &mut Self::KvCache,
        shape: &AttnShape,
        pos0: usize,
        eps: f32,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        attn_prep_separately(self, q_gate, k, v, norms, cache, shape, pos0, eps)
    }
    /// Causal grouped-query attention of q rows at positions `pos0..pos0+T` over the cache.
    fn attention(
        &self,
        q: &Self::Tensor,
        cache: &Self::KvCache,
        shape: &AttnShape,
        pos0: usize,
    ) -> Result<Self::Tensor>;
    /// `attention(q) * sigmoid(gate)`: the attention layer's gated output. A GPU may apply the
    /// gate in the attention's own launches.
    fn attention_gated(
        &self,
        q: &Self::Tensor,
        gate: &Self::Tensor,
        cache: &Self::KvCache,
        shape: &AttnShape,
        pos0: usize,
    ) -> Result<Self::Tensor> {
        self.sigmoid_mul(&self.attention(q, cache, shape, pos0)?, gate)
    }
    /// The gated attention layer from its projections, up to its output projection: `attn_prep`
    /// (the new k and v appended to the cache at `pos0`), then `attention_gated`. A GPU takes one
    /// token's prep in the attention's own launch.
    #[allow(clippy::too_many_arguments)]
    fn attention_prepped_gated(
        &self,
        q_gate: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        norms: [&Self::Vector; 2],
        cache: &mut Self::KvCache,
        shape: &AttnShape,
        pos0: usize,
        eps: f32,
    ) -> Result<Self::Tensor> {
        let (q, gate) = self.attn_prep(q_gate, k, v, norms, cache, shape, pos0, eps)?;
        self.attention_gated(&q, &gate, cache, shape, pos0)
    }
    /// `x * sigmoid(gate)`, elementwise.
    fn sigmoid_mul(&self, x: &Self::Tensor, gate: &Self::Tensor) -> Result<Self::Tensor>;

    // ---- mixture of experts
    /// Softmax over the router logits, top-k (ties to the lowest expert id), optionally
    /// renormalised over the chosen k.
    fn route(
        &self,
        logits: &Self::Tensor,
        top_k: usize,
        renormalize: bool,
    ) -> Result<Self::Routing>;
    /// The router product and its routing, with the shared-expert gate's logit (both read
    /// `h`): `route(h @ router^T)` and `h @ shared_gate^T`. A GPU may route in the product's
    /// own launch.
    fn route_tokens(
        &self,
        h: &Self::Tensor,
        router: &Self::QMatrix,
        shared_gate: &Self::QMatrix,
        top_k: usize,
        renormalize: bool,
    ) -> Result<(Self::Routing, Self::Tensor)> {
        route_tokens_separately(self, h, router, shared_gate, top_k, renormalize)
    }
    /// `sum_j w_j * down_j(silu(gate_j x) * up_j x)` over each token's chosen experts; the
    /// three stacks hold `E` matrices each.
    fn moe_experts(
        &self,
        x: &Self::Tensor,
        routing: &Self::Routing,
        gate: &Self::QMatrix,
        up: &Self::QMatrix,
        down: &Self::QMatrix,
    ) -> Result<Self::Tensor>;
    /// The whole MoE block: the routed experts mixed by `routing`, plus the shared expert
    /// `down_s(silu(gate_s h) * up_s h)` weighted by `sigmoid(shared_gate_logit)` (one logit
    /// per row). `experts` and `shared` are (gate, up, down).
    fn moe_block(
        &self,
        h: &Self::Tensor,
        routing: &Self::Routing,
        experts: [&Self::QMatrix; 3],
        shared: [&Self::QMatrix; 3],
        shared_gate_logit: &Self::Tensor,
    ) -> Result<Self::Tensor> {
        let [gate, up, down] = experts;
        let mut out = self.moe_experts(h, routing, gate, up, down)?;
        let [sg, su, sd] = shared;
        let g = self.qmatmul(h, sg)?;
        let u = self.qmatmul(h, su)?;
        let y = self.qmatmul(&self.swiglu(&g, &u)?, sd)?;
        self.add_sigmoid_gated(&mut out, &y, shared_gate_logit)?;
        Ok(out)
    }
    /// `moe_block` with the residual add and the next norm: `x += moe_block(h, ...)`, then
    /// `rmsnorm(x) * w`. A GPU may mix the experts' outputs in the norm's launch.
    #[allow(clippy::too_many_arguments)]
    fn moe_block_add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        h: &Self::Tensor,
        routing: &Self::Routing,
        experts: [&Self::QMatrix; 3],
        shared: [&Self::QMatrix; 3],
        shared_gate_logit: &Self::Tensor,
        w: &Self::Vector,
        eps: f32,
    ) -> Result<Self::Tensor> {
        let moe = self.moe_block(h, routing, experts, shared, shared_gate_logit)?;
        self.add_rms_norm(x, &moe, w, eps)
    }
    /// `out += sigmoid(gate_logit) * y`, one gate logit per row (`gate_logit` is `[T, 1]`).
    fn add_sigmoid_gated(
        &self,
        out: &mut Self::Tensor,
        y: &Self::Tensor,
        gate_logit: &Self::Tensor,
    ) -> Result<()>;

    /// The session cache's default budget on this backend, where it differs from the host's
    /// (device memory: a quarter of what is free once the model is loaded).
    fn default_cache_bytes(&self) -> Option<usize> {
        None
    }

    /// Prompt tokens per prefill forward: enough to keep the products matrix-matrix, few
    /// enough to bound activation memory.
    fn prefill_chunk(&self) -> usize {
        512
    }

    // ---- decode steps
    /// From now on, leaves every launch whose profile label starts with `label` out of the
    /// recorded decode steps, so that a benchmark measures what that kernel family costs inside
    /// the step (`lily bench --without-kernel`). The step's outputs are then meaningless: for
    /// measurement only, never for serving. Backends that record no steps refuse.
    fn leave_out_of_decode(&self, label: &str) -> Result<()> {
        Err(Error::Invalid(format!(
            "leaving `{label}` out: this backend records no decode steps (GPU only)"
        )))
    }

    /// Runs `run` (one decode step, one prefill chunk) and, where the backend can, times each
    /// kernel it launched as `mode` says. `None` where the backend has no kernels to time.
    fn profile(
        &self,
        mode: ProfileMode,
        run: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<Vec<KernelCost>>> {
        let _ = mode;
        run()?;
        Ok(None)
    }

    /// Samples one token from `logits` (`[1, vocab]`) as `engine::sampler::Sampler` does on
    /// the host, with the host's draw `req.u`. The default asks for the row.
    fn sample(&self, logits: &Self::Tensor, req: &DeviceSampling) -> Result<DeviceSample> {
        let _ = (logits, req);
        Ok(DeviceSample::RowNeeded { penalised: false })
    }

    /// Whether `queue_decode_step` chains steps that choose as `p` says: every choice made on
    /// the device, never needing the logits row on the host. The default chains none.
    fn chains_decode(&self, p: &SamplingParams) -> bool {
        let _ = p;
        false
    }

    /// Queues one decode step feeding `input` at `state.pos` that then chooses the next token
    /// on the device as `choice` says (the host sampler's rule and draw; penalties from counts
    /// the device keeps: `choice.generated` at a `StepInput::Host` step, then each chosen token
    /// added), and returns without waiting for it: the host queues the next step, feeding
    /// `StepInput::Chosen`, before it reads this one's token. `forward(state, token)` runs the
    /// model graph on `token` (a backend recording the step passes any id: its recording reads
    /// the token on the device). Only for parameters `chains_decode` accepts; at most two steps
    /// may wait unread, and a step left unread is dropped by the next `StepInput::Host` step.
    fn queue_decode_step(
        &self,
        state: &mut DecodeState<Self>,
        input: StepInput,
        choice: &DeviceSampling,
        forward: &mut StepForward<'_, Self>,
    ) -> Result<QueuedStep>
    where
        Self: Sized,
    {
        let _ = (state, input, choice, forward);
        Err(Error::Backend(format!(
            "the {} backend does not chain decode steps",
            self.name()
        )))
    }

    /// Waits for a queued step and returns the token it chose.
    fn chosen_token(&self, step: QueuedStep) -> Result<u32> {
        let _ = step;
        Err(Error::Backend(format!(
            "the {} backend does not chain decode steps",
            self.name()
        )))
    }

    /// One single-token decode step feeding `token` at `state.pos`: `forward` runs the model
    /// graph (and advances the state). A backend may record the step's ops once and replay the
    /// recording for later steps on the same state buffers (CUDA graphs); the logits it returns
    /// are then valid until the next step. The default runs `forward` every time.
    fn decode_step(
        &self,
        state: &mut DecodeState<Self>,
        token: u32,
        forward: &mut dyn FnMut(&mut DecodeState<Self>) -> Result<Self::Tensor>,
    ) -> Result<Self::Tensor>
    where
        Self: Sized,
    {
        let _ = token;
        forward(state)
    }
}

/// `Backend::attn_prep` as its parts: the split, the two head norms, RoPE on q and k, the append.
#[allow(clippy::too_many_arguments)]
pub fn attn_prep_separately<B: Backend + ?Sized>(
    b: &B,
    q_gate: &B::Tensor,
    k: &B::Tensor,
    v: &B::Tensor,
    [q_norm, k_norm]: [&B::Vector; 2],
    cache: &mut B::KvCache,
    sh: &AttnShape,
    pos0: usize,
    eps: f32,
) -> Result<(B::Tensor, B::Tensor)> {
    let (q, gate) = b.split_q_gate(q_gate, sh.heads, sh.head_dim)?;
    let mut q = b.head_rms_norm(&q, q_norm, sh.head_dim, eps)?;
    let mut k = b.head_rms_norm(k, k_norm, sh.head_dim, eps)?;
    b.rope(&mut q, sh, pos0)?;
    b.rope(&mut k, sh, pos0)?;
    b.kv_append(cache, &k, v, pos0)?;
    Ok((q, gate))
}

/// `Backend::route_tokens` as its parts: both products (one launch where the backend batches
/// them), then `route`.
pub fn route_tokens_separately<B: Backend + ?Sized>(
    b: &B,
    h: &B::Tensor,
    router: &B::QMatrix,
    shared_gate: &B::QMatrix,
    top_k: usize,
    renormalize: bool,
) -> Result<(B::Routing, B::Tensor)> {
    let [logits, shared_gate_logit] = products(b.qmatmul_many(h, &[router, shared_gate])?)?;
    Ok((b.route(&logits, top_k, renormalize)?, shared_gate_logit))
}

/// The outputs of a batched product (`qmatmul_many`) as an array of the `N` it was given.
pub fn products<T, const N: usize>(outs: Vec<T>) -> Result<[T; N]> {
    let n = outs.len();
    outs.try_into().map_err(|_| {
        Error::Backend(format!(
            "a batched product returned {n} outputs, expected {N}"
        ))
    })
}
