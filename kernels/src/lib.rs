//! tierkv-kernels: the kernels of the DeepSeek sparse-attention indexer path and the KV cache.
//!
//! Each kernel has one CPU reference ([`cpu`]) and CUDA versions (`cuda/*.cu`, compiled at run
//! time by NVRTC, launched through [`cuda`] when the `cuda` feature is on). [`spec`] is the
//! specification the references and the CUDA kernels are held to, with arithmetic and byte
//! formats of its own. The [`layout`] module is where the engine, the references and the
//! launchers take every byte size and offset from; the engine re-exports it.

pub mod args;
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
