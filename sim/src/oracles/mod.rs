//! The oracles, each in its own module. The content, layout and race checks run inside the
//! simulated GPU on every op (`gpu.rs` calls `content` and `layout`; the race detector is
//! `race.rs`); the digest and top-k oracle sees every output; liveness and conservation are asked
//! by the runner during and at the end of a run, bounds and the reported counts after every
//! step; determinism by the campaign (a sample of its seeds, and every failing one) and the
//! tests.

pub mod bounds;
pub mod conservation;
pub mod content;
pub mod determinism;
pub mod digest;
pub mod layout;
pub mod liveness;
pub mod metrics;
pub mod reported;
