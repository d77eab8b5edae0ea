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
    /// weights: a step in flight, requests queued or running, loads in flight, exports or
    /// imports held (backups in flight are allowed).
    #[error(
        "weights update refused: the engine is not idle ({step_in_flight} steps in flight, \
         {requests} requests queued or running, {loads} loads in flight, {exports} exports and \
         {imports} import pages held)"
    )]
    NotIdle {
        step_in_flight: usize,
        requests: usize,
        loads: usize,
        exports: usize,
        imports: usize,
    },
    /// `Engine::update_weights` to a version the prefix keys cannot carry.
    #[error(
        "weights version {0} is out of range (at most {max})",
        max = crate::cache::WEIGHTS_VERSION_MAX
    )]
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
