//! The types the engine's owners exchange: the scheduler's rows that the model step runs, and the
//! loads, grants and acknowledgements between admission (the scheduler) and the cache
//! controller. They live apart from every owner, so the owners sit side by side: the model step
//! imports nothing of the scheduler, and the scheduler nothing of the controller.

use crate::cache::NodeId;
use crate::layout::PageId;
use std::fmt;

/// A load's id: sequential, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LoadId(pub u64);

impl fmt::Display for LoadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "load{}", self.0)
    }
}

/// What acknowledging a load means for its request, for the engine to apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadAck {
    pub load: LoadId,
    pub request: u64,
    /// The copy finished and the nodes are published; otherwise nothing was, the nodes' locks
    /// are released, and the request must recompute their tokens.
    pub ok: bool,
    /// Nodes the load covered (the tail of the request's matched prefix).
    pub nodes: usize,
    /// Its request was aborted meanwhile: the controller already released what it held.
    pub orphaned: bool,
}

/// What admission holds for a request: its cached prefix (locked, the host-only part being
/// loaded) and its own device pages.
#[derive(Clone, Debug)]
pub struct Grant {
    /// The page table: the resident prefix's pages, then the request's own.
    pub pages: Vec<PageId>,
    /// The matched nodes, locked for the request.
    pub locked: Vec<NodeId>,
    /// Matched pages (resident or being loaded): the request owns `pages[cached..]`.
    pub cached: usize,
    /// The load of the host-only part of the prefix.
    pub load: Option<LoadId>,
}

/// One request's part of a batch: store positions `from..to`, run the indexer at `queries`
/// (positions within `from..to`). It carries what the forward needs of its request: the tokens
/// at `from..to` and the page table.
#[derive(Clone, Debug)]
pub struct Row {
    pub request: u64,
    pub from: usize,
    pub to: usize,
    pub queries: Vec<u32>,
    /// The tokens of positions `from..to`; a row run ahead holds, at `from`, the pending token
    /// (`TokenAt::pending`'s encoding) that the device reads from the previous step's tokens.
    pub tokens: Vec<u32>,
    pub pages: Vec<PageId>,
    /// Run one step ahead: the token at `from` is the one the previous step's query row of
    /// this index generates, which the host does not know yet.
    pub pending: Option<u32>,
}

impl Row {
    /// The token at position `pos` of the request (within the row).
    pub fn token(&self, pos: usize) -> u32 {
        self.tokens[pos - self.from]
    }
}
