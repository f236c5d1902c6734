//! The session prefix cache: after each request its decode state (KV cache, GDN recurrent and
//! conv state) is kept with the tokens it has consumed. A new request resumes from the entry
//! whose tokens are the longest strict prefix of its prompt, so each further turn of a
//! conversation costs only its new tokens. A matching `prompt_cache_key` is preferred among
//! prefix matches but never overrides token equality. Entries are evicted least recently used
//! under a byte budget.
//!
//! An entry is checked out (removed) while a request uses it and released afterwards, so the
//! state is never copied on the hot path.

use engine::backend::Backend;
use engine::model::state::DecodeState;

struct Entry<B: Backend> {
    tokens: Vec<u32>,
    state: DecodeState<B>,
    key: Option<String>,
    bytes: usize,
    last_used: u64,
}

pub struct SessionCache<B: Backend> {
    entries: Vec<Entry<B>>,
    budget: usize,
    clock: u64,
}

impl<B: Backend> SessionCache<B> {
    pub fn new(budget_bytes: usize) -> Self {
        SessionCache {
            entries: Vec::new(),
            budget: budget_bytes,
            clock: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Checks out the best entry for `prompt`: among entries whose tokens are a strict prefix of
    /// it, one with a matching key first, then the longest. Returns its state and tokens.
    pub fn acquire(
        &mut self,
        prompt: &[u32],
        key: Option<&str>,
    ) -> Option<(DecodeState<B>, Vec<u32>)> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|(_, e)| {
                (
                    key.is_some() && e.key.as_deref() == key,
                    e.tokens.len(),
                    e.last_used,
                )
            })
            .map(|(i, _)| i)?;
        let e = self.entries.swap_remove(best);
        Some((e.state, e.tokens))
    }

    /// Stores a state after a request (`state.pos == tokens.len()`), then evicts least recently
    /// used entries until the cache fits its budget. An entry alone larger than the budget is
    /// dropped.
    pub fn release(
        &mut self,
        tokens: Vec<u32>,
        state: DecodeState<B>,
        key: Option<String>,
        backend: &B,
    ) {
        if tokens.is_empty() || state.pos != tokens.len() {
            return;
        }
        let bytes = state.bytes(backend);
        if bytes > self.budget {
            return;
        }
        // An entry with exactly these tokens is now redundant.
        self.entries.retain(|e| e.tokens != tokens);
        self.clock += 1;
        self.entries.push(Entry {
            tokens,
            state,
            key,
            bytes,
            last_used: self.clock,
        });
        while self.bytes() > self.budget {
            let Some(lru) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.entries.swap_remove(lru);
        }
    }
}

/// A default budget from the memory available now: a quarter of it, at least 256 MiB.
pub fn default_budget_bytes() -> usize {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<usize>().ok())
    });
    match available {
        Some(kb) => (kb * 1024 / 4).max(256 << 20),
        None => 1 << 30,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::backend::cpu::CpuBackend;
    use engine::model::state::LayerState;

    fn state(b: &CpuBackend, pos: usize) -> DecodeState<CpuBackend> {
        use engine::backend::{AttnShape, Backend};
        let sh = AttnShape {
            heads: 1,
            kv_heads: 1,
            head_dim: 4,
            rotary_dim: 4,
            rope_theta: 1e4,
        };
        let mut cache = b.new_kv_cache(&sh, 64).expect("cache");
        let k = b.upload_tensor(&vec![0.0; pos * 4], pos, 4).expect("k");
        b.kv_append(&mut cache, &k, &k, 0).expect("append");
        DecodeState {
            pos,
            max_seq: 64,
            layers: vec![LayerState::Attn(cache)],
        }
    }

    #[test]
    fn longest_strict_prefix_wins_and_keys_break_ties_only_among_prefixes() {
        let b = CpuBackend::new(1).expect("pool");
        let mut c = SessionCache::new(1 << 20);
        c.release(vec![1, 2], state(&b, 2), Some("a".into()), &b);
        c.release(vec![1, 2, 3], state(&b, 3), None, &b);
        c.release(vec![9, 9, 9, 9], state(&b, 4), Some("a".into()), &b);
        // Longest prefix without a key.
        let (s, t) = c.acquire(&[1, 2, 3, 4], None).expect("hit");
        assert_eq!((t, s.pos), (vec![1, 2, 3], 3));
        c.release(vec![1, 2, 3], s, None, &b);
        // The key prefers the shorter matching entry, but never the non-prefix one.
        let (_, t) = c.acquire(&[1, 2, 3, 4], Some("a")).expect("hit");
        assert_eq!(t, vec![1, 2]);
        // Equal prompts are not strict prefixes.
        assert!(c.acquire(&[1, 2, 3], None).is_none());
        assert!(c.acquire(&[5], Some("a")).is_none());
    }

    #[test]
    fn eviction_is_lru_under_the_byte_budget() {
        let b = CpuBackend::new(1).expect("pool");
        let one = state(&b, 4).bytes(&b);
        let mut c = SessionCache::new(2 * one);
        c.release(vec![1, 1, 1, 1], state(&b, 4), None, &b);
        c.release(vec![2, 2, 2, 2], state(&b, 4), None, &b);
        let (s, t) = c.acquire(&[1, 1, 1, 1, 5], None).expect("hit");
        c.release(t, s, None, &b); // entry 1 is now the most recent
        c.release(vec![3, 3, 3, 3], state(&b, 4), None, &b);
        assert_eq!(c.len(), 2);
        assert!(c.bytes() <= 2 * one);
        assert!(
            c.acquire(&[2, 2, 2, 2, 5], None).is_none(),
            "the least recently used entry was evicted"
        );
        assert!(c.acquire(&[1, 1, 1, 1, 5], None).is_some());
        // An entry larger than the whole budget is not kept.
        let mut tiny = SessionCache::new(one / 2);
        tiny.release(vec![1, 1, 1, 1], state(&b, 4), None, &b);
        assert_eq!(tiny.len(), 0);
    }
}
