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
    /// `Engine::update_weights` while the engine holds work computed under the current
    /// weights (requests queued or running, copies in flight, exports or imports).
    #[error("weights update refused: the engine is not idle ({0})")]
    NotIdle(String),
    /// `Engine::update_weights` to a version the prefix keys cannot carry.
    #[error("weights version {0} is out of range (at most {max})", max = (1u32 << 16) - 1)]
    WeightsVersion(u32),
}

impl From<TransferError> for EngineError {
    fn from(e: TransferError) -> Self {
        match e {
            TransferError::Device(d) => EngineError::Device(d),
            other => EngineError::Transfer(other),
        }
    }
}
