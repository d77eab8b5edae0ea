//! Integration tests of the engine through its public entry points, on the in-order CPU device.

mod architecture;
mod cache_locks;
mod cache_model;
mod config_docs;
mod cpu_device;
mod cuda_device;
mod device_calls;
mod engine_smoke;
mod input;
mod pd;
mod service;
mod trace;
#[cfg(feature = "mutants")]
mod zoo_points;
