//! The simulated streams in virtual time: queues of ops, waits and records, op starts held by
//! the schedule, completions in time order, and what the host observes of them (queries inside a
//! jitter's window are schedule decisions, callbacks run when the schedule says).

use super::*;

impl SimGpu {
    /// Runs the stream's queue from time `t` as far as it can go without waiting for time.
    pub(super) fn advance_stream(&mut self, s: usize, t: u64) {
        loop {
            if self.streams[s].running.is_some() {
                return;
            }
            let t = t.max(self.streams[s].ready_at);
            let Some(head) = self.streams[s].queue.front() else {
                return;
            };
            match head {
                Entry::Record(rec) => {
                    let rec = *rec;
                    self.streams[s].queue.pop_front();
                    // A failure is the engine's to see at its next record: a record of the
                    // runtime's own (a staging copy's, a callback's) reports it too but neither
                    // clears it nor ends the skipping of the failed step's work.
                    let counted = self.records[&rec].counted;
                    let failed = self.streams[s].failed_since_record || self.streams[s].sticky;
                    if counted {
                        self.streams[s].failed_since_record = false;
                        self.streams[s].skipping = false;
                    }
                    let seen = self.seen_at(s, t);
                    let r = self.records.get_mut(&rec).expect("record exists");
                    assert_eq!(r.stream, s, "record {rec} completes on another stream");
                    assert!(r.done_at.is_none(), "record {rec} completed twice");
                    r.done_at = Some(t);
                    r.seen_at = Some(seen);
                    let last = self.streams[s].last_record.replace(rec);
                    assert!(last < Some(rec), "records of one stream complete in order");
                    r.failed = failed;
                    if r.counted {
                        self.record_log.failed[s].push(failed);
                    }
                    probes::hit_if(SimProbe::RecordFailed, failed);
                    self.mark(Mark::Record {
                        stream: s,
                        rec,
                        at: t,
                    });
                    self.streams[s].ready_at = t;
                    self.log(&[1, s as u64, rec, t]);
                    // A completed record may release waits on other streams.
                    for o in 0..STREAMS {
                        if o != s {
                            self.advance_stream(o, t);
                        }
                    }
                }
                Entry::Wait(target) => {
                    let target = *target;
                    let done = match target {
                        None => Some(t),
                        Some(rec) => self.records[&rec].done_at,
                    };
                    match done {
                        Some(at) => {
                            self.streams[s].queue.pop_front();
                            self.streams[s].ready_at = t.max(at);
                            if let Some(rec) = target {
                                self.mark(Mark::Wait {
                                    stream: s,
                                    rec,
                                    at: t.max(at),
                                });
                            }
                        }
                        None => {
                            probes::hit(SimProbe::WaitBlocked);
                            return;
                        }
                    }
                }
                Entry::Op(_) => {
                    let Some(Entry::Op(rec)) = self.streams[s].queue.pop_front() else {
                        unreachable!()
                    };
                    let start = self.start_at(s, t.max(rec.enq_ns));
                    let end = start + rec.duration;
                    probes::hit_if(
                        SimProbe::StreamsOverlap,
                        self.streams
                            .iter()
                            .any(|o| o.running.as_ref().is_some_and(|r| r.2 > start)),
                    );
                    self.seq += 1;
                    self.heap.push(Reverse((end, self.seq, s)));
                    self.log(&[2, s as u64, rec.id, start]);
                    self.streams[s].running = Some((rec, start, end));
                    return;
                }
            }
        }
    }

    /// Processes device completions up to time `until`.
    pub(super) fn pump(&mut self, until: u64) {
        while let Some(&Reverse((t, _, s))) = self.heap.peek() {
            if t > until {
                break;
            }
            self.heap.pop();
            self.complete(s, t);
        }
    }

    /// When the host callback of a record of stream `s` completed at `t` runs (if it has one): at
    /// once, or, for load-stream records, after a delay the schedule decides (a callback
    /// decision `d` in 0..=`DELAY_MAX`: `d / DELAY_MAX` of `completion_delay_ns`), never
    /// before the stream's previous callback. The decision is made for every load-stream
    /// record, whether or not a host callback follows it.
    pub(super) fn seen_at(&mut self, s: usize, t: u64) -> u64 {
        let max = self.opts.completion_delay_ns;
        if max == 0 || s % 3 != StreamKind::Load.index() {
            return t;
        }
        let d = self.sched.point(Kind::Callback, s) as u64;
        let at = (t + max * d / schedule::DELAY_MAX as u64).max(self.streams[s].last_seen);
        self.streams[s].last_seen = at;
        at
    }

    /// A query of record `rec` at `now` in the window before it (the record is the next entry
    /// of its stream, behind an op that started and would end within one jitter): the schedule
    /// decides whether that op ends now, so that the query answers Done.
    /// Returns whether it did.
    pub(super) fn query_early(&mut self, rec: u64, now: u64) -> bool {
        let r = self.records[&rec];
        if r.done_at.is_some() {
            return false;
        }
        let s = r.stream;
        let st = &self.streams[s];
        let Some((start, end, hung)) = st.running.as_ref().map(|(o, a, b)| (*a, *b, o.hung)) else {
            return false;
        };
        // A hung op ends when the watchdog gives up on it, a timer the device's speed does not
        // move.
        let next = matches!(st.queue.front(), Some(Entry::Record(x)) if *x == rec);
        if hung || !next || start > now || end <= now || end - now > self.opts.jitter_ns {
            return false;
        }
        if self.sched.point(Kind::QueryEarly, s) == 0 {
            return false;
        }
        probes::hit(SimProbe::QueryAnsweredEarly);
        // The op ends now: its queue entry goes, and it completes as if it had been drawn this
        // long. The heap holds one entry per running op (`advance_stream` pushes it).
        let before = self.heap.len();
        self.heap.retain(|Reverse((_, _, o))| *o != s);
        assert_eq!(
            self.heap.len() + 1,
            before,
            "stream {s}'s running op has one heap entry"
        );
        self.streams[s].running.as_mut().expect("checked above").2 = now;
        self.log(&[18, s as u64, rec, now]);
        self.complete(s, now);
        self.pump(now);
        assert_eq!(
            self.records[&rec].done_at,
            Some(now),
            "record {rec} is passed once the op before it ends"
        );
        true
    }

    /// A query of record `rec`, completed at `at`, at `now` in the window after it (within one
    /// jitter, and nothing the host has seen orders the host after it): whether the schedule
    /// has the host look before it is passed (answer Pending).
    pub(super) fn query_late(&mut self, rec: u64, at: u64, now: u64) -> bool {
        let r = self.records[&rec];
        let seen = (0..crate::race::ENTITIES).all(|e| r.vc[e] <= self.host_vc[e]);
        if seen || now - at >= self.opts.jitter_ns {
            return false;
        }
        self.sched.point(Kind::QueryLate, r.stream) != 0
    }

    /// The host observed record `rec` of another stream complete at `now`: a load-stream record
    /// that completed no later but whose callback has not run yet means completions reach the
    /// host out of order. (Only the latest records are looked at: a probe, not an oracle.)
    pub(super) fn observed(&mut self, rec: u64, now: u64) {
        const RECENT_RECORDS: usize = 64;
        let r = self.records[&rec];
        let load = r.stream - r.stream % 3 + StreamKind::Load.index();
        let Some(done) = r.done_at.filter(|_| r.stream != load) else {
            return;
        };
        let late = self.streams[load].last_seen > now
            && self.records.values().rev().take(RECENT_RECORDS).any(|o| {
                o.stream == load
                    && o.done_at.is_some_and(|d| d <= done)
                    && o.seen_at.is_some_and(|c| c > now)
            });
        probes::hit_if(SimProbe::FaultCompletionReordered, late);
    }

    /// Runs the device until record `rec` is complete (the host blocks meanwhile).
    pub(super) fn run_until_record(&mut self, rec: u64) -> u64 {
        loop {
            if let Some(at) = self.records[&rec].done_at {
                return at;
            }
            let Some(Reverse((t, _, s))) = self.heap.pop() else {
                panic!("deadlock: the host waits for record {rec}, which no stream will reach");
            };
            self.complete(s, t);
        }
    }

    /// The op running on stream `s` ends at `t` (the executor's queue entry for it): its reads
    /// and writes happen now.
    pub(super) fn complete(&mut self, s: usize, t: u64) {
        let (mut rec, start, end) = self.streams[s].running.take().expect("a running op");
        // Paired with the start in `advance_stream`: the queue holds the op's own end time, and
        // the stream finishes its ops in the order they were enqueued.
        assert_eq!(
            end, t,
            "op {} ends at {end}, its queue entry says {t}",
            rec.id
        );
        assert!(start <= end, "op {} ends before it starts", rec.id);
        let last = self.streams[s].last_op.replace(rec.id);
        assert!(
            last < Some(rec.id),
            "ops of one stream finish in enqueue order"
        );
        self.stats.ops += 1;
        self.log(&[3, s as u64, rec.id, end]);
        if rec.fail && rec.op.spec().class() == OpClass::Kernel && !self.streams[s].sticky {
            probes::hit(SimProbe::FaultKernelFailed);
            self.stats.failed_kernels += 1;
            self.streams[s].failed_since_record = true;
            self.streams[s].skipping = true;
        }
        // A failed launch, and the work after it that its stream skips until the next record;
        // or a stream in error, which skips everything until the engine recovers the device.
        let skipped = self.streams[s].skipping || self.streams[s].sticky;
        if skipped {
            self.log(&[13, s as u64, rec.id]);
            self.streams[s].failed_since_record = true;
            // Work after a skipped op reads what it should have written: the stream skips on
            // to its next record even when the engine recovers the device in between (it may,
            // when a call fails in the middle of a step).
            self.streams[s].skipping = true;
            // Tokens a skipped `next_tokens` should have written are stale.
            if let Op::NextTokens(o) = &rec.op {
                self.page_marks.set_stale_tokens(o.out.buffer, true);
            }
            // What a skipped copy should have written holds whatever was there: garbage; and
            // so does a skipped store's, for an engine running ahead (`ahead`).
            let pages_copied = rec.op.spec().class() == OpClass::PageCopy
                || matches!(&rec.op, Op::Copy(c) if self.mem.desc(c.dst.buffer).fingerprint.is_paged());
            if pages_copied || self.ahead {
                for (buf, page, rows) in self.full_rows(&rec.op) {
                    self.page_marks.taint(buf, page, rows);
                }
            }
        } else {
            if let Some(args) = rec.args.take() {
                self.patch(&mut rec.op, &args);
                rec.args = Some(args);
            }
            self.check_content(&rec, end);
            if rec.fail {
                self.fail_copy(s, &rec);
            } else {
                self.perform(&rec);
            }
        }
        if rec.fail && (rec.hung || self.opts.context_faults) {
            // The whole side is in error: its streams skip their work and every call fails.
            let side = s / 3;
            if self.contexts.in_error[side].is_none() {
                let stream = StreamKind::ALL[s % 3];
                let op = rec.op.name();
                self.contexts.in_error[side] = Some(if rec.hung {
                    DeviceFault::Hung {
                        op,
                        stream,
                        after_ns: WATCHDOG_NS,
                    }
                } else {
                    DeviceFault::Failed { op, stream }
                });
                probes::hit(SimProbe::FaultContextInError);
                self.log(&[17, s as u64, rec.id]);
            }
            for st in &mut self.streams[side * 3..side * 3 + 3] {
                st.sticky = true;
            }
        } else if rec.fail && self.opts.sticky_faults && !self.streams[s].sticky {
            probes::hit(SimProbe::FaultSticky);
            self.streams[s].sticky = true;
            self.log(&[14, s as u64, rec.id]);
        }
        if self.opts.trace {
            self.trace.slices.push(Slice {
                op_id: rec.id,
                stream: s,
                name: rec.op.name(),
                start_ns: start,
                end_ns: end,
                detail: op_detail(&rec.op, &self.mem),
                failed: rec.fail,
                skipped,
            });
        }
        self.streams[s].ready_at = end;
        self.advance_stream(s, end);
    }

    /// Queues op `op` on stream `s`: its id, its happens-before clock and the race check of its
    /// accesses, its duration and fate.
    /// Pushes `op` onto stream `s`; `key` numbers it for its keyed fault draws.
    pub(super) fn push_op(&mut self, s: usize, op: Op, key: u64, args: Option<Box<LaunchArgs>>) {
        let id = self.next_op;
        self.next_op += 1;
        // Happens-before: the op follows everything its stream and the host know of.
        let mut vc = self.streams[s].vc;
        join(&mut vc, &self.host_vc);
        vc[s] += 1;
        self.streams[s].vc = vc;
        let who_what = format!("{} {}", op.name(), op_detail(&op, &self.mem));
        let launch_reads = args.iter().flat_map(|a| &a.reads).map(|&range| Access {
            range,
            write: false,
        });
        let launch_writes = args
            .iter()
            .flat_map(|a| &a.writes)
            .map(|&range| Access { range, write: true });
        for a in launch_writes.chain(op.accesses()).chain(launch_reads) {
            let who = Accessor {
                entity: s,
                epoch: vc[s],
                id,
                what: who_what.clone(),
                op: Op::NAMES[op.kind()],
            };
            let races = self.race.access(a.range, a.write, &vc, &who);
            if !races.is_empty() {
                self.report_races(races);
            }
        }
        let (duration, fail, hung) = self.faults.duration(&op, s, key);
        self.log(&[9, s as u64, id, duration, fail as u64]);
        let now = self.host.get();
        self.streams[s].queue.push_back(Entry::Op(Box::new(OpRec {
            id,
            op,
            args,
            fail,
            hung,
            duration,
            enq_ns: now,
            key,
        })));
        self.pump(now);
        self.advance_stream(s, now);
    }

    /// Whether any stream still has work.
    pub fn busy(&self) -> bool {
        self.streams
            .iter()
            .any(|s| s.running.is_some() || !s.queue.is_empty())
    }

    /// Runs the device until every stream is idle (end of a run).
    pub fn drain(&mut self) {
        while let Some(Reverse((t, _, s))) = self.heap.pop() {
            self.complete(s, t);
        }
        // Nothing runs and nothing can start: a stream with work left waits for a record that
        // no stream will reach.
        for (i, st) in self.streams.iter().enumerate() {
            assert!(
                st.running.is_none(),
                "{} stream runs an op after the drain",
                entity_name(i)
            );
            assert!(
                st.queue.is_empty(),
                "deadlock: the {} stream waits forever ({} entries left)",
                entity_name(i),
                st.queue.len()
            );
        }
    }

    /// The host saw `ev`, recorded on stream `s`, fail: while the stream stays in error, later
    /// work on it is work the engine knows will not run.
    pub(super) fn failure_seen(&mut self, s: usize, ev: EventId) {
        let st = &mut self.streams[s];
        if st.sticky && st.failure_seen.is_none() {
            st.failure_seen = Some(ev);
        }
    }
}
