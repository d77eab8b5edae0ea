//! The cache controller: it owns the loads in flight (host → device on the load stream), the ring
//! of load slots and their events, the backups in flight (device → host on the write stream), the
//! backups deferred behind an ancestor's, and the pool of free events. It moves pages between the
//! tiers and keeps the prefix cache's load and backup state in step with the copies; it never
//! touches a request. What an acknowledgement means for a request comes back as an effect
//! ([`LoadAck`]) that the engine hands to the scheduler.
//!
//! Backup: the write stream waits for the compute stream's last step event, copies every layer
//! (KV and index-K) of the nodes' device pages to their new host pages, and records a finish event;
//! the nodes stay protected until the host sees that event.
//!
//! Load: device pages are allocated, the host pages pinned; the load stream copies layer by layer
//! (KV and index-K together) and records one event per layer in a slot of the load ring; the
//! compute stream gates each layer on its event (`gate.rs`). The ring slot is reused only after its
//! last event; nothing is published before the host sees the copy finished. A failed copy leaves
//! the cache consistent: nothing is published, pins and locks are released, and the request
//! recomputes those tokens into the pages it already holds.
//!
//! Invariants (asserted where they change): every load in flight occupies exactly its ring slot,
//! and every occupied slot names a load in flight; a load has one device page per node, a backup
//! one host page per node; the host sees a load's events complete before it acknowledges it.

use crate::cache::{NodeId, PageKey, PrefixCache};
use crate::config::WritePolicy;
use crate::device::{call_recovering, Clock, Device, DeviceError, EventId, EventState, StreamKind};
use crate::error::EngineError;
use crate::exchange::{Grant, LoadAck, LoadId};
use crate::layout::{BufferKind, HostLayout, IndexKDtype, LayerId, Layout, PageId};
use crate::metrics::Metrics;
use crate::mutants::Mutants;
use crate::pools::Pools;
use crate::probe::{self, Probe};
use crate::transfer::{Transfer, TransferError};
use std::collections::BTreeMap;

/// A load in flight.
#[derive(Clone, Debug)]
struct Load {
    request: u64,
    slot: usize,
    nodes: Vec<NodeId>,
    dev_pages: Vec<PageId>,
    issued_ns: u64,
    /// A copy could not even be enqueued: the load counts as failed.
    enqueue_failed: bool,
    /// Its request was aborted: the pages are freed (or published) at the ack, and nobody waits.
    orphaned: bool,
    /// Mutant 40: its lease ran out while it ran, and its host pins were dropped then.
    lease_expired: bool,
}

/// A backup in flight.
#[derive(Clone, Debug)]
struct Backup {
    nodes: Vec<NodeId>,
    event: EventId,
    issued_ns: u64,
}

/// The ring of load slots: each slot's per-layer events, and the load that holds it.
#[derive(Clone, Debug)]
struct LoadRing {
    holder: Vec<Option<LoadId>>,
    events: Vec<Vec<EventId>>,
    next: usize,
}

/// What one controller call works on, borrowed from the engine for the call.
pub(crate) struct Io<'a, D, C, T> {
    pub dev: &'a mut D,
    pub clock: &'a C,
    pub transfer: &'a mut T,
    pub layout: &'a Layout,
    pub pools: &'a mut Pools,
    pub cache: &'a mut PrefixCache,
    pub metrics: &'a mut Metrics,
    pub mutants: Mutants,
}

/// How a backup ended, as the engine counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Done,
    /// Its copy failed, or could not be enqueued.
    Failed,
    /// Its event did not report a failure, but the device's memory was lost under it (its
    /// context recreated) before the engine acknowledged it (`CacheController::fail_all`).
    Lost,
}

/// The worse of two event states (Failed > Pending > Done).
fn worse(a: EventState, b: EventState) -> EventState {
    use EventState::*;
    match (a, b) {
        (Failed, _) | (_, Failed) => Failed,
        (Pending, _) | (_, Pending) => Pending,
        _ => Done,
    }
}

pub(crate) struct CacheController {
    write_policy: WritePolicy,
    loads: BTreeMap<LoadId, Load>,
    next_load: u64,
    ring: LoadRing,
    backups: Vec<Backup>,
    /// Backups waiting for an ancestor's backup to be acknowledged (node and its generation).
    deferred: Vec<(NodeId, u64)>,
    free_events: Vec<EventId>,
    /// The device could not recover from a fault it reported: the engine stops with this.
    lost: Option<DeviceError>,
    /// The device's `context_generation` when the controller last failed what was in flight
    /// ([`CacheController::fail_all`]). While the device's is newer, no backup is acknowledged
    /// as done: it may have copied memory the recreation lost (`poll_backups`).
    context_generation: u64,
}

impl CacheController {
    /// A controller with `load_slots` ring slots of one event per layer.
    pub(crate) fn new<D: Device>(
        dev: &mut D,
        write_policy: WritePolicy,
        load_slots: u32,
        layers: u32,
    ) -> Result<Self, DeviceError> {
        let events = (0..load_slots)
            .map(|_| (0..layers).map(|_| dev.new_event()).collect())
            .collect::<Result<Vec<Vec<EventId>>, DeviceError>>()?;
        Ok(CacheController {
            write_policy,
            loads: BTreeMap::new(),
            next_load: 0,
            ring: LoadRing {
                holder: vec![None; load_slots as usize],
                events,
                next: 0,
            },
            backups: Vec::new(),
            deferred: Vec::new(),
            free_events: Vec::new(),
            lost: None,
            context_generation: dev.context_generation(),
        })
    }

    /// A copy's event reported a failure: the device's error is cleared at once (a fault is
    /// sticky until then, and would fail every copy after it). A device that cannot recover is
    /// kept for the engine to report ([`CacheController::take_lost`]).
    fn recover<D: Device, C: Clock, T: Transfer>(&mut self, io: &mut Io<'_, D, C, T>) {
        match io.dev.recover() {
            Ok(()) => {
                probe::hit(Probe::DeviceRecovered);
            }
            Err(e) => {
                self.lost.get_or_insert(e);
            }
        }
    }

    /// The error of a device that could not recover from a fault, once.
    pub(crate) fn take_lost(&mut self) -> Option<DeviceError> {
        self.lost.take()
    }

    /// No load and no backup in flight.
    pub(crate) fn is_idle(&self) -> bool {
        self.loads.is_empty() && self.backups.is_empty()
    }
    pub(crate) fn loads_in_flight(&self) -> usize {
        self.loads.len()
    }
    pub(crate) fn backups_in_flight(&self) -> usize {
        self.backups.len()
    }

    /// Device pages that loads in flight hold outside the tree (all of them, except under the
    /// mutants that publish or free them early).
    pub(crate) fn loading_pages(&self, mutants: Mutants) -> usize {
        if mutants.load_publishes_at_issue() {
            return 0;
        }
        self.loads
            .values()
            .filter(|l| !(l.orphaned && mutants.abort_frees_load_pages()))
            .map(|l| l.dev_pages.len())
            .sum()
    }

    fn finish_event(&self, id: LoadId) -> EventId {
        let slot = self.loads[&id].slot;
        *self.ring.events[slot].last().expect("at least one layer")
    }

    /// For each of `loads`, its event of every local layer: what the layer gates wait for.
    pub(crate) fn layer_events(&self, loads: &[LoadId]) -> Vec<Vec<EventId>> {
        loads
            .iter()
            .map(|id| self.ring.events[self.loads[id].slot].clone())
            .collect()
    }

    /// Checks the ring against the loads in flight; panics on the first broken invariant.
    pub(crate) fn check_invariants(&self) {
        for (slot, holder) in self.ring.holder.iter().enumerate() {
            if let Some(id) = holder {
                let load = self
                    .loads
                    .get(id)
                    .unwrap_or_else(|| panic!("ring slot {slot} names {id}, not in flight"));
                assert_eq!(
                    load.slot, slot,
                    "{id} holds slot {slot} but says {}",
                    load.slot
                );
            }
        }
        for (id, load) in &self.loads {
            assert_eq!(
                self.ring.holder[load.slot],
                Some(*id),
                "{id} in flight without its ring slot {}",
                load.slot
            );
            assert_eq!(
                load.nodes.len(),
                load.dev_pages.len(),
                "{id}: nodes vs pages"
            );
        }
    }

    /// Copies every layer of `pairs` (source page, destination page) between the tiers, recording
    /// `events[l]` after layer `l`. Returns whether some copy could not be enqueued.
    fn copy_all_layers<D: Device, C: Clock, T: Transfer>(
        io: &mut Io<'_, D, C, T>,
        stream: StreamKind,
        to_host: bool,
        pairs: &[(PageId, PageId)],
        events: Option<&[EventId]>,
    ) -> Result<bool, EngineError> {
        let mut enqueue_failed = false;
        let p = io.layout.params();
        match p.host_layout {
            HostLayout::LayerFirst => probe::hit(Probe::CopyLayerFirst),
            HostLayout::PageFirst => {
                probe::hit_if(
                    Probe::CopyPageFirstBf16,
                    p.index_k_dtype == IndexKDtype::Bf16,
                );
            }
        }
        // Mutants 3 and 29: a backup or a load that leaves the index-K pages behind.
        let skips_index_k = if to_host {
            io.mutants.backup_skips_index_k()
        } else {
            io.mutants.load_skips_index_k()
        };
        for l in 0..io.layout.layers() {
            let layer = LayerId(l);
            for kind in BufferKind::ALL {
                if kind == BufferKind::IndexK && skips_index_k {
                    continue;
                }
                let dev = io.pools.device_side(kind, layer);
                let host = io.pools.host_side(kind, layer);
                let (src, dst) = if to_host { (dev, host) } else { (host, dev) };
                let dst = dst.as_copied_from(&src, io.mutants);
                match io.transfer.copy_pages(io.dev, stream, src, dst, pairs) {
                    Ok(()) => {}
                    // A copy the backend could not take is a failed transfer, handled like one
                    // that failed in flight; a layout refusal is a bug and stops the engine.
                    // A device in error refuses it the same way (its records report failures).
                    Err(TransferError::Device(e)) if e.is_transient() => enqueue_failed = true,
                    Err(e) => return Err(e.into()),
                }
            }
            if let Some(evs) = events {
                // The layer's event must capture its copies: a record that failed is made again
                // (an event left with its previous capture would report the copies done).
                call_recovering(io.dev, |d| d.record(stream, evs[l as usize]))?;
            }
        }
        Ok(enqueue_failed)
    }

    /// The next ring slot, free: a previous holder is waited for (its finish event) and
    /// acknowledged first. Returns the slot and that acknowledgement.
    fn claim_slot<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
    ) -> (usize, Option<LoadAck>) {
        let slot = self.ring.next;
        let held = self.ring.holder.iter().filter(|h| h.is_some()).count();
        probe::watermark(probe::Watermark::LoadRingHeld, held as u64);
        self.ring.next = (slot + 1) % self.ring.holder.len();
        let mut reclaimed = None;
        if let Some(old) = self.ring.holder[slot] {
            probe::hit(Probe::LoadRingFull);
            // The slot's events are about to be re-recorded: its previous load must be over.
            if !io.mutants.slot_reused_without_wait() {
                let fin = self.finish_event(old);
                io.dev.synchronize(fin);
            }
            reclaimed = self.ack(io, old);
        }
        assert_eq!(
            self.ring.holder[slot], None,
            "ring slot {slot} claimed while held"
        );
        (slot, reclaimed)
    }

    /// Issues the load of host-only `nodes` into `dev_pages` for `request`. Returns the load and
    /// the acknowledgement of the load that held its ring slot before, if any.
    pub(crate) fn issue_load<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        request: u64,
        nodes: Vec<NodeId>,
        dev_pages: Vec<PageId>,
    ) -> Result<(LoadId, Option<LoadAck>), EngineError> {
        assert_eq!(
            nodes.len(),
            dev_pages.len(),
            "a load has one device page per node"
        );
        let (slot, reclaimed) = self.claim_slot(io);
        let host_pages: Vec<PageId> = nodes
            .iter()
            .map(|&n| io.cache.node(n).host.expect("loading a backed-up node"))
            .collect();
        io.cache.begin_load(&nodes, &dev_pages);
        if io.mutants.load_publishes_at_issue() {
            io.cache.publish_early(&nodes);
        }
        let id = LoadId(self.next_load);
        self.next_load += 1;
        let pairs: Vec<(PageId, PageId)> = host_pages
            .into_iter()
            .zip(dev_pages.iter().copied())
            .collect();
        let events = self.ring.events[slot].clone();
        let enqueue_failed =
            Self::copy_all_layers(io, StreamKind::Load, false, &pairs, Some(&events))?;
        if io.mutants.load_events_pooled_at_issue() {
            self.free_events.extend(events.iter().copied());
        }
        self.ring.holder[slot] = Some(id);
        probe::hit(Probe::LoadIssued);
        probe::hit_if(Probe::LoadEnqueueFailed, enqueue_failed);
        io.metrics.loads += 1;
        io.metrics.load_bytes += io.layout.transfer_bytes(pairs.len() as u64).0;
        let load = Load {
            request,
            slot,
            nodes,
            dev_pages,
            issued_ns: io.clock.now_ns(),
            enqueue_failed,
            orphaned: false,
            lease_expired: false,
        };
        self.loads.insert(id, load);
        Ok((id, reclaimed))
    }

    /// Acknowledges load `id` once its events answer: publishes or unwinds the nodes, releases
    /// what an orphaned load held. `None` when the load is unknown (already acknowledged).
    pub(crate) fn ack<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        id: LoadId,
    ) -> Option<LoadAck> {
        self.ack_as(io, id, false)
    }

    /// The device lost its memory (its context was recreated): every load and backup in flight
    /// failed, whatever its events answer (a load's pages hold garbage now; a backup is not
    /// known to have finished reading its pages before they went), and the backups waiting for
    /// an ancestor's are dropped. Each is waited for first: one issued after the recreation
    /// still runs, and its pages go back only once it is over. Returns the loads'
    /// acknowledgements.
    pub(crate) fn fail_all<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
    ) -> Vec<LoadAck> {
        self.context_generation = io.dev.context_generation();
        let ids: Vec<LoadId> = self.loads.keys().copied().collect();
        let mut acks = Vec::new();
        for id in ids {
            // Its layers' copies are in order on the load stream: all over with the last.
            io.dev.synchronize(self.finish_event(id));
            acks.extend(self.ack_as(io, id, true));
        }
        for b in std::mem::take(&mut self.backups) {
            let outcome = match io.dev.synchronize(b.event) {
                EventState::Failed => {
                    self.recover(io);
                    Outcome::Failed
                }
                _ => Outcome::Lost,
            };
            self.finish_backup(io, b, outcome);
        }
        self.deferred.clear();
        acks
    }

    /// [`CacheController::ack`]; with `lost`, the load failed whatever its events answer.
    fn ack_as<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        id: LoadId,
        lost: bool,
    ) -> Option<LoadAck> {
        let load = self.loads.remove(&id)?;
        assert_eq!(
            self.ring.holder[load.slot],
            Some(id),
            "{id} acknowledged without its ring slot"
        );
        self.ring.holder[load.slot] = None;
        let state = self.ring.events[load.slot]
            .iter()
            .fold(EventState::Done, |s, &ev| worse(s, io.dev.query(ev)));
        assert!(
            state != EventState::Pending || io.mutants.acks_may_precede_copy(),
            "{id} acknowledged while its copy is in flight"
        );
        if state == EventState::Failed {
            self.recover(io);
        }
        // Pending only under the mutants that ack without waiting: the copy is then taken as done.
        // Mutant 38 took the load's success for granted when it issued it.
        let ok = !lost
            && (io.mutants.load_ok_at_issue()
                || (state != EventState::Failed && !load.enqueue_failed));
        let unpublished = if io.mutants.load_publishes_at_issue() {
            io.cache.unpin(&load.nodes);
            Vec::new()
        } else if load.lease_expired {
            io.cache.finish_load_unpinned(&load.nodes, ok)
        } else {
            io.cache.finish_load(&load.nodes, ok)
        };
        io.metrics
            .load_latency
            .observe(io.clock.now_ns().saturating_sub(load.issued_ns));
        if !ok && lost && state == EventState::Done && !load.enqueue_failed {
            // Its copy completed, into memory the device lost since.
            io.metrics.loads_lost += 1;
        } else if !ok {
            io.metrics.load_failures += 1;
            probe::hit(Probe::LoadFailed);
        }
        if load.orphaned {
            probe::hit(Probe::LoadOrphanAcked);
            // The request is gone: drop its lock on the loaded nodes; free pages nobody holds.
            io.cache.unlock(&load.nodes);
            if !io.mutants.abort_frees_load_pages() {
                io.pools.device_pages.free(&unpublished);
            }
        } else if !ok {
            // Nothing was published: the pages stay with the request, which recomputes them.
            io.cache.unlock(&load.nodes);
        }
        Some(LoadAck {
            load: id,
            request: load.request,
            ok,
            nodes: load.nodes.len(),
            orphaned: load.orphaned,
        })
    }

    /// Acknowledges the loads whose copy ended.
    pub(crate) fn poll_loads<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
    ) -> Vec<LoadAck> {
        if let Some(lease) = io.mutants.host_lease_ns() {
            // Mutant 40: a load older than its lease no longer keeps its host copies.
            let now = io.clock.now_ns();
            for load in self.loads.values_mut() {
                if !load.lease_expired && now.saturating_sub(load.issued_ns) >= lease {
                    io.cache.unpin(&load.nodes);
                    load.lease_expired = true;
                }
            }
        }
        let ids: Vec<LoadId> = self.loads.keys().copied().collect();
        let mut acks = Vec::new();
        for id in ids {
            let fin = self.finish_event(id);
            if io.dev.query(fin) != EventState::Pending {
                acks.extend(self.ack(io, id));
            }
        }
        acks
    }

    /// Waits for the oldest load in flight and acknowledges it.
    pub(crate) fn wait_oldest_load<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
    ) -> Option<LoadAck> {
        let &id = self.loads.keys().next()?;
        let fin = self.finish_event(id);
        io.dev.synchronize(fin);
        self.ack(io, id)
    }

    /// The load's request was aborted: nobody waits for it any more. Returns the nodes it loads
    /// (the load keeps their lock until its acknowledgement).
    pub(crate) fn orphan(
        &mut self,
        id: LoadId,
        pools: &mut Pools,
        mutants: Mutants,
    ) -> Vec<NodeId> {
        let Some(load) = self.loads.get_mut(&id) else {
            return Vec::new();
        };
        load.orphaned = true;
        if mutants.abort_frees_load_pages() {
            // The bug of mutant 12: the load's pages go back before its finish event.
            pools.device_pages.free(&load.dev_pages);
        }
        load.nodes.clone()
    }

    /// Backs up the path ending at `last` (the part not yet backed up), after the compute
    /// stream's `after` event. Returns whether a backup was issued (it is not when the host tier
    /// cannot make room).
    pub(crate) fn issue_backup<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        last: NodeId,
        after: EventId,
    ) -> Result<bool, EngineError> {
        let nodes = io.cache.needs_backup(last);
        if nodes.is_empty() {
            let entry = (last, io.cache.generation(last));
            if io.cache.backup_deferred(last) && !self.deferred.contains(&entry) {
                probe::hit(Probe::BackupDeferred);
                // An ancestor's backup is in flight: retry once it is acknowledged.
                self.deferred.push(entry);
            }
            return Ok(false);
        }
        let Some(host_pages) = Self::host_pages_for(io, &nodes) else {
            probe::hit(Probe::BackupHostFull);
            return Ok(false);
        };
        assert_eq!(
            host_pages.len(),
            nodes.len(),
            "a backup has one host page per node"
        );
        io.cache.begin_backup(&nodes, &host_pages);
        let pairs: Vec<(PageId, PageId)> = nodes
            .iter()
            .map(|&id| io.cache.node(id).device.expect("resident"))
            .zip(host_pages.iter().copied())
            .collect();
        let event = match self.free_events.pop() {
            Some(ev) => ev,
            None => call_recovering(io.dev, |d| d.new_event())?,
        };
        // The pages were written by the compute stream: the copy starts after its last step.
        call_recovering(io.dev, |d| d.wait(StreamKind::Write, after))?;
        let enqueue_failed = Self::copy_all_layers(io, StreamKind::Write, true, &pairs, None)?;
        call_recovering(io.dev, |d| d.record(StreamKind::Write, event))?;
        io.metrics.backups += 1;
        probe::hit(Probe::BackupIssued);
        probe::hit_if(Probe::BackupEnqueueFailed, enqueue_failed);
        io.metrics.backup_bytes += io.layout.transfer_bytes(pairs.len() as u64).0;
        let b = Backup {
            nodes,
            event,
            issued_ns: io.clock.now_ns(),
        };
        if enqueue_failed {
            // Nothing usable was written: unwind at once (the event still orders the host; a
            // copy of it that failed in flight leaves the device to recover).
            if io.dev.synchronize(event) == EventState::Failed {
                self.recover(io);
            }
            self.finish_backup(io, b, Outcome::Failed);
        } else {
            self.backups.push(b);
        }
        Ok(true)
    }

    /// Host pages for a backup of `nodes`, evicting from the host tier when that makes room
    /// without dropping the path's own ancestors.
    fn host_pages_for<D: Device, C: Clock, T: Transfer>(
        io: &mut Io<'_, D, C, T>,
        nodes: &[NodeId],
    ) -> Option<Vec<PageId>> {
        let n = nodes.len();
        if let Some(p) = io.pools.host_pages.alloc(n) {
            return Some(p);
        }
        // (An injected refusal can come with enough pages free: nothing to evict then.)
        let want = n.saturating_sub(io.pools.host_pages.free_count() as usize);
        let keep = io.cache.node(nodes[0]).parent;
        if io.cache.host_evictable(keep) < want {
            // Evicting would drop host copies and still not make room: keep them.
            return None;
        }
        let free = io.pools.host_pages.free_count();
        let freed = io.cache.evict_host(want, keep);
        if probe::hit_if(Probe::HostEvicted, !freed.is_empty()) {
            probe::watermark(probe::Watermark::HostPagesFreeAtEviction, free as u64);
        }
        probe::watermark(probe::Watermark::HostPagesEvictedAtOnce, freed.len() as u64);
        io.pools.host_pages.free(&freed);
        io.pools.host_pages.alloc(n)
    }

    fn finish_backup<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        b: Backup,
        outcome: Outcome,
    ) {
        let ok = outcome == Outcome::Done;
        let (host_free, dev_free) = io.cache.finish_backup(&b.nodes, ok);
        io.pools.host_pages.free(&host_free);
        io.pools.device_pages.free(&dev_free);
        io.metrics
            .backup_latency
            .observe(io.clock.now_ns().saturating_sub(b.issued_ns));
        match outcome {
            Outcome::Done => {}
            Outcome::Failed => {
                io.metrics.backup_failures += 1;
                probe::hit(Probe::BackupFailed);
            }
            Outcome::Lost => io.metrics.backups_lost += 1,
        }
        self.free_events.push(b.event);
    }

    /// Retries backups that waited for an ancestor's backup (nodes that have gone are dropped).
    pub(crate) fn retry_deferred_backups<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        after: EventId,
    ) -> Result<(), EngineError> {
        let pending = std::mem::take(&mut self.deferred);
        for (node, generation) in pending {
            // The node may have gone, and its slot been reused for another one.
            if io.cache.is_live(node) && io.cache.generation(node) == generation {
                probe::hit(Probe::BackupRetried);
                self.issue_backup(io, node, after)?;
            }
        }
        Ok(())
    }

    /// Acknowledges finished backups; with `block`, waits for the oldest first.
    pub(crate) fn poll_backups<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        block: bool,
    ) {
        if block {
            if let Some(b) = self.backups.first() {
                let ev = b.event;
                io.dev.synchronize(ev);
            }
        }
        let mut i = 0;
        while i < self.backups.len() {
            let state = io.dev.query(self.backups[i].event);
            // A context recreated since the controller last failed what was in flight (by the
            // recovery just above, say): whatever this backup's event says, it may have read
            // memory that was lost. `fail_all` fails it at the next step's start.
            let recreated = io.dev.context_generation() != self.context_generation;
            if state == EventState::Pending || (state == EventState::Done && recreated) {
                i += 1;
                continue;
            }
            if state == EventState::Failed {
                self.recover(io);
            }
            let b = self.backups.remove(i);
            let outcome = if state == EventState::Done {
                Outcome::Done
            } else {
                Outcome::Failed
            };
            self.finish_backup(io, b, outcome);
        }
    }

    /// Whether a backup is in flight (a step with nothing to compute waits for it).
    pub(crate) fn has_backups(&self) -> bool {
        !self.backups.is_empty()
    }

    /// Admission's reservation for request `request`, whose cacheable prompt pages are `keys`
    /// and which needs `total` pages in all: the cached prefix is matched, locked and (its
    /// host-only part) loaded, the rest allocated, evicting as needed; under the selective
    /// write-through policy a prefix hit for the second time is backed up. `None` (nothing
    /// held) when the device tier cannot make room now. Loads acknowledged on the way (a ring
    /// slot reclaimed) go to `acks`, error or not.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reserve<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        request: u64,
        keys: &[PageKey],
        total: usize,
        after: EventId,
        acks: &mut Vec<LoadAck>,
    ) -> Result<Option<Grant>, EngineError> {
        let m = io.cache.match_prefix(keys);
        io.cache.lock(&m.nodes);
        io.cache.pin_host(&m.nodes[m.device..]);
        let Some(pages) = self.alloc_device(io, total - m.device, after)? else {
            io.cache.unpin(&m.nodes[m.device..]);
            io.cache.unlock_unused(&m.nodes);
            return Ok(None);
        };
        io.cache.touch(&m.nodes);
        probe::hit_if(Probe::AdmitDevicePrefix, m.device > 0);
        probe::hit_if(Probe::AdmitHostPrefix, m.host > 0);
        io.metrics.prefix_pages_queried += keys.len() as u64;
        let (device_hits, host_hits) = io.mutants.prefix_hits(m.device, m.host);
        io.metrics.prefix_pages_device_hit += device_hits;
        io.metrics.prefix_pages_host_hit += host_hits;
        let mut table: Vec<PageId> = m.nodes[..m.device]
            .iter()
            .map(|&n| io.cache.node(n).device.expect("resident"))
            .collect();
        table.extend_from_slice(&pages);
        let mut load = None;
        if m.host > 0 {
            let nodes = m.nodes[m.device..].to_vec();
            let (id, reclaimed) = self.issue_load(io, request, nodes, pages[..m.host].to_vec())?;
            acks.extend(reclaimed);
            load = Some(id);
        }
        if self.write_policy == WritePolicy::WriteThroughSelective && m.device > 0 {
            let last = io.cache.node(m.nodes[m.device - 1]);
            if last.hits >= io.mutants.selective_hits() && last.host.is_none() {
                probe::hit(Probe::BackupSelective);
                self.issue_backup(io, m.nodes[m.device - 1], after)?;
            }
        }
        Ok(Some(Grant {
            pages: table,
            locked: m.nodes,
            cached: m.device + m.host,
            load,
        }))
    }

    /// Device pages for a request, evicting from the device tier as needed (write-back evictions
    /// issue their backups after the compute stream's `after` event).
    pub(crate) fn alloc_device<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        n: usize,
        after: EventId,
    ) -> Result<Option<Vec<PageId>>, EngineError> {
        if let Some(p) = io.pools.device_pages.alloc(n) {
            return Ok(Some(p));
        }
        let deficit = n.saturating_sub(io.pools.device_pages.free_count() as usize);
        self.evict_device(io, deficit, after)?;
        Ok(io.pools.device_pages.alloc(n))
    }

    /// Evicts up to `pages` device pages (unlocked nodes only, the write policy respected).
    /// Returns how many were freed at once. A write-back eviction whose backup cannot be issued
    /// (the host tier cannot make room) falls back to dropping: a prefix cache may forget what
    /// it cannot keep, and a device tier held by nodes that can neither be backed up nor dropped
    /// would stop admission for good.
    pub(crate) fn evict_device<D: Device, C: Clock, T: Transfer>(
        &mut self,
        io: &mut Io<'_, D, C, T>,
        pages: usize,
        after: EventId,
    ) -> Result<usize, EngineError> {
        let ev = io.cache.evict_device(pages, self.write_policy);
        probe::hit_if(Probe::DeviceEvicted, !ev.freed.is_empty());
        probe::hit_if(Probe::DeviceWriteBackPending, !ev.write_back.is_empty());
        io.pools.device_pages.free(&ev.freed);
        let mut freed = ev.freed.len();
        let mut cancelled = false;
        for node in ev.write_back {
            if !self.issue_backup(io, node, after)? {
                probe::hit(Probe::DeviceWriteBackCancelled);
                io.cache.cancel_write_back(node);
                cancelled = true;
            }
        }
        if cancelled && freed < pages {
            // The write-through policy's eviction never writes back: it frees pages with a host
            // copy and drops leaves without one.
            let dropped = io
                .cache
                .evict_device(pages - freed, WritePolicy::WriteThrough);
            probe::hit_if(Probe::DeviceWriteBackDropped, !dropped.freed.is_empty());
            io.pools.device_pages.free(&dropped.freed);
            freed += dropped.freed.len();
        }
        Ok(freed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reports and findings name loads as `load<N>`.
    #[test]
    fn a_load_is_named_by_its_number() {
        assert_eq!(LoadId(42).to_string(), "load42");
    }

    /// A transfer's state is its worst event's: a failure over anything, then pending.
    #[test]
    fn the_worse_of_two_event_states() {
        use EventState::*;
        let all = [Done, Pending, Failed];
        let rank = |s: EventState| all.iter().position(|&x| x == s).expect("a state");
        for a in all {
            for b in all {
                let want = all[rank(a).max(rank(b))];
                assert_eq!(worse(a, b), want, "{a:?} and {b:?}");
            }
        }
    }

    /// A controller of two ring slots of three layers each, on the in-order CPU device, with
    /// nothing in flight.
    fn idle() -> CacheController {
        let mut dev = crate::cpu_device::InOrderDevice::new();
        CacheController::new(&mut dev, WritePolicy::WriteBack, 2, 3).expect("a controller")
    }

    /// A load of `nodes` nodes and `pages` device pages that says it holds `slot`.
    fn load(slot: usize, nodes: u32, pages: u32) -> Load {
        Load {
            request: 1,
            slot,
            nodes: (0..nodes).collect(),
            dev_pages: (0..pages).map(PageId).collect(),
            issued_ns: 0,
            enqueue_failed: false,
            orphaned: false,
            lease_expired: false,
        }
    }

    /// The ring's check holds for a load in its slot, and panics, naming what is wrong, for
    /// each way a ring and its loads can disagree (planted by hand, as a broken controller
    /// would leave them).
    #[test]
    fn the_ring_check_holds_for_a_load_in_its_slot() {
        let mut c = idle();
        c.loads.insert(LoadId(7), load(1, 2, 2));
        c.ring.holder[1] = Some(LoadId(7));
        c.check_invariants();
    }

    #[test]
    #[should_panic(expected = "ring slot 0 names load3, not in flight")]
    fn the_ring_check_catches_a_slot_that_names_no_load() {
        let mut c = idle();
        c.ring.holder[0] = Some(LoadId(3));
        c.check_invariants();
    }

    #[test]
    #[should_panic(expected = "load7 holds slot 0 but says 1")]
    fn the_ring_check_catches_a_load_in_another_slot_than_it_says() {
        let mut c = idle();
        c.loads.insert(LoadId(7), load(1, 2, 2));
        c.ring.holder[0] = Some(LoadId(7));
        c.check_invariants();
    }

    #[test]
    #[should_panic(expected = "load7 in flight without its ring slot 1")]
    fn the_ring_check_catches_a_load_without_its_slot() {
        let mut c = idle();
        c.loads.insert(LoadId(7), load(1, 2, 2));
        c.check_invariants();
    }

    #[test]
    #[should_panic(expected = "load7: nodes vs pages")]
    fn the_ring_check_catches_a_load_with_more_nodes_than_pages() {
        let mut c = idle();
        c.loads.insert(LoadId(7), load(1, 2, 1));
        c.ring.holder[1] = Some(LoadId(7));
        c.check_invariants();
    }

    /// A load's layer gates wait for its own slot's events, one per layer, in layer order.
    #[test]
    fn a_loads_layer_events_are_its_slots() {
        let mut c = idle();
        for (id, slot) in [(LoadId(4), 1), (LoadId(5), 0)] {
            c.loads.insert(id, load(slot, 1, 1));
            c.ring.holder[slot] = Some(id);
        }
        let got = c.layer_events(&[LoadId(4), LoadId(5)]);
        assert_eq!(
            got,
            vec![c.ring.events[1].clone(), c.ring.events[0].clone()]
        );
        assert_eq!(got[0].len(), 3);
        assert_ne!(got[0], got[1], "two slots, two sets of events");
    }

    /// `has_backups` answers whether a backup is in flight.
    #[test]
    fn has_backups_answers_whether_one_is_in_flight() {
        let mut c = idle();
        assert!(!c.has_backups());
        c.backups.push(Backup {
            nodes: vec![0],
            event: EventId(0),
            issued_ns: 0,
        });
        assert!(c.has_backups());
    }
}
