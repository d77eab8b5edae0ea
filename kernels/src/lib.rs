//! tierkv-kernels: the kernels of the DeepSeek sparse-attention indexer path and the KV cache.
//!
//! Each kernel has one CPU reference ([`cpu`]), its specification on byte buffers in the DESIGN §3
//! layouts, and one CUDA version (`cuda/*.cu`, compiled at run time by NVRTC, launched through
//! [`cuda`] when the `cuda` feature is on). The [`layout`] module is the one place that computes
//! byte sizes and offsets; the engine re-exports it.

pub mod cpu;
pub mod cuda;
pub mod error;
pub mod layout;
pub mod mutants;
pub mod rope;
pub mod spec;

pub use error::{KernelError, Result};
// The names of the formats, for `spec` (which must not use the layout module's sizes and offsets).
pub use layout::{HostLayout, IndexKDtype, KvDtype};
