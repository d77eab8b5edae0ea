//! Integration tests of the kernels crate: CPU references against naive f64 recomputations, the
//! fp8 rules, and NVRTC compilation of every CUDA source.

mod conformance;
mod deepseek;
mod fp8;
/// The independent versions of the kernels (the crate's `spec` module).
use tierkv_kernels::spec as naive;
mod nvrtc;
#[cfg(feature = "mutants")]
mod planted_layout;
mod reference;
