//! The race detector: vector clocks for every stream and for the host, and per buffer cell (a page
//! of a paged buffer, 4 KiB of any other) the last writer and the readers since. An access that is
//! not ordered after a conflicting one is reported the moment it is enqueued. Happens-before comes
//! from stream order, event record/wait and the completions the host observed (`query`,
//! `synchronize`, completion callbacks). Those observations, and so the engine's later calls,
//! depend on the schedule, so a race can be reported under one schedule and not under another
//! (`tests/it/acceptance.rs` finds one only under schedules other than the scenario's own).
//!
//! An access ordered after a conflicting one (one of the two a write) is a happens-before pair,
//! counted once a run under its name (`targets`): which orders of which ops a campaign has seen.

use std::collections::BTreeMap;
use tierkv_engine::device::{BufferId, ByteRange};

use crate::fasthash::FastMap;
use crate::targets::{self, Side};

/// The streams of both sides of the simulated GPU (`gpu::STREAMS`: the first engine's three,
/// then a prefill/decode pair's decode engine's three), then the host.
pub const ENTITIES: usize = 7;
pub const HOST: usize = 6;

pub type Vc = [u64; ENTITIES];

pub fn join(a: &mut Vc, b: &Vc) {
    for i in 0..ENTITIES {
        a[i] = a[i].max(b[i]);
    }
}

/// Who made an access (kept for reports).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accessor {
    pub entity: usize,
    pub epoch: u64,
    /// The op id (for streams) or host action number.
    pub id: u64,
    pub what: String,
    /// The op's name (`Op::NAMES`), or the host's action (`targets::HOST_ACTIONS`).
    pub op: &'static str,
}

/// One side of a happens-before pair: the op (or host action), the entity, whether it wrote.
type Party = (&'static str, usize, bool);

#[derive(Clone, Debug, Default)]
struct Cell {
    write: Option<Accessor>,
    reads: Vec<Accessor>,
}

/// A detected race.
#[derive(Clone, Debug)]
pub struct Race {
    pub earlier: Accessor,
    pub earlier_write: bool,
    pub later: Accessor,
    pub later_write: bool,
    pub buffer: BufferId,
    pub cell: u64,
}

#[derive(Debug, Default)]
pub struct RaceDetector {
    cells: BTreeMap<(BufferId, u64), Cell>,
    /// Cell size and class (`targets::buffer_class`) per buffer.
    buffers: BTreeMap<BufferId, (u64, &'static str)>,
    /// The happens-before pairs this run has seen (`targets`): each one's probe is hit at its
    /// first sight.
    pairs: FastMap<(&'static str, Party, Party), ()>,
}

impl RaceDetector {
    pub fn register(&mut self, buf: BufferId, cell_bytes: u64, class: &'static str) {
        self.buffers.insert(buf, (cell_bytes.max(1), class));
    }

    pub fn cell_bytes(&self, buf: BufferId) -> u64 {
        self.buffers[&buf].0
    }

    /// Counts the pair `earlier` then `later` (each an op or host action, the entity that made
    /// it and whether it wrote) on a buffer of `class`, ordered and one a write, at its first
    /// sight in this run.
    fn pair(&mut self, class: &'static str, earlier: Party, later: Party) {
        if self.pairs.insert((class, earlier, later), ()).is_none() {
            let side = |(op, entity, write): Party| Side {
                op,
                stream: crate::gpu::entity_name(entity),
                write,
            };
            let name = targets::pair_name(class, &side(earlier), &side(later));
            tierkv_engine::probe::hit_named(targets::intern(&name));
        }
    }

    /// Checks and records one access made with clock `vc` by `who`. Returns the races found.
    pub fn access(&mut self, range: ByteRange, write: bool, vc: &Vc, who: &Accessor) -> Vec<Race> {
        let mut races = Vec::new();
        if range.is_empty() {
            return races;
        }
        let (cb, class) = self.buffers[&range.buffer];
        let first = range.start.0 / cb;
        let last = (range.end.0 - 1) / cb;
        let ordered = |a: &Accessor| a.entity == who.entity || a.epoch <= vc[a.entity];
        // The earlier sides of this access's pairs (one a cell: they repeat over the cells).
        let mut seen: Vec<Party> = Vec::new();
        for c in first..=last {
            let cell = self.cells.entry((range.buffer, c)).or_default();
            let earlier = cell.write.iter().map(|w| (w, true));
            let earlier = earlier.chain(cell.reads.iter().filter(|_| write).map(|r| (r, false)));
            for (a, aw) in earlier {
                if ordered(a) && !seen.contains(&(a.op, a.entity, aw)) {
                    seen.push((a.op, a.entity, aw));
                }
            }
            if let Some(w) = &cell.write {
                if !ordered(w) {
                    races.push(Race {
                        earlier: w.clone(),
                        earlier_write: true,
                        later: who.clone(),
                        later_write: write,
                        buffer: range.buffer,
                        cell: c,
                    });
                }
            }
            if write {
                for r in &cell.reads {
                    if !ordered(r) {
                        races.push(Race {
                            earlier: r.clone(),
                            earlier_write: false,
                            later: who.clone(),
                            later_write: true,
                            buffer: range.buffer,
                            cell: c,
                        });
                    }
                }
                cell.write = Some(who.clone());
                cell.reads.clear();
            } else {
                // Keep the latest read per entity (earlier ones of the same entity are ordered
                // before it).
                cell.reads.retain(|r| r.entity != who.entity);
                cell.reads.push(who.clone());
            }
        }
        for earlier in seen {
            self.pair(class, earlier, (who.op, who.entity, write));
        }
        races
    }
}

#[cfg(test)]
mod tests;
