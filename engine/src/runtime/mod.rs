//! The production runtime: the only module of the engine that may name real time, threads, tokio
//! and cudarc (ARCHITECTURE.md; checked by `tests/it/architecture.rs`). It provides the real
//! clock, the device runtime over the driver seam (`driven`, `driver`) with cudarc's driver
//! below it (`cuda`, feature `cuda`), and the service around the engine: tokio intake with
//! admission answers, the engine loop on its own thread, `/metrics` over loopback HTTP, and
//! graceful shutdown.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod driven;
pub mod driver;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod ring;
pub mod service;
mod staging;

use crate::device::Clock;
use std::time::Instant;

/// Monotonic nanoseconds since the clock was made.
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        MonotonicClock {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }
}
