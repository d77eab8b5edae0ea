//! The cache controller: backups (device → host on the write stream) and layer-wise loads
//! (host → device on the load stream), and their acknowledgements.
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

use crate::cache::NodeId;
use crate::device::{Device, EventId, EventState, StreamKind};
use crate::engine::{Engine, EngineError};
use crate::layout::{BufferKind, LayerId, PageId, PAGE_TOKENS};
use crate::mutants::Mutant;
use crate::scheduler::Output;
use crate::transfer::{Transfer, TransferError};

/// A load in flight.
#[derive(Clone, Debug)]
pub struct Load {
    pub request: u64,
    pub slot: usize,
    pub nodes: Vec<NodeId>,
    pub dev_pages: Vec<PageId>,
    pub issued_ns: u64,
    /// A copy could not even be enqueued: the load counts as failed.
    pub enqueue_failed: bool,
    /// Its request was aborted: the pages are freed (or published) at the ack, and nobody waits.
    pub orphaned: bool,
    /// Mutant 12 freed the pages already.
    pub pages_freed_early: bool,
    /// Mutant 6 published the pages already.
    pub published_early: bool,
}

/// A backup in flight.
#[derive(Clone, Debug)]
pub struct Backup {
    pub nodes: Vec<NodeId>,
    pub event: EventId,
    pub issued_ns: u64,
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

impl<D: Device, C: crate::device::Clock, T: Transfer> Engine<D, C, T> {
    pub(crate) fn load_finish_event(&self, id: u64) -> EventId {
        let slot = self.loads[&id].slot;
        *self.ring_events[slot].last().expect("at least one layer")
    }

    /// The event the compute stream waits on before touching local layer `layer` of load `id`.
    pub(crate) fn load_layer_event(&self, id: u64, layer: usize) -> EventId {
        self.ring_events[self.loads[&id].slot][layer]
    }

    /// Copies every layer of `pairs` (source page, destination page) between the tiers.
    fn copy_all_layers(
        &mut self,
        stream: StreamKind,
        to_host: bool,
        pairs: &[(PageId, PageId)],
        events: Option<&[EventId]>,
        skip_index_k: bool,
    ) -> Result<bool, EngineError> {
        let mut enqueue_failed = false;
        for l in 0..self.layout.layers() {
            let layer = LayerId(l);
            for kind in BufferKind::ALL {
                if kind == BufferKind::IndexK && skip_index_k {
                    continue;
                }
                let dev = self.pools.device_side(kind, layer);
                let host = self.pools.host_side(kind, layer);
                let (src, dst) = if to_host { (dev, host) } else { (host, dev) };
                match self
                    .transfer
                    .copy_pages(&mut self.dev, stream, src, dst, pairs)
                {
                    Ok(()) => {}
                    // A copy the backend could not take is a failed transfer, handled like one
                    // that failed in flight; a layout refusal is a bug and stops the engine.
                    Err(TransferError::Device(crate::device::DeviceError::Backend { .. })) => {
                        enqueue_failed = true
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if let Some(evs) = events {
                self.dev.record(stream, evs[l as usize]);
            }
        }
        Ok(enqueue_failed)
    }

    /// Issues the load of host-only `nodes` into `dev_pages` for request `request`.
    pub(crate) fn issue_load(
        &mut self,
        request: u64,
        nodes: Vec<NodeId>,
        dev_pages: Vec<PageId>,
    ) -> Result<u64, EngineError> {
        let slot = self.ring_next;
        self.ring_next = (slot + 1) % self.ring.len();
        if let Some(old) = self.ring[slot] {
            // The slot's events are about to be re-recorded: its previous load must be over.
            if !self.mutants.on(Mutant::LoadSlotReusedEarly) {
                let fin = self.load_finish_event(old);
                self.dev.synchronize(fin);
            }
            self.ack_load(old)?;
        }
        let host_pages: Vec<PageId> = nodes
            .iter()
            .map(|&n| self.cache.node(n).host.expect("loading a backed-up node"))
            .collect();
        self.cache.begin_load(&nodes, &dev_pages);
        let published_early = self.mutants.on(Mutant::PublishBeforeCopy);
        if published_early {
            self.cache.publish_early(&nodes);
        }
        let id = self.next_load;
        self.next_load += 1;
        let pairs: Vec<(PageId, PageId)> = host_pages
            .iter()
            .copied()
            .zip(dev_pages.iter().copied())
            .collect();
        let events = self.ring_events[slot].clone();
        let enqueue_failed =
            self.copy_all_layers(StreamKind::Load, false, &pairs, Some(&events), false)?;
        self.ring[slot] = Some(id);
        self.metrics.loads += 1;
        self.metrics.load_bytes += pairs.len() as u64
            * self.layout.layers() as u64
            * (self.layout.page_bytes(BufferKind::Kv).0
                + self.layout.page_bytes(BufferKind::IndexK).0);
        self.loads.insert(
            id,
            Load {
                request,
                slot,
                nodes,
                dev_pages,
                issued_ns: self.clock.now_ns(),
                enqueue_failed,
                orphaned: false,
                pages_freed_early: false,
                published_early,
            },
        );
        Ok(id)
    }

    /// Acknowledges load `id` once its events answer: publishes or unwinds. Returns whether it
    /// succeeded, or `None` when the load was unknown (already acknowledged).
    pub(crate) fn ack_load(&mut self, id: u64) -> Result<Option<bool>, EngineError> {
        let Some(load) = self.loads.remove(&id) else {
            return Ok(None);
        };
        if self.ring[load.slot] == Some(id) {
            self.ring[load.slot] = None;
        }
        let mut state = EventState::Done;
        for l in 0..self.layout.layers() as usize {
            let ev = self.ring_events[load.slot][l];
            state = worse(state, self.dev.query(ev));
        }
        // Pending only under mutant 11 (ack without waiting): it then takes the copy as done.
        let ok = state != EventState::Failed && !load.enqueue_failed;
        let unpublished = if load.published_early {
            self.cache.unpin(&load.nodes);
            Vec::new()
        } else {
            self.cache.finish_load(&load.nodes, ok)
        };
        self.metrics
            .load_latency
            .observe(self.clock.now_ns().saturating_sub(load.issued_ns));
        if !ok {
            self.metrics.load_failures += 1;
        }
        let live = !load.orphaned && self.requests.contains_key(&load.request);
        if !live {
            // The request is gone: drop its lock on the loaded nodes; free pages nobody holds.
            self.cache.unlock(&load.nodes);
            if !load.pages_freed_early {
                self.pools.device.pages.free(&unpublished);
            }
            return Ok(Some(ok));
        }
        let r = self.requests.get_mut(&load.request).expect("live request");
        r.load = None;
        if !ok {
            // Nothing was published: the pages stay with the request, which recomputes them.
            let device_hits = r.owned_from - load.nodes.len();
            r.locked.truncate(device_hits);
            r.owned_from = device_hits;
            r.computed = device_hits * PAGE_TOKENS as usize;
            let tokens = (load.nodes.len() * PAGE_TOKENS as usize) as u32;
            self.cache.unlock(&load.nodes);
            self.emit(Output::Recompute {
                request: load.request,
                tokens,
            });
        }
        Ok(Some(ok))
    }

    /// Acknowledges loads whose request is not running a forward right now and whose copy ended.
    pub(crate) fn poll_loads(&mut self) -> Result<(), EngineError> {
        let ids: Vec<u64> = self.loads.keys().copied().collect();
        for id in ids {
            let fin = self.load_finish_event(id);
            if self.dev.query(fin) != EventState::Pending {
                self.ack_load(id)?;
            }
        }
        Ok(())
    }

    /// Backs up the path ending at `last` (the part not yet backed up). Returns whether a backup
    /// was issued (it is not when the host tier cannot make room).
    pub(crate) fn issue_backup(&mut self, last: NodeId) -> Result<bool, EngineError> {
        let nodes = self.cache.needs_backup(last);
        if nodes.is_empty() {
            let entry = (last, self.cache.generation(last));
            if self.cache.backup_deferred(last) && !self.deferred_backups.contains(&entry) {
                // An ancestor's backup is in flight: retry once it is acknowledged.
                self.deferred_backups.push(entry);
            }
            return Ok(false);
        }
        let n = nodes.len();
        let host_pages = match self.pools.host.pages.alloc(n) {
            Some(p) => p,
            None => {
                let want = n - self.pools.host.pages.free_count() as usize;
                let keep = self.cache.node(nodes[0]).parent;
                if self.cache.host_evictable(keep) < want {
                    // Evicting would drop host copies and still not make room: keep them.
                    return Ok(false);
                }
                let freed = self.cache.evict_host(want, keep);
                self.pools.host.pages.free(&freed);
                match self.pools.host.pages.alloc(n) {
                    Some(p) => p,
                    None => return Ok(false),
                }
            }
        };
        self.cache.begin_backup(&nodes, &host_pages);
        let dev_pages: Vec<PageId> = nodes
            .iter()
            .map(|&id| self.cache.node(id).device.expect("resident"))
            .collect();
        let pairs: Vec<(PageId, PageId)> = dev_pages
            .into_iter()
            .zip(host_pages.iter().copied())
            .collect();
        let event = self.take_event();
        // The pages were written by the compute stream: the copy starts after its last step.
        self.dev.wait(StreamKind::Write, self.step_done);
        let skip_ik = self.mutants.on(Mutant::IndexKNotMirrored);
        let enqueue_failed =
            self.copy_all_layers(StreamKind::Write, true, &pairs, None, skip_ik)?;
        self.dev.record(StreamKind::Write, event);
        self.metrics.backups += 1;
        self.metrics.backup_bytes += pairs.len() as u64
            * self.layout.layers() as u64
            * (self.layout.page_bytes(BufferKind::Kv).0
                + self.layout.page_bytes(BufferKind::IndexK).0);
        let b = Backup {
            nodes,
            event,
            issued_ns: self.clock.now_ns(),
        };
        if enqueue_failed {
            // Nothing usable was written: unwind at once (the event still orders the host).
            self.dev.synchronize(event);
            self.finish_backup(b, false);
        } else {
            self.backups.push(b);
        }
        Ok(true)
    }

    fn finish_backup(&mut self, b: Backup, ok: bool) {
        let (host_free, dev_free) = self.cache.finish_backup(&b.nodes, ok);
        self.pools.host.pages.free(&host_free);
        self.pools.device.pages.free(&dev_free);
        self.metrics
            .backup_latency
            .observe(self.clock.now_ns().saturating_sub(b.issued_ns));
        if !ok {
            self.metrics.backup_failures += 1;
        }
        self.free_events.push(b.event);
    }

    /// Retries backups that waited for an ancestor's backup (nodes that have gone are dropped).
    pub(crate) fn retry_deferred_backups(&mut self) -> Result<(), EngineError> {
        let pending = std::mem::take(&mut self.deferred_backups);
        for (node, generation) in pending {
            // The node may have gone, and its slot been reused for another one.
            if self.cache.is_live(node) && self.cache.generation(node) == generation {
                self.issue_backup(node)?;
            }
        }
        Ok(())
    }

    /// Acknowledges finished backups; with `block`, waits for the oldest first.
    pub(crate) fn poll_backups(&mut self, block: bool) {
        if block {
            if let Some(b) = self.backups.first() {
                let ev = b.event;
                self.dev.synchronize(ev);
            }
        }
        let mut i = 0;
        while i < self.backups.len() {
            let state = self.dev.query(self.backups[i].event);
            if state == EventState::Pending {
                i += 1;
                continue;
            }
            let b = self.backups.remove(i);
            self.finish_backup(b, state == EventState::Done);
        }
    }
}
