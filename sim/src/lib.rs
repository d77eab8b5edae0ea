//! tierkv-sim: the deterministic simulator that tests tierkv's engine, and the `tierkv` CLI.

pub mod cli;
