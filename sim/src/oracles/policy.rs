//! The policy oracle: a reference model of the prefix cache's decisions, written from the
//! policies' definitions (docs/DESIGN.md §3) apart from `engine/src/cache.rs` and the
//! controller. It judges decisions whose result is still correct data, which no content check
//! can see: which page device and host eviction take, when a write policy backs a prefix up, and
//! what the prefix-hit counters count.
//!
//! What the model observes, after every step and every operator `evict_device` (not after an
//! abort): which nodes of the prefix tree exist and which tier copies each holds (the
//! tree's shape, read through `PrefixCache::live_nodes` and `node`; a node is named by its slot
//! and generation, and the model hashes its tokens itself), the requests a step admitted (in
//! submission order, which `reported::admitted_in_order` holds), how many prompt pages each took
//! from the cache (its first stored position, from the device's store ops), how many of those
//! were loaded (the device pages the load stream was asked to fill), and the requests that
//! finished, with their tokens. What it keeps of its own: each node's last use on the device
//! tier (a tick per admission and per finish, in the order the step runs them: admissions, then
//! finishes; a lock released by an abort is a use at a time it does not see, so such nodes are
//! not judged until their next observed use), its host copy's last use (the call in which a
//! backup ended, or a load of it was issued or ended), its hits, and the nodes each running
//! request locked. None of it is read from the engine's `last_access`, `host_access`, `hits`,
//! `lock` or eviction lists.
//!
//! The checks, each meant as a necessary condition of the policy (a finding is meant to be a
//! decision the policy does not allow, not a difference of timing; the 2,000-seed clean
//! campaign recorded in sim/CAMPAIGNS.md gave none):
//! - **Device eviction order (LRU),** under write-through and selective write-through. A node
//!   that lost its device page in a call was used no later than every node that was a device
//!   eviction candidate (unlocked, no backup reading it, no resident child) both before and
//!   after the call and was not used during it, nor matched by the request admission tried and
//!   could not place. Under write-back an eviction whose backup could not be issued is
//!   withdrawn, leaving an older node behind younger ones that went; the order is not judged
//!   there.
//! - **Host eviction order (LRU).** The same for host copies, with host candidates (no load
//!   reading the copy, no backed-up child, not on the path of a backup the call started) and the
//!   host copy's last use.
//! - **Write-through.** A finished request's inserted path is backed up (or waits for an
//!   ancestor's backup) when the host tier had room for it.
//! - **Selective write-through.** A backup starts only on a path that ends at a node hit for at
//!   least the second time as the last device page of an admitted request's prefix; and every
//!   such hit without a host copy starts one (or waits for an ancestor's) when the host had room.
//! - **Write-back.** A device page without a host copy leaves the device tier only through a
//!   backup, unless the host had no room (or an ancestor's backup was in flight).
//! - **Prefix-hit counters.** `prefix_pages_device_hit` and `prefix_pages_host_hit` grow in a
//!   step by the admitted requests' cached pages that were on the device and that were loaded.
//!
//! Where a check does not apply, and why: a call in which a copy failed, a step failed, a
//! load was recomputed or the device's context was recreated (recovery drops state without a policy decision; what such a call's
//! admissions touched is forgotten); the trigger checks and the host order while the host pool
//! refuses allocations by injection (a refusal leaves room unused, and a backup refused after
//! host eviction made room leaves no trace of what that eviction spared); the trigger checks
//! when the host tier had less room at the end of the call than the path needed (whether host
//! eviction could have made room is not modelled); the write-back check while any backup is in
//! flight (its fallback may then drop unbacked leaves); nodes whose last use the model could
//! not observe (a request that finished in the very step that admitted it, a lock released by an
//! abort or an orphaned load); the prefill/decode pair (each side's tree receives imports the
//! model does not follow).
//!
//! Not modelled yet: the prefill/decode pair, and host eviction's room (so a backup skipped
//! when eviction could have made room is not a finding). Page ownership of KV stores is checked
//! by the runner (`stores_within_ownership`); reads and copies are not followed by it.

use crate::oracles::content::WEIGHTS_SHIFT;
use crate::report::{Finding, OracleKind};
use std::collections::{BTreeMap, HashMap, HashSet};
use tierkv_engine::cache::{NodeId, PrefixCache, ROOT};
use tierkv_engine::config::WritePolicy;

/// Tokens per page, as the specification's byte format states it.
const PAGE_TOKENS: usize = tierkv_kernels::spec::format::PAGE_TOKENS;

/// A node as the simulator names it: its slot and that slot's generation.
type NodeRef = (NodeId, u64);

/// One node of the tree as observed.
#[derive(Clone, Copy, Debug)]
struct Seen {
    parent: Option<NodeRef>,
    device: bool,
    loading: bool,
    host: bool,
    backing_up: bool,
}

/// The tree as observed between two calls.
#[derive(Default)]
pub struct Snapshot {
    nodes: BTreeMap<NodeRef, Seen>,
    by_key: HashMap<u64, NodeRef>,
    /// Children holding or filling a device page.
    resident_children: HashMap<NodeRef, u32>,
    /// Children holding or filling a host copy.
    backed_children: HashMap<NodeRef, u32>,
    /// Host pages free.
    pub host_pages_free: usize,
}

impl Snapshot {
    fn get(&self, n: NodeRef) -> Option<&Seen> {
        self.nodes.get(&n)
    }
    /// `n` and its ancestors, `n` first.
    fn path(&self, n: NodeRef) -> Vec<NodeRef> {
        let mut out = Vec::new();
        let mut cur = Some(n);
        while let Some(c) = cur {
            let Some(s) = self.nodes.get(&c) else { break };
            out.push(c);
            cur = s.parent;
        }
        out
    }
    fn device_candidate(&self, n: NodeRef, locked: &HashSet<NodeRef>) -> bool {
        self.get(n).is_some_and(|s| {
            s.device
                && !s.backing_up
                && self.resident_children.get(&n).copied().unwrap_or(0) == 0
                && !locked.contains(&n)
        })
    }
    fn host_candidate(&self, n: NodeRef) -> bool {
        self.get(n).is_some_and(|s| {
            s.host && !s.loading && self.backed_children.get(&n).copied().unwrap_or(0) == 0
        })
    }
}

/// The hash of a page's tokens chained onto its parent's: equal keys, equal token prefixes
/// (up to hash collisions).
fn chain(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ 0x9e37_79b9_7f4a_7c15;
    for &t in tokens {
        h = (h ^ t as u64).wrapping_mul(0x100_0000_01b3);
        h ^= h >> 29;
    }
    h.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (h >> 31)
}

/// Where the chain of a prefix computed under the weights of version `weights` starts.
fn chain_start(weights: u32) -> u64 {
    if weights == 0 {
        0
    } else {
        chain(0x5745_4947_4854 ^ weights as u64, &[])
    }
}

/// The chained key of a page of the engine's prefix cache directly under its root: the
/// engine's node key carries the weights' version above its first token
/// (`cache::model_page_keys`; [`WEIGHTS_SHIFT`] is the simulator's own constant for it).
fn top_key(key: &[u32]) -> u64 {
    let untag = (1u32 << WEIGHTS_SHIFT) - 1;
    let tokens: Vec<u32> = key.iter().map(|&t| t & untag).collect();
    chain(chain_start(key[0] >> WEIGHTS_SHIFT), &tokens)
}

/// The chained keys of the first `pages` full pages of `tokens`.
pub fn page_keys(tokens: &[u32], pages: usize) -> Vec<u64> {
    model_page_keys(tokens, pages, 0)
}

/// The chained keys of the first `pages` full pages of `tokens` computed under the weights of
/// version `weights`: the chain starts from the version, so prefixes of other weights never
/// share a key (version 0: as `page_keys`).
pub fn model_page_keys(tokens: &[u32], pages: usize, weights: u32) -> Vec<u64> {
    let mut k = chain_start(weights);
    tokens
        .chunks_exact(PAGE_TOKENS)
        .take(pages)
        .map(|c| {
            k = chain(k, c);
            k
        })
        .collect()
}

/// A request a step admitted, as the device saw it.
pub struct Admitted {
    pub request: u64,
    /// The chained keys of its cacheable prompt pages.
    pub keys: Vec<u64>,
    /// Prompt pages taken from the cache, and how many of those were loaded from the host;
    /// `None` when the step did not show them (the request finished within it).
    pub cached: Option<(usize, usize)>,
}

/// A request that finished in a call: the chained keys of the full pages it inserted.
pub struct Inserted {
    pub request: u64,
    pub keys: Vec<u64>,
}

/// One engine call as the runner saw it.
pub struct Call<'a> {
    pub admitted: &'a [Admitted],
    pub finished: &'a [Inserted],
    /// Requests that ended otherwise (aborted, or their transfer failed): their locks go.
    pub ended: &'a [u64],
    /// The chained prompt keys of the request left at the head of the queue: admission tried
    /// it and found no room, and its match stayed locked while it evicted for itself.
    pub tried: &'a [u64],
    /// A copy or a step failed, a load was recomputed, or the device's context was recreated
    /// (its device tier dropped, running requests requeued), during the call.
    pub faulty: bool,
    /// Running requests the call sent back to the queue, before its admissions (the device's
    /// context was recreated): their locks went then.
    pub requeued: &'a [u64],
    /// The host pool refuses allocations by injection now.
    pub refusals: bool,
    /// The counters' growth during the call (device hits, host hits); `None` for a call that
    /// is not a step.
    pub hit_growth: Option<(u64, u64)>,
    pub now_ns: u64,
    /// What the call was, for messages (`step 12`, `evict_device(4)`).
    pub what: String,
}

/// How many decisions each check judged (a check that never applied proves nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyCounts {
    pub device_evictions: u64,
    pub host_evictions: u64,
    pub triggers: u64,
    pub hit_steps: u64,
}

/// The reference model.
pub struct PolicyModel {
    policy: WritePolicy,
    tick: u64,
    calls: u64,
    /// Each node's last use on the device tier.
    access: HashMap<NodeRef, u64>,
    /// The call in which each node's host copy was last written or read by a finished load.
    host_access: HashMap<NodeRef, u64>,
    hits: HashMap<NodeRef, u32>,
    /// Nodes whose last use the model could not observe (until a finish sets it).
    unknown: HashSet<NodeRef>,
    /// Nodes whose hits the model could not count (for as long as they live).
    hits_unknown: HashSet<NodeRef>,
    /// The nodes each running request matched (and the engine locked).
    locks: BTreeMap<u64, Vec<NodeRef>>,
    /// Locks of requests that ended otherwise than by finishing, with the last call that still
    /// counts them: two calls after the one that reported the end (a request aborted while its
    /// row was in flight is released within the next step).
    releasing: Vec<(u64, Vec<NodeRef>)>,
    /// Selective write-through: nodes whose trigger held at some admission.
    justified: HashSet<NodeRef>,
    /// Each node's chained key, computed once.
    keys: HashMap<NodeRef, u64>,
    pub counts: PolicyCounts,
}

impl PolicyModel {
    pub fn new(policy: WritePolicy) -> PolicyModel {
        PolicyModel {
            policy,
            tick: 0,
            calls: 0,
            access: HashMap::new(),
            host_access: HashMap::new(),
            hits: HashMap::new(),
            unknown: HashSet::new(),
            hits_unknown: HashSet::new(),
            locks: BTreeMap::new(),
            releasing: Vec::new(),
            justified: HashSet::new(),
            keys: HashMap::new(),
            counts: PolicyCounts::default(),
        }
    }

    /// Observes `cache` (and the host pages free).
    pub fn snapshot(&mut self, cache: &PrefixCache, host_pages_free: usize) -> Snapshot {
        let mut snap = Snapshot {
            host_pages_free,
            ..Snapshot::default()
        };
        let name = |id: NodeId| (id, cache.generation(id));
        // Keys top-down: a node's parent is keyed first (memoised across calls).
        let ids: Vec<NodeId> = cache.live_nodes().filter(|&id| id != ROOT).collect();
        for &id in &ids {
            let mut stack = vec![id];
            while let Some(&top) = stack.last() {
                if self.keys.contains_key(&name(top)) {
                    stack.pop();
                    continue;
                }
                let n = cache.node(top);
                if n.parent == ROOT {
                    self.keys.insert(name(top), top_key(&n.key));
                    stack.pop();
                } else if let Some(&pk) = self.keys.get(&name(n.parent)) {
                    self.keys.insert(name(top), chain(pk, &n.key));
                    stack.pop();
                } else {
                    stack.push(n.parent);
                }
            }
        }
        for &id in &ids {
            let n = cache.node(id);
            let me = name(id);
            let parent = (n.parent != ROOT).then(|| name(n.parent));
            let key = self.keys[&me];
            snap.nodes.insert(
                me,
                Seen {
                    parent,
                    device: n.device.is_some(),
                    loading: n.loading.is_some(),
                    host: n.host.is_some(),
                    backing_up: n.backing_up.is_some(),
                },
            );
            snap.by_key.insert(key, me);
            if let Some(p) = parent {
                if n.device.is_some() || n.loading.is_some() {
                    *snap.resident_children.entry(p).or_default() += 1;
                }
                if n.host.is_some() || n.backing_up.is_some() {
                    *snap.backed_children.entry(p).or_default() += 1;
                }
            }
        }
        snap
    }

    fn locked(&self) -> HashSet<NodeRef> {
        let releasing = self.releasing.iter().flat_map(|(_, n)| n);
        self.locks
            .values()
            .flatten()
            .chain(releasing)
            .copied()
            .collect()
    }

    /// Judges one call: `before` and `after` are the tree around it.
    pub fn observe(&mut self, before: &Snapshot, after: &Snapshot, call: &Call) -> Vec<Finding> {
        self.calls += 1;
        let mut found = Vec::new();
        // Recovery drops state without a policy decision; an injected host refusal leaves room
        // unused, which the trigger checks would take for a skipped backup.
        let triggers = !call.faulty && !call.refusals;
        let locked_before = self.locked();
        for &r in call.requeued {
            self.release(r);
        }
        let mut touched: HashSet<NodeRef> = HashSet::new();
        let hits = self.admissions(before, after, call, triggers, &mut touched, &mut found);
        if call.faulty {
            self.forget_admissions(before, call);
        }
        self.finishes(after, call, triggers, &mut touched, &mut found);
        let locked_after = self.locked();
        self.end_requests(call);
        if let (Some(grew), Some(took), false) = (call.hit_growth, hits, call.faulty) {
            found.extend(self.hit_counters(grew, took, call.now_ns));
        }
        let host_changed = self.host_uses(before, after, &locked_after);
        if !call.faulty {
            let locks = [&locked_before, &locked_after];
            let mut spared = touched;
            // A reservation that found no room held its match locked while it evicted (and its
            // host-only part pinned).
            spared.extend(
                call.tried
                    .iter()
                    .map_while(|k| before.by_key.get(k).copied()),
            );
            found.extend(self.judge(before, after, &spared, locks, &host_changed, triggers, call));
        }
        for f in &mut found {
            f.message = format!("{}: {}", call.what, f.message);
        }
        self.forget_gone(after);
        found
    }

    /// The admissions of a call, in order: each touches (and locks) the prefix it took, and
    /// under selective write-through may trigger a backup. Returns the device and host pages
    /// they took from the cache, or `None` when an admission did not show its prefix.
    fn admissions(
        &mut self,
        before: &Snapshot,
        after: &Snapshot,
        call: &Call,
        triggers: bool,
        touched: &mut HashSet<NodeRef>,
        found: &mut Vec<Finding>,
    ) -> Option<(u64, u64)> {
        let (mut dev_hits, mut host_hits, mut counted) = (0u64, 0u64, true);
        for a in call.admitted {
            self.tick += 1;
            let Some((cached, loaded)) = a.cached else {
                // Its prefix is not known: whatever it may have touched is not either.
                counted = false;
                for k in &a.keys {
                    if let Some(&n) = before.by_key.get(k) {
                        self.unknown.insert(n);
                        self.hits_unknown.insert(n);
                        touched.insert(n);
                    }
                }
                continue;
            };
            dev_hits += (cached - loaded.min(cached)) as u64;
            host_hits += loaded.min(cached) as u64;
            let matched: Vec<NodeRef> = a
                .keys
                .iter()
                .take(cached)
                .map_while(|k| before.by_key.get(k).copied())
                .collect();
            for &n in &matched {
                self.access.insert(n, self.tick);
                self.unknown.remove(&n);
                *self.hits.entry(n).or_default() += 1;
                touched.insert(n);
            }
            let device_part = cached.saturating_sub(loaded).min(matched.len());
            // Its loads read the host copies (one may end within this very call).
            for &n in &matched[device_part..] {
                self.host_access.insert(n, self.calls);
            }
            if device_part > 0 && self.policy == WritePolicy::WriteThroughSelective {
                let last = matched[device_part - 1];
                found.extend(self.selective_trigger(before, after, last, triggers, a, call));
            }
            self.locks.insert(a.request, matched);
        }
        counted.then_some((dev_hits, host_hits))
    }

    /// Selective write-through's trigger at an admission whose device-resident prefix ends at
    /// `last`: hit for at least the second time, it justifies a backup of its path; without a
    /// host copy at the call's start, one must start (or wait for an ancestor's).
    fn selective_trigger(
        &mut self,
        before: &Snapshot,
        after: &Snapshot,
        last: NodeRef,
        triggers: bool,
        a: &Admitted,
        call: &Call,
    ) -> Option<Finding> {
        let hits = self.hits[&last];
        if hits < 2 || self.hits_unknown.contains(&last) {
            return None;
        }
        // Justified even with a host copy at the call's start: host eviction earlier in the
        // call may have dropped it before this admission looked.
        self.justified.insert(last);
        let had_host = before.get(last).is_some_and(|s| s.host);
        if had_host || !triggers {
            return None;
        }
        let depth = before.path(last).len();
        self.expect_backup(
            after,
            last,
            &format!(
                "selective write-through: request {} hit the prefix ending at page {depth} for the {hits}th time without a host copy",
                a.request
            ),
            call.now_ns,
        )
    }

    /// A faulty call: a load that failed within it left its request with less than it matched,
    /// so what its admissions touched, hit and loaded is not known.
    fn forget_admissions(&mut self, before: &Snapshot, call: &Call) {
        for a in call.admitted {
            for n in a.keys.iter().filter_map(|k| before.by_key.get(k)) {
                self.unknown.insert(*n);
                self.hits_unknown.insert(*n);
                self.host_access.remove(n);
            }
        }
    }

    /// The finishes of a call: each inserts its full pages, most recently used, and releases
    /// its locks; under write-through its path must be backed up.
    fn finishes(
        &mut self,
        after: &Snapshot,
        call: &Call,
        triggers: bool,
        touched: &mut HashSet<NodeRef>,
        found: &mut Vec<Finding>,
    ) {
        for f in call.finished {
            self.tick += 1;
            self.locks.remove(&f.request);
            let mut path = Vec::new();
            for k in &f.keys {
                let Some(&n) = after.by_key.get(k) else { break };
                // Insertion stops at a node another request's load fills; a load that ended in
                // the call was acknowledged before any request finished.
                if after.get(n).is_some_and(|s| s.loading) {
                    break;
                }
                self.access.insert(n, self.tick);
                self.unknown.remove(&n);
                touched.insert(n);
                path.push(n);
            }
            let Some(&last) = path.last() else { continue };
            if self.policy == WritePolicy::WriteThrough && triggers {
                let what = format!(
                    "write-through: request {} finished with {} full pages",
                    f.request,
                    path.len()
                );
                found.extend(self.expect_backup(after, last, &what, call.now_ns));
            }
        }
    }

    /// Requests that ended otherwise than by finishing: their locks are counted for two more
    /// calls (their release comes within one), and their nodes' last use is not known.
    fn end_requests(&mut self, call: &Call) {
        let calls = self.calls;
        self.releasing.retain(|(until, _)| *until >= calls);
        for &r in call.ended {
            self.release(r);
        }
    }

    /// Request `r` released its locks. Releasing a lock is a use, at a time the model does not
    /// see (the abort call, within a step for a request aborted while its row was in flight, or
    /// a requeue).
    fn release(&mut self, r: u64) {
        if let Some(nodes) = self.locks.remove(&r) {
            self.unknown.extend(nodes.iter().copied());
            self.releasing.push((self.calls + 2, nodes));
        }
    }

    /// The prefix-hit counters' growth (device, host) against what the admissions took.
    fn hit_counters(&mut self, grew: (u64, u64), took: (u64, u64), now_ns: u64) -> Option<Finding> {
        self.counts.hit_steps += 1;
        let ((dev, host), (dev_hits, host_hits)) = (grew, took);
        (grew != took).then(|| Finding {
            oracle: OracleKind::Metrics,
            time_ns: now_ns,
            message: format!(
                "the step's prefix hits grew by {dev} device and {host} host pages; the requests it admitted took {dev_hits} cached pages from the device and loaded {host_hits}"
            ),
        })
    }

    /// Host copies whose last use changed in the call (a backup ended, or a load that read one);
    /// returns the nodes whose host state changed at all.
    fn host_uses(
        &mut self,
        before: &Snapshot,
        after: &Snapshot,
        locked_after: &HashSet<NodeRef>,
    ) -> HashSet<NodeRef> {
        let mut host_changed: HashSet<NodeRef> = HashSet::new();
        for (&n, a) in &after.nodes {
            let b = before.get(n);
            let gained = a.host && !b.is_some_and(|b| b.host);
            let load_ended = b.is_some_and(|b| b.loading) && !a.loading;
            if gained || load_ended {
                self.host_access.insert(n, self.calls);
            }
            if load_ended && !locked_after.contains(&n) {
                // An orphaned load (its request aborted) releases its lock at its end, a use.
                self.unknown.insert(n);
            }
            if b.is_none_or(|b| b.host != a.host || b.backing_up != a.backing_up) {
                host_changed.insert(n);
            }
        }
        host_changed
    }

    /// The checks of a call without faults; `locks` are the model's locks before and after it.
    #[allow(clippy::too_many_arguments)]
    fn judge(
        &mut self,
        before: &Snapshot,
        after: &Snapshot,
        spared: &HashSet<NodeRef>,
        locks: [&HashSet<NodeRef>; 2],
        host_changed: &HashSet<NodeRef>,
        triggers: bool,
        call: &Call,
    ) -> Vec<Finding> {
        let mut found = Vec::new();
        let now_ns = call.now_ns;
        // Under write-back, an eviction whose backup could not be issued (the host had no room,
        // or an ancestor's backup was in flight) is withdrawn and the node stays, behind younger
        // nodes that went: the order is judged under the other policies.
        if self.policy != WritePolicy::WriteBack {
            found.extend(self.device_order(before, after, spared, locks[0], locks[1], now_ns));
        }
        if !triggers {
            // A backup whose host pages were refused after host eviction made room leaves no
            // trace of the path its eviction spared.
            return found;
        }
        found.extend(self.host_order(before, after, spared, host_changed, now_ns));
        match self.policy {
            WritePolicy::WriteBack => found.extend(self.write_back(before, after, now_ns)),
            WritePolicy::WriteThroughSelective => {
                found.extend(self.selective_justified(before, after, now_ns))
            }
            WritePolicy::WriteThrough => {}
        }
        found
    }

    /// Nodes that are gone are forgotten.
    fn forget_gone(&mut self, after: &Snapshot) {
        let live = |n: &NodeRef| after.nodes.contains_key(n);
        self.access.retain(|n, _| live(n));
        self.host_access.retain(|n, _| live(n));
        self.hits.retain(|n, _| live(n));
        self.unknown.retain(live);
        self.hits_unknown.retain(live);
        self.justified.retain(live);
        self.keys.retain(|n, _| live(n));
    }

    /// A backup of the path ending at `last` started (or one of its ancestors' is in flight, which
    /// it waits for), or the host tier had no room for it.
    fn expect_backup(
        &mut self,
        after: &Snapshot,
        last: NodeRef,
        what: &str,
        now: u64,
    ) -> Option<Finding> {
        let path = after.path(last);
        let Some(end) = after.get(last) else {
            return None; // evicted within the call
        };
        if end.host
            || path
                .iter()
                .any(|&n| after.get(n).is_some_and(|s| s.backing_up))
        {
            self.counts.triggers += 1;
            return None;
        }
        let need = path
            .iter()
            .filter(|&&n| after.get(n).is_some_and(|s| !s.host))
            .count();
        if after.host_pages_free < need {
            return None; // the host tier may have had no room
        }
        self.counts.triggers += 1;
        Some(Finding {
            oracle: OracleKind::Policy,
            time_ns: now,
            message: format!(
                "{what}, and no backup of its {need} pages without a host copy started although {} host pages were free",
                after.host_pages_free
            ),
        })
    }

    fn device_order(
        &mut self,
        before: &Snapshot,
        after: &Snapshot,
        touched: &HashSet<NodeRef>,
        locked_before: &HashSet<NodeRef>,
        locked_after: &HashSet<NodeRef>,
        now: u64,
    ) -> Option<Finding> {
        let known = |n: &NodeRef| {
            !touched.contains(n) && !self.unknown.contains(n) && self.access.contains_key(n)
        };
        let evicted: Vec<NodeRef> = before
            .nodes
            .iter()
            .filter(|(n, s)| {
                s.device && !s.backing_up && known(n) && after.get(**n).is_none_or(|a| !a.device)
            })
            .map(|(n, _)| *n)
            .collect();
        if evicted.is_empty() {
            return None;
        }
        let same_host = |n: NodeRef| {
            let (b, a) = (before.get(n), after.get(n));
            b.zip(a)
                .is_some_and(|(b, a)| b.host == a.host && b.backing_up == a.backing_up)
        };
        let kept = before
            .nodes
            .keys()
            .copied()
            .filter(|&n| {
                known(&n)
                    && same_host(n)
                    && before.device_candidate(n, locked_before)
                    && after.device_candidate(n, locked_after)
            })
            .min_by_key(|n| (self.access[n], *n))?;
        self.counts.device_evictions += evicted.len() as u64;
        let newest = evicted
            .iter()
            .copied()
            .max_by_key(|n| (self.access[n], *n))?;
        let (t_kept, t_gone) = (self.access[&kept], self.access[&newest]);
        (t_gone > t_kept).then(|| Finding {
            oracle: OracleKind::Policy,
            time_ns: now,
            message: format!(
                "device eviction is not least recently used: it took node {} (page {} of its prefix, last used at the model's use tick {t_gone}) while node {} (page {} of its prefix, last used at tick {t_kept}) stayed evictable throughout (use ticks count admissions and finishes in order)",
                newest.0,
                before.path(newest).len(),
                kept.0,
                before.path(kept).len()
            ),
        })
    }

    fn host_order(
        &mut self,
        before: &Snapshot,
        after: &Snapshot,
        touched: &HashSet<NodeRef>,
        host_changed: &HashSet<NodeRef>,
        now: u64,
    ) -> Option<Finding> {
        let evicted: Vec<NodeRef> = before
            .nodes
            .iter()
            .filter(|(n, s)| s.host && after.get(**n).is_none_or(|a| !a.host))
            .map(|(n, _)| *n)
            .filter(|n| self.host_access.contains_key(n))
            .collect();
        if evicted.is_empty() {
            return None;
        }
        // Spared by host eviction during the call: the paths of backups it started (their
        // ancestors keep their copies), copies a load read, copies used in the call.
        let mut spared: HashSet<NodeRef> = touched.clone();
        for (&n, a) in &after.nodes {
            if a.backing_up && !before.get(n).is_some_and(|b| b.backing_up) {
                spared.extend(after.path(n));
            }
            if a.loading || before.get(n).is_some_and(|b| b.loading) {
                spared.insert(n);
            }
        }
        // A backup can also start and end within the call (acknowledged by a step that waits
        // for copies): its path gained host copies, and its parent was spared too.
        for &n in host_changed {
            spared.extend(after.path(n));
        }
        let kept = before
            .nodes
            .keys()
            .copied()
            .filter(|&n| {
                !spared.contains(&n)
                    && before.host_candidate(n)
                    && after.host_candidate(n)
                    && self.host_access.contains_key(&n)
            })
            .min_by_key(|n| (self.host_access[n], *n))?;
        self.counts.host_evictions += evicted.len() as u64;
        let newest = evicted
            .iter()
            .copied()
            .max_by_key(|n| (self.host_access[n], *n))?;
        let (t_kept, t_gone) = (self.host_access[&kept], self.host_access[&newest]);
        (t_gone > t_kept).then(|| Finding {
            oracle: OracleKind::Policy,
            time_ns: now,
            message: format!(
                "host eviction is not least recently used: it dropped the host copy of node {} (page {} of its prefix, last used in engine call {t_gone}) while that of node {} (page {} of its prefix, last used in call {t_kept}) stayed evictable throughout (calls count steps and operator evictions)",
                newest.0,
                before.path(newest).len(),
                kept.0,
                before.path(kept).len()
            ),
        })
    }

    /// Write-back: a device page without a host copy leaves the device only through a backup.
    /// The engine's fallback drops unbacked leaves (least recently used first) in a call where a
    /// write-back eviction could not be issued; besides a full host tier, that happens when the
    /// evicted node's ancestor is being backed up. With any backup in flight around the call,
    /// the model cannot tell, and does not judge.
    fn write_back(&mut self, before: &Snapshot, after: &Snapshot, now: u64) -> Option<Finding> {
        let in_flight = |s: &Snapshot| s.nodes.values().any(|s| s.backing_up);
        if in_flight(before) || in_flight(after) {
            return None;
        }
        for (&n, b) in &before.nodes {
            let dropped = b.device
                && !b.host
                && !b.backing_up
                && after.get(n).is_none_or(|a| !a.device && !a.host);
            if !dropped {
                continue;
            }
            let path = before.path(n);
            let need = path
                .iter()
                .filter(|&&p| before.get(p).is_some_and(|s| !s.host))
                .count();
            self.counts.triggers += 1;
            if after.host_pages_free >= need {
                return Some(Finding {
                    oracle: OracleKind::Policy,
                    time_ns: now,
                    message: format!(
                        "write-back dropped node {}'s device page without backing it up, although {} host pages were free (its path needs {need})",
                        n.0, after.host_pages_free
                    ),
                });
            }
        }
        None
    }

    /// Selective write-through: every backup a call started ends at a node whose trigger held.
    fn selective_justified(
        &mut self,
        before: &Snapshot,
        after: &Snapshot,
        now: u64,
    ) -> Option<Finding> {
        let started: Vec<NodeRef> = after
            .nodes
            .iter()
            .filter(|(n, a)| a.backing_up && !before.get(**n).is_some_and(|b| b.backing_up))
            .map(|(n, _)| *n)
            .collect();
        if started.is_empty() {
            return None;
        }
        // A node is covered when it is on the path of a node whose trigger held.
        let mut covered: HashSet<NodeRef> = HashSet::new();
        for &j in self.justified.iter().chain(&self.hits_unknown) {
            covered.extend(after.path(j));
        }
        self.counts.triggers += started.len() as u64;
        let n = started.into_iter().find(|n| !covered.contains(n))?;
        Some(Finding {
            oracle: OracleKind::Policy,
            time_ns: now,
            message: format!(
                "selective write-through backed up node {} (hit {} times), which is on no prefix hit a second time as the last device page of an admission",
                n.0,
                self.hits.get(&n).copied().unwrap_or(0)
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierkv_engine::cache::page_keys as engine_keys;
    use tierkv_engine::layout::PageId;

    fn tokens(seed: u32) -> Vec<u32> {
        (0..64).map(|i| seed * 1000 + i).collect()
    }

    fn call<'a>(finished: &'a [Inserted]) -> Call<'a> {
        Call {
            admitted: &[],
            finished,
            ended: &[],
            tried: &[],
            faulty: false,
            requeued: &[],
            refusals: false,
            hit_growth: None,
            now_ns: 0,
            what: "test".into(),
        }
    }

    /// Inserts one single-page prefix per seed, in order, each observed as a finish; then asks
    /// the cache for one page and returns the model's findings on that eviction. `model_order`
    /// is the order in which the model is told the prefixes finished.
    fn evict_one(engine_order: [u32; 2], model_order: [u32; 2]) -> Vec<Finding> {
        let mut cache = PrefixCache::new();
        // Selective write-through: finishes alone trigger no backup.
        let mut model = PolicyModel::new(WritePolicy::WriteThroughSelective);
        for (i, s) in engine_order.into_iter().enumerate() {
            cache.insert(&engine_keys(&tokens(s), 1), &[PageId(i as u32)]);
        }
        // The model sees both finishes, in its own order, across two calls.
        let empty = model.snapshot(&PrefixCache::new(), 10);
        let full = model.snapshot(&cache, 10);
        let first = [Inserted {
            request: 0,
            keys: page_keys(&tokens(model_order[0]), 1),
        }];
        let second = [Inserted {
            request: 1,
            keys: page_keys(&tokens(model_order[1]), 1),
        }];
        assert!(model.observe(&empty, &full, &call(&first)).is_empty());
        assert!(model.observe(&full, &full, &call(&second)).is_empty());
        let before = model.snapshot(&cache, 10);
        let ev = cache.evict_device(1, WritePolicy::WriteThroughSelective);
        assert_eq!(ev.freed.len(), 1);
        let after = model.snapshot(&cache, 10);
        let found = model.observe(&before, &after, &call(&[]));
        assert_eq!(model.counts.device_evictions, 1);
        found
    }

    #[test]
    fn least_recently_used_eviction_passes() {
        assert!(evict_one([1, 2], [1, 2]).is_empty());
    }

    #[test]
    fn eviction_of_the_newer_prefix_is_a_finding() {
        // The engine evicts prefix 1, its oldest; the model saw prefix 1 finish last.
        let found = evict_one([1, 2], [2, 1]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].oracle, OracleKind::Policy);
        assert!(found[0].message.contains("not least recently used"));
    }

    #[test]
    fn write_through_expects_a_backup_of_a_finished_request() {
        let mut cache = PrefixCache::new();
        let mut model = PolicyModel::new(WritePolicy::WriteThrough);
        let before = model.snapshot(&cache, 10);
        cache.insert(&engine_keys(&tokens(1), 1), &[PageId(0)]);
        let finished = [Inserted {
            request: 0,
            keys: page_keys(&tokens(1), 1),
        }];
        // The host has room for the page: no backup started is a finding.
        let after = model.snapshot(&cache, 10);
        let found = model.observe(&before, &after, &call(&finished));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].message.starts_with("test: write-through"),
            "{found:?}"
        );
        // No room: no finding.
        let mut model = PolicyModel::new(WritePolicy::WriteThrough);
        let after = model.snapshot(&cache, 0);
        assert!(model.observe(&before, &after, &call(&finished)).is_empty());
    }

    /// One single-page prefix, inserted and observed as a finish under `policy`.
    fn one_prefix(policy: WritePolicy) -> (PrefixCache, PolicyModel, NodeId) {
        let mut cache = PrefixCache::new();
        let mut model = PolicyModel::new(policy);
        let empty = model.snapshot(&cache, 10);
        let ins = cache.insert(&engine_keys(&tokens(1), 1), &[PageId(0)]);
        let full = model.snapshot(&cache, 0); // no host room: no trigger expected
        let finished = [Inserted {
            request: 0,
            keys: page_keys(&tokens(1), 1),
        }];
        assert!(model.observe(&empty, &full, &call(&finished)).is_empty());
        (cache, model, ins.nodes[0])
    }

    /// Selective write-through: a backup after the first hit is a finding; after the second
    /// it is justified.
    #[test]
    fn selective_backup_needs_a_second_hit() {
        for hits in [1, 2] {
            let (mut cache, mut model, node) = one_prefix(WritePolicy::WriteThroughSelective);
            for h in 0..hits {
                let before = model.snapshot(&cache, 0);
                if h == hits - 1 {
                    cache.begin_backup(&[node], &[PageId(0)]);
                }
                let after = model.snapshot(&cache, 0);
                let admitted = [Admitted {
                    request: 10 + h,
                    keys: page_keys(&tokens(1), 1),
                    cached: Some((1, 0)),
                }];
                let mut c = call(&[]);
                c.admitted = &admitted;
                let found = model.observe(&before, &after, &c);
                let expect_finding = hits == 1 && h == hits - 1;
                assert_eq!(
                    found.len(),
                    expect_finding as usize,
                    "hits {hits}: {found:?}"
                );
            }
        }
    }

    /// Write-back: dropping a page without a host copy is a finding when the host had room.
    #[test]
    fn write_back_never_drops_an_unbacked_page_with_room() {
        for room in [0, 10] {
            let (mut cache, mut model, _) = one_prefix(WritePolicy::WriteBack);
            let before = model.snapshot(&cache, room);
            // The write-through eviction deletes the unbacked leaf.
            assert_eq!(
                cache.evict_device(1, WritePolicy::WriteThrough).freed.len(),
                1
            );
            let after = model.snapshot(&cache, room);
            let found = model.observe(&before, &after, &call(&[]));
            assert_eq!(found.len(), (room > 0) as usize, "room {room}: {found:?}");
        }
    }

    #[test]
    fn chained_keys_name_token_prefixes() {
        let a = page_keys(&[tokens(1), tokens(2)].concat(), 2);
        let b = page_keys(&[tokens(1), tokens(3)].concat(), 2);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_eq!(page_keys(&tokens(1), 2).len(), 1, "only full pages");
    }
}
