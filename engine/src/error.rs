//! The engine's error: the conditions its callers handle (a refused configuration, a device or
//! transfer error). Broken invariants are panics instead.

use crate::device::DeviceError;
use crate::transfer::TransferError;

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("device: {0}")]
    Device(#[from] DeviceError),
    /// A transfer refused (its message says so: "transfer refused: ...").
    #[error(transparent)]
    Transfer(TransferError),
}

impl From<TransferError> for EngineError {
    fn from(e: TransferError) -> Self {
        match e {
            TransferError::Device(d) => EngineError::Device(d),
            other => EngineError::Transfer(other),
        }
    }
}
