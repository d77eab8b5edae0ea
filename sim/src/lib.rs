//! tierkv-sim: the deterministic simulator that tests tierkv's engine, and the `tierkv` CLI.
//!
//! A run ([`runner::run`]) drives the real engine on a simulated GPU ([`gpu::SimGpu`]) through a
//! seeded [`scenario::Scenario`], with the oracles watching ([`oracles`], [`race`]); a campaign
//! ([`campaign`]) runs many seeds, shrinks failures ([`shrink`]) and writes Perfetto traces
//! ([`trace_out`]).

pub mod campaign;
pub mod checked;
pub mod cli;
pub mod corpus;
#[cfg(feature = "cuda")]
pub mod cuda_exec;
pub mod driver;
pub mod fasthash;
pub mod fuzz;
pub mod gpu;
pub mod link;
pub mod offload;
pub mod oracles;
pub mod probes;
pub mod race;
pub mod report;
pub mod rng;
pub mod runner;
pub mod scenario;
pub mod schedule;
pub mod shard;
pub mod shrink;
pub mod targets;
pub mod trace_out;
pub mod undeclared;
