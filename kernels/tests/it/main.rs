//! Integration tests of the kernels crate: CPU references against naive f64 recomputations, the
//! fp8 rules, and NVRTC compilation of every CUDA source.

mod conformance;
mod fp8;
mod naive;
mod nvrtc;
mod reference;
