//! Cross-crate integration tests: the engine with the simulator's oracles and the kernels.

mod acceptance;
mod scenarios;
mod tidy;
mod zoo;
