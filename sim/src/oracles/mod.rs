//! The oracles, each in its own module. The race detector (`race.rs`) and the layout checks live
//! with the simulated GPU that runs them on every op; page, pin and lock conservation and liveness
//! are checked by the runner at the end of a run through the engine's own accounting
//! (`Engine::check_quiescent`) and request bookkeeping; determinism by the campaign (a seed run
//! twice must give the same event-log hash).

pub mod content;
pub mod digest;
