//! The tiered prefix cache: a radix tree over 64-token pages with a device tier and a host tier.
//!
//! A node is one full page of tokens under its parent. It may hold a device page (resident), a host
//! page (backed up), both, or — only transiently — neither while a load or backup is in flight.
//! This module owns the tree's state machine and its accounting; it moves no bytes (the cache
//! controller does) and allocates no pages (the engine hands them in).
//!
//! Invariants, checked by [`PrefixCache::check_invariants`]:
//! - device-resident nodes are prefix-closed: a resident node's parent is resident (or the root);
//! - backed-up nodes are prefix-closed too ("a contiguous prefix from the root");
//! - a node with neither a device page, a host page nor an operation in flight does not exist;
//! - `evictable + protected` = device pages held by the tree (incrementally maintained counters
//!   equal a recount); a node is protected while locked or while a backup reads it;
//! - the device and host eviction orders list exactly their candidates, each at its access time,
//!   and `host_evictable`, counted from the blockers, equals the walk of its definition;
//! - lock counts and pins never go below zero (a violation panics where it happens).

use crate::config::WritePolicy;
use crate::layout::{PageId, PAGE_TOKENS};
use crate::mutants::Mutants;
use crate::probe::{self, Probe};
use std::collections::{BTreeMap, BTreeSet};

/// Counts one more (`up`) or one fewer in a counter of the accounting; leaving its range is a
/// broken invariant (checked in every build, unlike `+= 1`).
macro_rules! step {
    ($counter:expr, $up:expr, $what:literal) => {{
        let c = &mut $counter;
        *c = if $up {
            c.checked_add(1)
        } else {
            c.checked_sub(1)
        }
        .expect(concat!($what, ": count out of range"));
    }};
}

/// The tokens of one page.
pub type PageKey = [u32; PAGE_TOKENS as usize];
pub type NodeId = u32;
pub const ROOT: NodeId = 0;

/// The page keys of `tokens`' first `pages` full pages.
pub fn page_keys(tokens: &[u32], pages: usize) -> Vec<PageKey> {
    tokens
        .chunks_exact(PAGE_TOKENS as usize)
        .take(pages)
        .map(|c| c.try_into().expect("a full page"))
        .collect()
}

/// Where a prefix's model fingerprint sits in its first page's first key word: above every
/// token id.
pub const MODEL_TAG_SHIFT: u32 = 16;
const _: () = assert!(crate::synth::VOCAB <= 1 << MODEL_TAG_SHIFT);

/// The highest weights' version a prefix key carries (`Engine::update_weights`).
pub const WEIGHTS_VERSION_MAX: u32 = (1 << (32 - MODEL_TAG_SHIFT)) - 1;

/// The page keys of `tokens`' first `pages` full pages under the weights of version `model`
/// (`Engine::update_weights`): the first key's first word carries the version above the token
/// id, so a prefix computed under other weights never matches (the stale KV of vLLM's
/// offloading spec, whose block hashes ignore the weights). Version 0 leaves the keys as
/// `page_keys` makes them.
pub fn model_page_keys(tokens: &[u32], pages: usize, model: u32) -> Vec<PageKey> {
    let mut keys = page_keys(tokens, pages);
    if let Some(first) = keys.first_mut() {
        // Tokens are in the vocabulary (`Scheduler` refuses others); versions are checked by
        // `Engine::update_weights`.
        assert!(
            first[0] < 1 << MODEL_TAG_SHIFT && model <= WEIGHTS_VERSION_MAX,
            "token {} or weights version {model} out of the key's range",
            first[0]
        );
        first[0] |= model << MODEL_TAG_SHIFT;
    }
    keys
}

#[derive(Clone, Debug)]
pub struct Node {
    pub parent: NodeId,
    pub key: PageKey,
    /// Children, in the order of their keys (a sorted list of ids: most nodes have one child or
    /// none, and a map per node would cost a 2.9 KB leaf of 256-byte keys each). Look one up
    /// with [`PrefixCache::child`].
    pub children: Vec<NodeId>,
    /// The published device page.
    pub device: Option<PageId>,
    /// The device page a load is filling (published when the load is acknowledged).
    pub loading: Option<PageId>,
    /// The valid host copy.
    pub host: Option<PageId>,
    /// The host page a backup is filling.
    pub backing_up: Option<PageId>,
    /// Running requests using this node's device page.
    pub lock: u32,
    /// Loads reading this node's host page.
    pub host_pins: u32,
    pub last_access: u64,
    /// When the host copy was last used (written by a backup, read by a finished load). The host
    /// tier's LRU orders by this: a match alone does not make a host copy recent, so a node whose
    /// load is still in flight is among the first the host tier would evict — the pin is what
    /// stops it (and what mutant 5 ignores).
    pub host_access: u64,
    pub hits: u32,
    /// Children holding or loading a device page (kept by `update`).
    pub resident_children: u32,
    /// The `last_access` under which the node is listed in the device tier's eviction order,
    /// while it is an eviction candidate (kept by `PrefixCache::relist`).
    listed: Option<u64>,
    /// Children holding or filling a host copy (kept by `update`).
    backed_children: u32,
    /// The `host_access` under which the node is listed in the host tier's eviction order
    /// (kept by `PrefixCache::relist`).
    host_listed: Option<u64>,
}

impl Node {
    /// A node holding nothing yet, under `parent`.
    fn new(parent: NodeId, key: PageKey, tick: u64) -> Node {
        Node {
            parent,
            key,
            children: Vec::new(),
            device: None,
            loading: None,
            host: None,
            backing_up: None,
            lock: 0,
            host_pins: 0,
            last_access: tick,
            host_access: 0,
            hits: 0,
            resident_children: 0,
            listed: None,
            backed_children: 0,
            host_listed: None,
        }
    }

    /// Holds a device page, or a load is filling one.
    pub fn is_resident(&self) -> bool {
        self.device.is_some() || self.loading.is_some()
    }

    /// Holds a host copy, or a backup is filling one.
    fn is_backed(&self) -> bool {
        self.host.is_some() || self.backing_up.is_some()
    }
}

/// How a node counts in the device-tier accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    None,
    Evictable,
    Protected,
}

/// The result of matching a request's pages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Match {
    /// Matched nodes, root side first: `device` resident ones, then `host` ones to load.
    pub nodes: Vec<NodeId>,
    pub device: usize,
    pub host: usize,
}

/// What an insertion did with the request's own pages.
#[derive(Clone, Debug, Default)]
pub struct Inserted {
    /// The path of the inserted pages, root side first.
    pub nodes: Vec<NodeId>,
    /// The request's pages the tree did not take (it had them already, or a load is filling an
    /// ancestor): the caller frees these.
    pub duplicates: Vec<PageId>,
}

/// What device eviction decided.
#[derive(Clone, Debug, Default)]
pub struct DeviceEviction {
    /// Device pages the caller frees now.
    pub freed: Vec<PageId>,
    /// Nodes that must be written back first (write-back policy): the caller backs them up, and
    /// their device pages are freed when the backup is acknowledged.
    pub write_back: Vec<NodeId>,
}

#[derive(Clone, Debug)]
pub struct PrefixCache {
    nodes: Vec<Option<Node>>,
    /// Bumped each time a slot gets a new node, so a remembered id can be told from its reuse.
    generations: Vec<u64>,
    free_ids: Vec<NodeId>,
    tick: u64,
    evictable: u64,
    protected: u64,
    /// Device pages of nodes marked for write-back eviction (freed on the backup's ack).
    evict_after_backup: BTreeMap<NodeId, ()>,
    /// The device tier's eviction candidates in LRU order, `(last_access, id)`: unlocked resident
    /// nodes without resident children, no backup reading them, not marked for write-back.
    /// Maintained by every change that can move a node in or out ([`PrefixCache::relist`]), so
    /// that eviction costs O(log n) per page instead of a scan of the tree.
    device_leaves: BTreeSet<(u64, NodeId)>,
    /// The host tier's eviction candidates in LRU order, `(host_access, id)`: nodes with a host
    /// copy no load pins and no backed-up children. Maintained like `device_leaves`.
    host_leaves: BTreeSet<(u64, NodeId)>,
    /// Nodes whose host copy a load pins (as host eviction sees pins), for its probe.
    host_pinned: u64,
    /// Nodes holding a host copy.
    host_nodes: u64,
    /// What keeps host copies from eviction, with every copy above it: nodes whose host copy a
    /// load pins, and nodes a backup is filling.
    host_blockers: BTreeSet<NodeId>,
    /// The zoo's switches (empty in production builds): mutant 5 acts in host eviction.
    mutants: Mutants,
}

impl Default for PrefixCache {
    fn default() -> Self {
        Self::new()
    }
}

fn empty_key() -> PageKey {
    [u32::MAX; PAGE_TOKENS as usize]
}

impl PrefixCache {
    pub fn new() -> Self {
        let root = Node::new(ROOT, empty_key(), 0);
        PrefixCache {
            nodes: vec![Some(root)],
            generations: vec![0],
            free_ids: Vec::new(),
            tick: 0,
            evictable: 0,
            protected: 0,
            evict_after_backup: BTreeMap::new(),
            device_leaves: BTreeSet::new(),
            host_leaves: BTreeSet::new(),
            host_pinned: 0,
            host_nodes: 0,
            host_blockers: BTreeSet::new(),
            mutants: Mutants::none(),
        }
    }

    /// A cache whose host eviction follows `mutants`' point (the bug zoo).
    pub fn with_mutants(mutants: Mutants) -> Self {
        PrefixCache {
            mutants,
            ..PrefixCache::new()
        }
    }

    /// Whether the host tier may evict `n`'s host copy as far as load pins go.
    fn host_copy_unpinned(&self, n: &Node) -> bool {
        n.host_pins == 0 || self.mutants.host_eviction_ignores_pins()
    }

    pub fn is_live(&self, id: NodeId) -> bool {
        id != ROOT && self.nodes.get(id as usize).is_some_and(|n| n.is_some())
    }
    pub fn node(&self, id: NodeId) -> &Node {
        self.nodes[id as usize].as_ref().expect("live node")
    }
    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id as usize].as_mut().expect("live node")
    }
    pub fn live_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(i, n)| *i != ROOT as usize && n.is_some())
            .map(|(i, _)| i as NodeId)
    }

    /// Where `key`'s child of `id` is in its children (`Ok`), or where it would go (`Err`).
    fn child_slot(&self, id: NodeId, key: &PageKey) -> Result<usize, usize> {
        self.node(id)
            .children
            .binary_search_by(|&c| self.node(c).key.cmp(key))
    }
    /// The child of `id` holding `key`.
    pub fn child(&self, id: NodeId, key: &PageKey) -> Option<NodeId> {
        let n = self.node(id);
        self.child_slot(id, key).ok().map(|i| n.children[i])
    }

    fn class(&self, id: NodeId) -> Class {
        if id == ROOT {
            return Class::None;
        }
        let n = self.node(id);
        match n.device {
            None => Class::None,
            Some(_) if n.lock > 0 || n.backing_up.is_some() => Class::Protected,
            Some(_) => Class::Evictable,
        }
    }
    /// Applies a mutation to a node, keeping the accounting counters exact.
    fn update(&mut self, id: NodeId, f: impl FnOnce(&mut Node)) {
        let before = self.class(id);
        let was_resident = self.node(id).is_resident();
        let was_backed = self.node(id).is_backed();
        let was_pinned = self.host_pinned_copy(self.node(id));
        let had_host = self.node(id).host.is_some();
        let was_blocking = was_pinned || self.node(id).backing_up.is_some();
        f(self.node_mut(id));
        let is_pinned = self.host_pinned_copy(self.node(id));
        let has_host = self.node(id).host.is_some();
        if had_host != has_host {
            step!(self.host_nodes, has_host, "nodes with a host copy");
        }
        if was_pinned != is_pinned {
            step!(self.host_pinned, is_pinned, "pinned host copies");
        }
        let blocks = is_pinned || self.node(id).backing_up.is_some();
        if blocks != was_blocking {
            if blocks {
                self.host_blockers.insert(id);
            } else {
                self.host_blockers.remove(&id);
            }
        }
        let is_backed = self.node(id).is_backed();
        if was_backed != is_backed && id != ROOT {
            let parent = self.node(id).parent;
            step!(
                self.node_mut(parent).backed_children,
                is_backed,
                "backed children"
            );
            self.relist(parent);
        }
        let after = self.class(id);
        self.count(before, -1);
        self.count(after, 1);
        let is_resident = self.node(id).is_resident();
        if was_resident != is_resident && id != ROOT {
            let parent = self.node(id).parent;
            step!(
                self.node_mut(parent).resident_children,
                is_resident,
                "resident children"
            );
            self.relist(parent);
        }
        self.relist(id);
    }

    /// Whether `id` is a device eviction candidate: an evictable resident node (unlocked, no
    /// backup reading it) without resident children, not already marked for write-back.
    fn is_device_candidate(&self, id: NodeId) -> bool {
        id != ROOT
            && self.class(id) == Class::Evictable
            && !self.evict_after_backup.contains_key(&id)
            && !self.has_resident_child(id)
    }

    /// A host copy that a load pins, as host eviction sees pins (the zoo's mutant 5 ignores them).
    fn host_pinned_copy(&self, n: &Node) -> bool {
        n.host.is_some() && !self.host_copy_unpinned(n)
    }

    /// Whether `id` is a host eviction candidate (besides the caller's `keep`): a host copy no
    /// load pins, without backed-up children.
    fn is_host_candidate(&self, id: NodeId) -> bool {
        let n = self.node(id);
        id != ROOT && n.host.is_some() && self.host_copy_unpinned(n) && n.backed_children == 0
    }

    /// Brings `id`'s entries in the device and host eviction orders up to date with its state
    /// and its `last_access` / `host_access`. Every change to what
    /// [`PrefixCache::is_device_candidate`] or [`PrefixCache::is_host_candidate`] reads, or to
    /// those times, calls it.
    fn relist(&mut self, id: NodeId) {
        if id == ROOT {
            return;
        }
        let want = self
            .is_host_candidate(id)
            .then(|| self.node(id).host_access);
        let n = self.node_mut(id);
        let had = n.host_listed;
        if had != want {
            n.host_listed = want;
            if let Some(at) = had {
                let removed = self.host_leaves.remove(&(at, id));
                assert!(
                    removed,
                    "node {id} was listed for host eviction at {at} but not found"
                );
            }
            if let Some(at) = want {
                let added = self.host_leaves.insert((at, id));
                assert!(added, "node {id} listed for host eviction twice");
            }
        }
        let want = self
            .is_device_candidate(id)
            .then(|| self.node(id).last_access);
        let n = self.node_mut(id);
        let had = n.listed;
        if had == want {
            return;
        }
        n.listed = want;
        if let Some(at) = had {
            let removed = self.device_leaves.remove(&(at, id));
            assert!(
                removed,
                "node {id} was listed for eviction at {at} but not found"
            );
        }
        if let Some(at) = want {
            let added = self.device_leaves.insert((at, id));
            assert!(added, "node {id} listed for eviction twice");
        }
    }
    fn count(&mut self, c: Class, d: i64) {
        let slot = match c {
            Class::None => return,
            Class::Evictable => &mut self.evictable,
            Class::Protected => &mut self.protected,
        };
        *slot = slot
            .checked_add_signed(d)
            .expect("device accounting went negative");
    }

    /// Matches `keys` from the root: the resident prefix, then the backed-up suffix that can be
    /// loaded. Stops at a node with a load in flight (nothing is published before its copy ends).
    /// Read-only: a match that is not acted on (a request that cannot be admitted yet) must not
    /// count as a hit or refresh the LRU order; [`PrefixCache::touch`] does that.
    pub fn match_prefix(&self, keys: &[PageKey]) -> Match {
        let mut m = Match::default();
        let mut cur = ROOT;
        for key in keys {
            let Some(child) = self.child(cur, key) else {
                break;
            };
            let n = self.node(child);
            if n.loading.is_some() {
                break;
            }
            if n.device.is_some() {
                if m.host > 0 {
                    break; // resident below a host-only node: not prefix-closed, cannot happen
                }
                m.device += 1;
            } else if n.host.is_some() {
                m.host += 1;
            } else {
                break; // a backup of a non-resident node cannot be in flight; defensive stop
            }
            m.nodes.push(child);
            cur = child;
        }
        m
    }

    /// Records a use of matched nodes: one hit each, and most recently used.
    pub fn touch(&mut self, nodes: &[NodeId]) {
        self.tick += 1;
        let tick = self.tick;
        for &id in nodes {
            let n = self.node_mut(id);
            n.last_access = tick;
            n.hits += 1;
            self.relist(id);
        }
    }

    pub fn lock(&mut self, nodes: &[NodeId]) {
        for &id in nodes {
            self.update(id, |n| n.lock += 1);
        }
    }
    /// Releases a use of `nodes`: they were in use until now, so most recently used.
    pub fn unlock(&mut self, nodes: &[NodeId]) {
        self.tick += 1;
        self.release(nodes, Some(self.tick));
    }

    /// Releases locks taken for a match that was not acted on (a reservation that found no
    /// room): like the match itself, it leaves the eviction order as it was.
    pub fn unlock_unused(&mut self, nodes: &[NodeId]) {
        self.release(nodes, None);
    }

    /// Drops one lock of each of `nodes`, and marks them used at `used_at` if given.
    fn release(&mut self, nodes: &[NodeId], used_at: Option<u64>) {
        for &id in nodes {
            self.update(id, |n| {
                n.lock = n
                    .lock
                    .checked_sub(1)
                    .expect("node unlocked more than locked");
                if let Some(tick) = used_at {
                    n.last_access = tick;
                }
            });
        }
    }

    /// Pins host-only nodes a request matched, from the match until its load is acknowledged:
    /// the host tier never evicts a pinned host copy.
    pub fn pin_host(&mut self, nodes: &[NodeId]) {
        for &id in nodes {
            self.update(id, |n| {
                assert!(n.host.is_some(), "pinning a node without a host copy");
                n.host_pins += 1;
            });
        }
    }

    /// Starts loading pinned host-only nodes into `pages` (the pin is dropped by `finish_load`).
    pub fn begin_load(&mut self, nodes: &[NodeId], pages: &[PageId]) {
        assert_eq!(nodes.len(), pages.len());
        for (&id, &p) in nodes.iter().zip(pages) {
            self.update(id, |n| {
                assert!(
                    n.device.is_none() && n.loading.is_none(),
                    "node loaded twice"
                );
                assert!(
                    n.host_pins > 0,
                    "loading a node whose host copy is not pinned"
                );
                n.loading = Some(p);
            });
        }
    }

    /// Ends a load. On success the device pages are published; on failure they are returned to
    /// the caller to free (the node stays host-only).
    pub fn finish_load(&mut self, nodes: &[NodeId], ok: bool) -> Vec<PageId> {
        self.end_load(nodes, ok, true)
    }

    /// Ends a load whose host pins were dropped before (`unpin`) while it ran (mutant 40: its
    /// lease expired); otherwise as `finish_load`.
    pub fn finish_load_unpinned(&mut self, nodes: &[NodeId], ok: bool) -> Vec<PageId> {
        self.end_load(nodes, ok, false)
    }

    fn end_load(&mut self, nodes: &[NodeId], ok: bool, pinned: bool) -> Vec<PageId> {
        self.tick += 1;
        let tick = self.tick;
        let mut unpublished = Vec::new();
        for &id in nodes {
            let mut back = None;
            self.update(id, |n| {
                let p = n
                    .loading
                    .take()
                    .expect("finishing a load that was not started");
                if pinned {
                    n.host_pins = n.host_pins.checked_sub(1).expect("host pin underflow");
                }
                n.host_access = tick;
                if ok {
                    n.device = Some(p);
                } else {
                    back = Some(p);
                }
            });
            unpublished.extend(back);
        }
        unpublished
    }

    /// Publishes a load's pages at once (mutant 6: before the copy finished). The later
    /// `finish_load` then finds nothing loading; this returns the node's pin for it to drop.
    pub fn publish_early(&mut self, nodes: &[NodeId]) {
        for &id in nodes {
            self.update(id, |n| {
                n.device = n.loading.take();
            });
        }
    }

    /// Ends a load whose pages were published early (mutant 6): only unpins.
    pub fn unpin(&mut self, nodes: &[NodeId]) {
        for &id in nodes {
            self.update(id, |n| {
                n.host_pins = n.host_pins.checked_sub(1).expect("host pin underflow");
            });
        }
    }

    /// Nodes on the path ending at `last` (root side first) that need a backup: resident, not
    /// backed up, no backup in flight. Empty when nothing needs one — and also when an ancestor's
    /// backup is still in flight: a backup never depends on another one, because if that one
    /// failed, this one would leave a backed-up node under a parent that is not.
    pub fn needs_backup(&self, last: NodeId) -> Vec<NodeId> {
        let mut path = Vec::new();
        let mut cur = last;
        while cur != ROOT {
            let n = self.node(cur);
            if n.backing_up.is_some() {
                return Vec::new();
            }
            if n.host.is_some() {
                break; // everything above is backed up (prefix-closed)
            }
            if n.device.is_some() {
                path.push(cur);
            } else {
                path.clear(); // cannot back up a node without a device copy; nor its subtree
            }
            cur = n.parent;
        }
        path.reverse();
        path
    }

    /// Whether a backup of the path ending at `last` waits for another backup to finish.
    pub fn backup_deferred(&self, last: NodeId) -> bool {
        let mut cur = last;
        while cur != ROOT {
            let n = self.node(cur);
            if n.backing_up.is_some() {
                return true;
            }
            if n.host.is_some() {
                return false;
            }
            cur = n.parent;
        }
        false
    }

    pub fn begin_backup(&mut self, nodes: &[NodeId], host_pages: &[PageId]) {
        assert_eq!(nodes.len(), host_pages.len());
        for (&id, &p) in nodes.iter().zip(host_pages) {
            self.update(id, |n| {
                assert!(
                    n.device.is_some(),
                    "backing up a node without a device page"
                );
                assert!(
                    n.host.is_none() && n.backing_up.is_none(),
                    "node backed up twice"
                );
                n.backing_up = Some(p);
            });
        }
    }

    /// Ends a backup. Returns host pages to free (failure) and device pages to free (nodes that
    /// were being written back for eviction).
    pub fn finish_backup(&mut self, nodes: &[NodeId], ok: bool) -> (Vec<PageId>, Vec<PageId>) {
        self.tick += 1;
        let tick = self.tick;
        let mut host_free = Vec::new();
        let mut device_free = Vec::new();
        for &id in nodes {
            // The eviction stands only if nothing came to depend on the device page meanwhile.
            let evict =
                self.evict_after_backup.remove(&id).is_some() && !self.has_resident_child(id);
            let mut hf = None;
            let mut df = None;
            self.update(id, |n| {
                let p = n
                    .backing_up
                    .take()
                    .expect("finishing a backup that was not started");
                if ok {
                    n.host = Some(p);
                    n.host_access = tick;
                    if evict && n.lock == 0 {
                        df = n.device.take();
                    }
                } else {
                    hf = Some(p);
                }
            });
            host_free.extend(hf);
            device_free.extend(df);
        }
        (host_free, device_free)
    }

    /// How many host pages `evict_host(_, keep)` could free at most: backed-up nodes whose host
    /// copy no load pins, not `keep` or its ancestors, and whose backed-up descendants are all
    /// evictable too (host eviction goes leaf first).
    pub fn host_evictable(&self, keep: NodeId) -> usize {
        // A host copy cannot go while a load pins it, a backup fills one of its descendants, a
        // pinned copy sits below it, or it is `keep` or above: every host copy on the way from
        // such a blocker (or `keep`) to the root stays. The rest can all go, leaf first. The
        // paths are walked once each, stopping where another walk passed.
        let mut seen = BTreeSet::new();
        let mut blocked = 0usize;
        let starts = self
            .host_blockers
            .iter()
            .copied()
            .chain((keep != ROOT).then_some(keep));
        for start in starts {
            let mut cur = start;
            while cur != ROOT && seen.insert(cur) {
                let n = self.node(cur);
                blocked += n.host.is_some() as usize;
                cur = n.parent;
            }
        }
        self.host_nodes as usize - blocked
    }

    /// [`PrefixCache::host_evictable`] by a post-order walk of the whole tree, from its
    /// definition (`check_invariants` compares the two).
    fn host_evictable_by_scan(&self, keep: NodeId) -> usize {
        let mut protected = BTreeSet::new();
        let mut cur = keep;
        while cur != ROOT {
            protected.insert(cur);
            cur = self.node(cur).parent;
        }
        // Post-order without recursion: children before parents.
        let mut order = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            order.push(id);
            stack.extend(self.node(id).children.iter().copied());
        }
        let mut removable: BTreeMap<NodeId, bool> = BTreeMap::new();
        let mut count = 0;
        for &id in order.iter().rev() {
            if id == ROOT {
                continue;
            }
            let n = self.node(id);
            let children_ok = n.children.iter().all(|c| {
                let cn = self.node(*c);
                (cn.host.is_none() && cn.backing_up.is_none())
                    || removable.get(c).copied().unwrap_or(false)
            });
            let ok = n.host.is_some()
                && n.backing_up.is_none()
                && self.host_copy_unpinned(n)
                && !protected.contains(&id)
                && children_ok;
            removable.insert(id, ok);
            count += ok as usize;
        }
        count
    }

    /// Withdraws a write-back eviction whose backup could not be issued.
    pub fn cancel_write_back(&mut self, id: NodeId) {
        self.evict_after_backup.remove(&id);
        self.relist(id);
    }

    fn has_resident_child(&self, id: NodeId) -> bool {
        self.node(id).resident_children > 0
    }

    /// Frees up to `want` device pages by LRU over unlocked resident nodes without resident
    /// children: a backed-up node drops its device page; otherwise, under write-back, the node is
    /// queued for a backup first; under the write-through policies it is deleted.
    pub fn evict_device(&mut self, want: usize, policy: WritePolicy) -> DeviceEviction {
        let mut out = DeviceEviction::default();
        if want == 0 {
            return out;
        }
        let policy = self.mutants.eviction_policy(policy);
        // Candidates come oldest first from the maintained order; a node leaves it when it is
        // evicted or marked for write-back, and a parent joins it when its last resident child
        // goes. `skipped` holds a candidate this call passed over (kept for exactness: the prefix
        // closure of backed-up nodes means it cannot happen), so it is not taken twice.
        let mut skipped: BTreeSet<(u64, NodeId)> = BTreeSet::new();
        let mut pending = 0usize;
        while out.freed.len() + pending < want {
            let next = if self.mutants.device_eviction_newest_first() {
                self.device_leaves
                    .iter()
                    .rev()
                    .find(|e| !skipped.contains(e))
                    .copied()
            } else if skipped.is_empty() {
                self.device_leaves.first().copied()
            } else {
                self.device_leaves
                    .iter()
                    .find(|e| !skipped.contains(e))
                    .copied()
            };
            let Some((at, id)) = next else {
                break;
            };
            debug_assert!(self.is_device_candidate(id));
            let n = self.node(id);
            if n.host.is_some() {
                let mut p = None;
                self.update(id, |n| p = n.device.take());
                out.freed.extend(p);
            } else if policy == WritePolicy::WriteBack {
                self.evict_after_backup.insert(id, ());
                self.relist(id);
                out.write_back.push(id);
                pending += 1;
            } else if n.children.is_empty() {
                let mut p = None;
                self.update(id, |n| p = n.device.take());
                out.freed.extend(p);
                self.delete(id);
            } else {
                skipped.insert((at, id));
            }
        }
        out
    }

    /// The device lost what it held (its context was recreated): every node drops its device
    /// page, and a node left without a host copy or children goes (children first, so a path
    /// backed up on the host stays whole). Returns the device pages to free. Nothing may be
    /// locked, loading, backing up or marked for write-back: the caller released all of it.
    pub fn forget_device(&mut self) -> Vec<PageId> {
        assert!(
            self.evict_after_backup.is_empty(),
            "device memory forgotten with write-back evictions pending"
        );
        let depth = |c: &Self, mut id: NodeId| {
            let mut d = 0usize;
            while id != ROOT {
                id = c.node(id).parent;
                d += 1;
            }
            d
        };
        let mut order: Vec<(usize, NodeId)> =
            self.live_nodes().map(|id| (depth(self, id), id)).collect();
        order.sort_unstable_by(|a, b| b.cmp(a));
        let mut freed = Vec::new();
        for (_, id) in order {
            let n = self.node(id);
            assert!(
                n.lock == 0 && n.loading.is_none() && n.backing_up.is_none(),
                "node {id} in use when the device's memory was lost"
            );
            let mut p = None;
            self.update(id, |n| p = n.device.take());
            freed.extend(p);
            let n = self.node(id);
            if n.host.is_none() && n.children.is_empty() {
                self.delete(id);
            }
        }
        freed
    }

    /// Frees up to `want` host pages by LRU over backed-up nodes without backed-up children whose
    /// host page no load is reading: a resident node drops its host copy, a host-only one goes.
    /// `keep` (and, through it, its ancestors) is spared: it is the parent of a path about to be
    /// backed up, whose host copy must stay for the backed-up set to remain prefix-closed.
    pub fn evict_host(&mut self, want: usize, keep: NodeId) -> Vec<PageId> {
        let mut freed = Vec::new();
        // In rounds: the candidates at a round's start, oldest first (a parent whose last
        // backed-up child goes joins in the next round).
        while freed.len() < want {
            // The pinned host copies this round passes over (`keep`'s aside).
            let keep_pinned = keep != ROOT && self.host_pinned_copy(self.node(keep));
            for _ in 0..self.host_pinned - keep_pinned as u64 {
                probe::hit(Probe::HostEvictSkippedPinned);
            }
            let order: Vec<NodeId> = if self.mutants.host_eviction_newest_first() {
                self.host_leaves.iter().rev().map(|&(_, id)| id).collect()
            } else {
                self.host_leaves.iter().map(|&(_, id)| id).collect()
            };
            let round: Vec<NodeId> = order
                .into_iter()
                .filter(|&id| id != keep)
                .take(want - freed.len())
                .collect();
            if round.is_empty() {
                break;
            }
            for id in round {
                let mut p = None;
                self.update(id, |n| p = n.host.take());
                freed.extend(p);
                let n = self.node(id);
                if n.device.is_none() && n.loading.is_none() && n.children.is_empty() {
                    self.delete(id);
                }
            }
        }
        freed
    }

    /// Inserts a request's full pages (`keys[i]` held in `pages[i]`) under the root. Existing
    /// resident nodes keep their page (the request's is a duplicate); an existing host-only node
    /// adopts the request's page; missing nodes are created.
    pub fn insert(&mut self, keys: &[PageKey], pages: &[PageId]) -> Inserted {
        assert_eq!(keys.len(), pages.len());
        self.tick += 1;
        let tick = self.tick;
        let mut out = Inserted::default();
        let mut cur = ROOT;
        for (i, (key, &page)) in keys.iter().zip(pages).enumerate() {
            let child = match self.child(cur, key) {
                Some(c) => {
                    let n = self.node(c);
                    if n.device == Some(page) {
                        // The request's own prefix node (it matched it).
                    } else if n.loading.is_some() {
                        // Another request's load is filling this node: nothing may hang under a
                        // node that is not resident yet (the load may fail). Keep none of the rest.
                        out.duplicates.extend_from_slice(&pages[i..]);
                        break;
                    } else if n.device.is_some() {
                        out.duplicates.push(page);
                    } else {
                        self.update(c, |n| n.device = Some(page));
                    }
                    c
                }
                None => {
                    let id = self.alloc_node(Node::new(cur, *key, tick));
                    let at = self
                        .child_slot(cur, key)
                        .expect_err("the child was not found above");
                    self.node_mut(cur).children.insert(at, id);
                    self.update(id, |n| n.device = Some(page));
                    id
                }
            };
            self.node_mut(child).last_access = tick;
            self.relist(child);
            out.nodes.push(child);
            cur = child;
        }
        out
    }

    fn alloc_node(&mut self, n: Node) -> NodeId {
        match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id as usize] = Some(n);
                self.generations[id as usize] += 1;
                id
            }
            None => {
                self.nodes.push(Some(n));
                self.generations.push(0);
                self.nodes.len() as NodeId - 1
            }
        }
    }

    /// The generation of `id`'s slot: equal generations mean the same node.
    pub fn generation(&self, id: NodeId) -> u64 {
        self.generations[id as usize]
    }

    fn delete(&mut self, id: NodeId) {
        let n = self.node(id);
        assert!(n.children.is_empty(), "deleting a node with children");
        assert!(
            n.device.is_none() && n.loading.is_none(),
            "deleting a node holding device pages"
        );
        assert!(
            n.host.is_none() && n.backing_up.is_none(),
            "deleting a node holding host pages"
        );
        assert_eq!(n.lock, 0, "deleting a locked node");
        assert!(
            n.listed.is_none() && n.host_listed.is_none(),
            "deleting a node listed for eviction"
        );
        let (parent, key) = (n.parent, n.key);
        let at = self
            .child_slot(parent, &key)
            .expect("a node is listed under its parent");
        self.node_mut(parent).children.remove(at);
        self.nodes[id as usize] = None;
        self.free_ids.push(id);
    }

    /// Device pages the tree holds (published).
    pub fn device_pages(&self) -> Vec<PageId> {
        self.live_nodes()
            .filter_map(|id| self.node(id).device)
            .collect()
    }
    /// Host pages the tree holds (valid copies and backups in flight).
    pub fn host_pages(&self) -> Vec<PageId> {
        self.live_nodes()
            .flat_map(|id| {
                let n = self.node(id);
                n.host.into_iter().chain(n.backing_up)
            })
            .collect()
    }
    pub fn locked_nodes(&self) -> usize {
        self.live_nodes()
            .filter(|&id| self.node(id).lock > 0)
            .count()
    }
    pub fn pinned_nodes(&self) -> usize {
        self.live_nodes()
            .filter(|&id| self.node(id).host_pins > 0)
            .count()
    }

    /// Checks every invariant of the module comment; panics on the first broken one.
    pub fn check_invariants(&self) {
        let (mut ev, mut pr) = (0u64, 0u64);
        for id in self.live_nodes() {
            let n = self.node(id);
            let p = self.node(n.parent);
            assert_eq!(
                self.child(n.parent, &n.key),
                Some(id),
                "node {id} not under its parent"
            );
            if n.parent != ROOT {
                if n.device.is_some() || n.loading.is_some() {
                    assert!(
                        p.device.is_some() || (n.loading.is_some() && p.loading.is_some()),
                        "node {id} is resident but its parent {} is not",
                        n.parent
                    );
                }
                if n.host.is_some() || n.backing_up.is_some() {
                    assert!(
                        p.host.is_some() || p.backing_up.is_some(),
                        "node {id} is backed up but its parent {} is not",
                        n.parent
                    );
                }
            }
            assert!(
                n.device.is_some()
                    || n.loading.is_some()
                    || n.host.is_some()
                    || n.backing_up.is_some(),
                "node {id} holds nothing"
            );

            let rc = n
                .children
                .iter()
                .filter(|&&c| self.node(c).is_resident())
                .count() as u32;
            assert_eq!(
                rc, n.resident_children,
                "node {id}: resident children count"
            );
            let bc = n
                .children
                .iter()
                .filter(|&&c| self.node(c).is_backed())
                .count() as u32;
            assert_eq!(bc, n.backed_children, "node {id}: backed children count");
            match self.class(id) {
                Class::Evictable => ev += 1,
                Class::Protected => pr += 1,
                Class::None => {}
            }
        }
        assert_eq!(ev, self.evictable, "evictable accounting");
        let candidates: BTreeSet<(u64, NodeId)> = self
            .live_nodes()
            .filter(|&id| self.is_device_candidate(id))
            .map(|id| (self.node(id).last_access, id))
            .collect();
        assert_eq!(
            candidates, self.device_leaves,
            "the device eviction order lists exactly the candidates, at their last access"
        );
        let host_candidates: BTreeSet<(u64, NodeId)> = self
            .live_nodes()
            .filter(|&id| self.is_host_candidate(id))
            .map(|id| (self.node(id).host_access, id))
            .collect();
        assert_eq!(
            host_candidates, self.host_leaves,
            "the host eviction order lists exactly the candidates, at their host access"
        );
        let pinned = self
            .live_nodes()
            .filter(|&id| self.host_pinned_copy(self.node(id)))
            .count() as u64;
        assert_eq!(pinned, self.host_pinned, "pinned host copies");
        let host_nodes = self
            .live_nodes()
            .filter(|&id| self.node(id).host.is_some())
            .count() as u64;
        assert_eq!(host_nodes, self.host_nodes, "nodes with a host copy");
        let blockers: BTreeSet<NodeId> = self
            .live_nodes()
            .filter(|&id| {
                let n = self.node(id);
                self.host_pinned_copy(n) || n.backing_up.is_some()
            })
            .collect();
        assert_eq!(blockers, self.host_blockers, "host eviction's blockers");
        // The count of evictable host copies, from the blockers, equals its definition's walk:
        // with nothing kept, and keeping the node with the newest host copy.
        let newest = self
            .live_nodes()
            .filter(|&id| self.node(id).host.is_some())
            .max_by_key(|&id| (self.node(id).host_access, id));
        for keep in std::iter::once(ROOT).chain(newest) {
            assert_eq!(
                self.host_evictable(keep),
                self.host_evictable_by_scan(keep),
                "evictable host copies, keeping {keep}"
            );
        }
        assert_eq!(pr, self.protected, "protected accounting");
        let resident = self.device_pages().len() as u64;
        assert_eq!(
            ev + pr,
            resident,
            "evictable + protected = device pages in the tree"
        );
        let mut seen = BTreeSet::new();
        for p in self.device_pages() {
            assert!(seen.insert(p), "device page {p} held by two nodes");
        }
    }
}

#[cfg(test)]
mod tests;
