//! The decode state of one sequence: per GDN layer the conv window and f32 recurrent state,
//! per attention layer the KV cache, and the position. Prefill and decode share it, so a
//! sequence can be prefilled, decoded, snapshotted (session cache) and resumed.

use crate::backend::Backend;
use crate::error::Result;

pub enum LayerState<B: Backend> {
    Gdn(B::GdnState),
    Attn(B::KvCache),
}

pub struct DecodeState<B: Backend> {
    /// Tokens consumed so far (the position of the next token).
    pub pos: usize,
    pub max_seq: usize,
    pub layers: Vec<LayerState<B>>,
}

impl<B: Backend> DecodeState<B> {
    /// Back to an empty sequence. KV rows past `pos` are simply overwritten later.
    pub fn reset(&mut self, b: &B) -> Result<()> {
        for l in &mut self.layers {
            if let LayerState::Gdn(s) = l {
                b.reset_gdn_state(s)?;
            }
        }
        self.pos = 0;
        Ok(())
    }

    /// An independent copy of this state (the session prefix cache keeps these).
    pub fn snapshot(&self, b: &B) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn(s) => b.clone_gdn_state(s).map(LayerState::Gdn),
                LayerState::Attn(c) => b
                    .clone_kv_cache(c, self.pos, self.max_seq)
                    .map(LayerState::Attn),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DecodeState {
            pos: self.pos,
            max_seq: self.max_seq,
            layers,
        })
    }

    /// Device bytes held by this state.
    pub fn bytes(&self, b: &B) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn(s) => b.gdn_state_bytes(s),
                LayerState::Attn(c) => b.kv_cache_bytes(c),
            })
            .sum()
    }
}
