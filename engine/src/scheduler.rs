//! Requests, intake with admission control, and what a step hands back.

use crate::cache::NodeId;
use crate::layout::PageId;

/// What a client submits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    pub prompt: Vec<u32>,
    pub max_new_tokens: u32,
}

/// Why intake refused a request. Over a limit the request is rejected, never queued unboundedly.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("queue full: {queued} requests queued, scheduler.queued_requests_max = {limit}")]
    QueueFull { queued: u32, limit: u32 },
    #[error("too many pending tokens: {pending} queued + {prompt} new > scheduler.pending_tokens_max = {limit}")]
    PendingTokens {
        pending: u64,
        prompt: u64,
        limit: u64,
    },
    #[error("invalid request: {reason}")]
    Invalid { reason: String },
}

/// What the engine reports as it works (drained with `Engine::drain_outputs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// The per-layer digests of one query position (the stand-in for attention output).
    Digests {
        request: u64,
        position: u32,
        digests: Vec<u64>,
    },
    /// A generated token.
    Token {
        request: u64,
        index: u32,
        token: u32,
    },
    Finished {
        request: u64,
        generated: Vec<u32>,
    },
    Aborted {
        request: u64,
    },
    /// A load failed: the request recomputes its prefix (no output was emitted from the failed data).
    Recompute {
        request: u64,
        tokens: u32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestState {
    Queued,
    Running,
}

/// One request inside the engine.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: u64,
    pub prompt_len: usize,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    pub max_new: u32,
    pub generated: u32,
    /// Positions whose KV and index-K are stored (or being loaded).
    pub computed: usize,
    /// The page table: `pages[i]` holds positions `64i .. 64i + 64`.
    pub pages: Vec<PageId>,
    /// Tree nodes this request locked (matched, or loaded for it).
    pub locked: Vec<NodeId>,
    /// `pages[owned_from..]` belong to the request (inserted or freed when it ends).
    pub owned_from: usize,
    /// The load this request's forward must wait for, until it is acknowledged.
    pub load: Option<u64>,
    pub state: RequestState,
    pub submitted_ns: u64,
    pub first_token_ns: Option<u64>,
}

impl Request {
    pub fn in_prefill(&self) -> bool {
        self.computed < self.prompt_len
    }
    pub fn finished(&self) -> bool {
        self.generated >= self.max_new
    }
}
