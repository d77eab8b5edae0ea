//! Findings: what an oracle saw, and which oracle it was.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OracleKind {
    /// An access not ordered after a conflicting one (race detector).
    Race,
    /// A copy or launch whose byte counts or fingerprints disagree with its buffers.
    Layout,
    /// A KV or index-K row read that the specification does not accept as the synthetic model's.
    Content,
    /// An emitted digest that differs from the specification's digest of the selection read (or
    /// a token that does not follow from its query's digests).
    Digest,
    /// A selection of the wrong size or outside the context, or (for a sampled query) not a
    /// top-k of the specification's logits within their bound.
    TopK,
    /// Bytes an op changed outside the writes it declared, or read outside its declared reads.
    Undeclared,
    /// A sampled query's fp8 codes or folded weights that the specification does not accept for
    /// its token (a bug of `q_prep`, reference or kernel).
    Reference,
    /// Pages, pins or locks not returned at the end of a run, or a page of the prefix cache that
    /// does not hold what the cache files it under.
    Conservation,
    /// A counter or gauge the engine exports that disagrees with what the device and the clients
    /// saw.
    Metrics,
    /// Requests that never finish.
    Liveness,
    /// A cache decision the policies' reference model does not allow: which page device or host
    /// eviction took, a backup a write policy should have started (or should not have).
    Policy,
    /// A promise the engine's configuration makes broken: the queue, queued tokens, running
    /// batch and loads in flight within their limits, a step's prefill budget, admission in
    /// submission order, what the engine reports about its queue.
    Bound,
    /// The same seed gave a different event log.
    Determinism,
    /// An engine invariant assertion fired (a panic inside the engine).
    Invariant,
    /// The engine returned an error a correct engine never returns.
    Engine,
    /// Work enqueued on a stream whose failure the host had seen, before recovering the device
    /// (the `Device` contract: after a failed event, `recover` before later work; a CUDA context
    /// with an asynchronous error stays failed until it is recreated).
    Recovery,
}

impl OracleKind {
    pub fn name(self) -> &'static str {
        match self {
            OracleKind::Race => "race",
            OracleKind::Layout => "layout",
            OracleKind::Content => "content",
            OracleKind::Digest => "digest",
            OracleKind::TopK => "topk",
            OracleKind::Undeclared => "undeclared",
            OracleKind::Reference => "reference",
            OracleKind::Conservation => "conservation",
            OracleKind::Metrics => "metrics",
            OracleKind::Liveness => "liveness",
            OracleKind::Policy => "policy",
            OracleKind::Bound => "bound",
            OracleKind::Determinism => "determinism",
            OracleKind::Invariant => "invariant",
            OracleKind::Engine => "engine",
            OracleKind::Recovery => "recovery",
        }
    }
}

impl fmt::Display for OracleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Finding {
    pub oracle: OracleKind,
    /// Virtual time of the host when it was found.
    pub time_ns: u64,
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] at {:.3} ms: {}",
            self.oracle,
            self.time_ns as f64 / 1e6,
            self.message
        )
    }
}
