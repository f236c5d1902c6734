//! lily's inference engine: checkpoint loading, tokenizer and chat template, the model graph
//! and its backends. No HTTP here; the `lily` binary builds the server on top.

pub mod backend;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod generate;
pub mod model;
pub mod sampler;
pub mod synth;
pub mod tokenizer;

pub use error::{Error, Result};
