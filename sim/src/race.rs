//! The race detector: vector clocks for every stream and for the host, and per buffer cell (a page
//! of a paged buffer, 4 KiB of any other) the last writer and the readers since. An access that is
//! not ordered after a conflicting one is reported the moment it is enqueued. Happens-before comes
//! from stream order, event record/wait and the completions the host observed (`query`,
//! `synchronize`, completion callbacks). Those observations, and so the engine's later calls,
//! depend on the schedule, so a race can be reported under one schedule and not under another
//! (`tests/it/acceptance.rs` finds one only under schedules other than the scenario's own).

use std::collections::BTreeMap;
use tierkv_engine::device::{BufferId, ByteRange};

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
}

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
    /// Cell size per buffer.
    cell_bytes: BTreeMap<BufferId, u64>,
}

impl RaceDetector {
    pub fn register(&mut self, buf: BufferId, cell_bytes: u64) {
        self.cell_bytes.insert(buf, cell_bytes.max(1));
    }

    pub fn cell_bytes(&self, buf: BufferId) -> u64 {
        self.cell_bytes[&buf]
    }

    /// Checks and records one access made with clock `vc` by `who`. Returns the races found.
    pub fn access(&mut self, range: ByteRange, write: bool, vc: &Vc, who: &Accessor) -> Vec<Race> {
        let mut races = Vec::new();
        if range.is_empty() {
            return races;
        }
        let cb = self.cell_bytes[&range.buffer];
        let first = range.start.0 / cb;
        let last = (range.end.0 - 1) / cb;
        for c in first..=last {
            let cell = self.cells.entry((range.buffer, c)).or_default();
            let ordered = |a: &Accessor| a.entity == who.entity || a.epoch <= vc[a.entity];
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
        races
    }
}
