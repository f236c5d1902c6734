//! Model graphs, one file per architecture, and the decode state they share.

pub mod qwen3_5_moe;
pub mod state;
