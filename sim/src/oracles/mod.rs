//! The oracles, each in its own module. The content oracle runs inside the simulated GPU on
//! every `index_logits` and `sparse_read` (the ops that read KV or index-K rows for the model;
//! page copies are judged where their rows are read later, and by the conservation audit), beside the layout
//! check at enqueue (`tierkv_engine::device::check_op`), the race detector (`race.rs`) and the
//! undeclared-access check (`undeclared.rs`); the digest oracle sees every digest output;
//! liveness and conservation are asked by the runner during and at the end of a run, bounds,
//! the reported counts and the policy model after every step (the policy model also after the
//! operator's evictions); determinism by the campaign (a hash-sampled share of
//! its seeds, and every failing one), `campaign merge` (a shard run twice) and the tests.

pub mod bounds;
pub mod conservation;
pub mod content;
pub mod determinism;
pub mod digest;
pub mod liveness;
pub mod metrics;
pub mod policy;
pub mod reported;
