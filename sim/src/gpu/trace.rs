//! The trace: ops as slices, records, waits and host calls as marks, and the race detector's
//! reports, named for a reader.

use super::*;

/// One op as the trace shows it.
#[derive(Clone, Debug)]
pub struct Slice {
    pub op_id: u64,
    /// The stream's index (`stream_index`).
    pub stream: usize,
    pub name: &'static str,
    pub start_ns: u64,
    pub end_ns: u64,
    pub detail: String,
    pub failed: bool,
    /// It did not run: a failed launch's stream skipped it.
    pub skipped: bool,
}

/// What the trace shows besides ops: event records and the waits they release (joined by flow
/// arrows), and the host's device calls.
#[derive(Clone, Debug)]
pub enum Mark {
    /// Record `rec` completed on `stream` at `at`.
    Record { stream: usize, rec: u64, at: u64 },
    /// A wait on `stream` for record `rec` was released at `at`.
    Wait { stream: usize, rec: u64, at: u64 },
    /// The host's call `what`, blocking from `start` to `end`; `rec`: the record it waited for.
    Host {
        what: &'static str,
        start: u64,
        end: u64,
        rec: Option<u64>,
    },
}

/// The run's trace ([`SimGpu::trace`]): slices and marks kept with `GpuOptions::trace`, the
/// first race's ops always.
#[derive(Debug, Default)]
pub struct TraceLog {
    /// Each op that ran.
    pub slices: Vec<Slice>,
    /// Records, waits and host calls.
    pub marks: Vec<Mark>,
    /// Op ids involved in the first race (marked in the trace).
    pub racing_ops: Vec<u64>,
}

/// A stream's or the host's name in reports (side 1's streams are a pair's decode engine's).
pub fn entity_name(e: usize) -> &'static str {
    const NAMES: [&str; STREAMS] = [
        "compute",
        "load",
        "write",
        "decode compute",
        "decode load",
        "decode write",
    ];
    if e == HOST {
        "host"
    } else {
        NAMES[e]
    }
}

/// A short human description of an op for traces and reports.
pub fn op_detail(op: &Op, mem: &Memory) -> String {
    op.spec().detail(&|b| mem.desc(b).role)
}

impl SimGpu {
    /// Slices for the ops still queued or running when the run ended (with `GpuOptions::trace`):
    /// an op the host enqueued but did not wait for — a step enqueued ahead, the later op of a
    /// race found at enqueue — shows in the trace, at its enqueue time, marked as not run.
    pub fn unrun_slices(&self) -> Vec<Slice> {
        if !self.opts.trace {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (s, st) in self.streams.iter().enumerate() {
            let running = st.running.iter().map(|(rec, _, _)| rec.as_ref());
            let queued = st.queue.iter().filter_map(|e| match e {
                Entry::Op(rec) => Some(rec.as_ref()),
                _ => None,
            });
            for rec in running.chain(queued) {
                out.push(Slice {
                    op_id: rec.id,
                    stream: s,
                    name: rec.op.name(),
                    start_ns: rec.enq_ns,
                    end_ns: rec.enq_ns,
                    detail: format!(
                        "not run when the run ended; {}",
                        op_detail(&rec.op, &self.mem)
                    ),
                    failed: false,
                    skipped: true,
                });
            }
        }
        out
    }

    pub(super) fn mark(&mut self, m: Mark) {
        if self.opts.trace {
            self.trace.marks.push(m);
        }
    }

    pub(super) fn report_races(&mut self, races: Vec<Race>) {
        for r in races {
            if self.races.len() < 16 {
                if self.trace.racing_ops.is_empty() {
                    self.trace.racing_ops = vec![r.earlier.id, r.later.id];
                }
                let role = self.mem.desc(r.buffer).role;
                let cb = self.race.cell_bytes(r.buffer);
                let unit = match role {
                    BufferRole::Pool { .. } | BufferRole::Mirror { .. } => {
                        format!("page {}", r.cell)
                    }
                    BufferRole::Scratch { .. } | BufferRole::OffloadHost { .. } => {
                        format!("bytes {}..{}", r.cell * cb, (r.cell + 1) * cb)
                    }
                };
                let who = |write: bool, a: &Accessor| {
                    format!(
                        "{} {} by {} (on {})",
                        if write { "write" } else { "read" },
                        a.what,
                        if a.entity == HOST {
                            "host".to_string()
                        } else {
                            format!("op {}", a.id)
                        },
                        entity_name(a.entity)
                    )
                };
                let msg = format!(
                    "data race on {} {unit}: {} is not ordered after {}",
                    self.describe(r.buffer),
                    who(r.later_write, &r.later),
                    who(r.earlier_write, &r.earlier)
                );
                self.finding(OracleKind::Race, msg);
            }
            self.races.push(r);
        }
    }

    pub(super) fn describe(&self, b: BufferId) -> String {
        format!("{b} ({})", self.mem.desc(b).role)
    }
}
