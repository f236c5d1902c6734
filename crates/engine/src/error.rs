//! The engine's error type: every failure names what went wrong and where.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// config.json is missing, malformed or describes an unsupported model.
    #[error("config: {0}")]
    Config(String),
    /// A safetensors file or one of its tensors is missing, corrupt or unexpected.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A request that the engine cannot run as asked (bad token id, sequence too long, ...).
    #[error("{0}")]
    Invalid(String),
    /// A backend failed (allocation, device error).
    #[error("backend: {0}")]
    Backend(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn config(msg: impl Into<String>) -> Self {
        Error::Config(msg.into())
    }
    pub fn checkpoint(msg: impl Into<String>) -> Self {
        Error::Checkpoint(msg.into())
    }
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::Invalid(msg.into())
    }
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
