//! tierkv-engine: the KV-cache engine of a DeepSeek sparse-attention (DSA) server.
//!
//! The engine owns the device and pinned-host pools, the tiered prefix cache, the cache controller
//! (backup and layer-wise load-back), the layer gate, the indexer's model step, the scheduler and
//! the metrics. It reaches time, devices, transfers and cross-thread synchronisation only through
//! [`device::Clock`], [`device::Device`], [`transfer::Transfer`] and the [`sync`] seam, so the same
//! engine runs in production (`runtime`) and inside the deterministic simulator (`tierkv-sim`).

pub mod cache;
pub mod config;
mod controller;
pub mod cpu_device;
pub mod device;
pub mod engine;
pub mod error;
mod exchange;
mod gate;
pub mod input;
pub mod metrics;
pub mod model;
pub mod mutants;
pub mod offload;
pub mod pd;
pub mod pools;
pub mod probe;
pub mod runtime;
pub mod scheduler;
pub mod sync;
pub mod synth;
pub mod trace;
pub mod transfer;

/// The one layout module (it lives in `tierkv-kernels`, below the engine; see its comment).
pub mod layout {
    pub use tierkv_kernels::layout::*;
}

pub use config::{Config, ConfigError};
pub use engine::pair::{PdError, PdPair};
pub use engine::{Engine, EngineError, EngineOptions, StepReport, Transferred};
pub use scheduler::{Output, Rejection, RequestSpec};
