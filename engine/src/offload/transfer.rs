//! The host tier's copies on a GPU, through the runtime's driver seam
//! ([`crate::runtime::driver::Driver`]): pinned host chunks for each cache a server registered,
//! and each job's checked [`Plan`] queued as asynchronous copies.
//!
//! Ordering, per job: an event is recorded on the server's stream (the one its kernels write
//! the caches on: PyTorch's current stream) and the copy stream waits for it before the job's
//! first copy. So a store reads a block only after the kernels queued before it wrote it (the
//! store racing the compute stream, vllm#45704), and a load writes a block only after the
//! kernels queued before it stopped reading it (vllm#47282). Stores run on the driver's write
//! stream and loads on its load stream, each in submission order; a job is finished when the
//! event recorded after its last copy has completed.
//!
//! Host memory is allocated in segments of at most [`SEGMENT_BYTES_MAX`] (whole chunks each),
//! so no single pinned registration approaches a driver's limit (vllm#51080: 512 GiB); a run
//! that crosses a segment boundary is split there.

use std::collections::VecDeque;

use super::plan::{Plan, Registration};
use crate::device::{BufferDesc, BufferRole, DeviceError, EventState, MemoryTier, StreamKind};
use crate::layout::{Bytes, LayoutFingerprint};
use crate::runtime::driver::{Driver, DrvEvent, EventUse, Mem, Ptr};

/// The largest pinned allocation the host tier makes (1 GiB), unless one chunk is larger.
pub const SEGMENT_BYTES_MAX: u64 = 1 << 30;

/// The first batch of a job's copies handed to the driver. Small, so that the GPU starts moving
/// bytes while the host still lists the rest; each later batch doubles, up to
/// [`BATCH_COPIES_MAX`]. (With the whole job listed first, no copy started before the host had
/// listed and checked every page: batches cut the GPU's time for a job of 100 scattered blocks
/// of DeepSeek-V3.2's caches from 7.1–8.3 ms to 6.0–6.2 ms, kernels/GPU.md run 99.)
pub const FIRST_BATCH_COPIES: usize = 256;

/// The largest batch of copies handed to the driver at once.
pub const BATCH_COPIES_MAX: usize = 16_384;

/// A job's result: `(job_id, success, bytes, seconds)`.
pub type Finished = (u64, bool, u64, f64);

/// A planted mistake of this layer, for the tests that show a check matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferMutant {
    /// Stores start without waiting for the server's stream (vllm#45704's bug).
    StoreWithoutEvent,
    /// Loads start without waiting for the server's stream: a load may overwrite a block
    /// the server's kernels still read (vllm#47282's bug).
    LoadWithoutEvent,
}

/// A job's events: where it may start on the server's stream, its start and its end.
#[derive(Clone, Copy)]
struct Marks {
    ready: DrvEvent,
    start: DrvEvent,
    end: DrvEvent,
}

struct Inflight {
    id: u64,
    /// `None`: the job failed before anything of it was queued (or after its copies were
    /// drained); it is reported when it reaches the front of its queue.
    marks: Option<Marks>,
    bytes: u64,
    /// A call failed while the job was queued: it is reported failed.
    failed: bool,
}

/// One cache's host chunks: `segments[i]` holds chunks `i * seg_chunks ..`.
struct HostCache {
    segments: Vec<(Mem, u64)>,
    seg_chunks: u64,
    chunk_bytes: u64,
}

/// The host tier's transfers over driver `D`.
pub struct Transfers<D: Driver> {
    driver: D,
    registration: Registration,
    caches: Vec<Mem>,
    host: Vec<HostCache>,
    queues: [VecDeque<Inflight>; 2],
    /// Events free for a job's ready and end marks, and for its start marks.
    events: Vec<DrvEvent>,
    timing_events: Vec<DrvEvent>,
    /// Why the tier refuses every job, once a failure left it unable to tell when a job's copies
    /// are done.
    broken: Option<String>,
    mutant: Option<TransferMutant>,
}

fn queue_of(store: bool) -> (usize, StreamKind) {
    if store {
        (0, StreamKind::Write)
    } else {
        (1, StreamKind::Load)
    }
}

impl<D: Driver> Transfers<D> {
    /// Imports the registered caches and allocates their host chunks (zeroed), in pinned
    /// segments of at most [`SEGMENT_BYTES_MAX`] (whole chunks; one chunk if it is larger).
    pub fn new(driver: D, registration: Registration) -> Result<Self, DeviceError> {
        Self::with_segments(driver, registration, SEGMENT_BYTES_MAX)
    }

    /// [`Transfers::new`] with segments of at most `segment_bytes` (tests use small ones, so that
    /// runs cross segment boundaries).
    pub fn with_segments(
        mut driver: D,
        registration: Registration,
        segment_bytes: u64,
    ) -> Result<Self, DeviceError> {
        driver.bind()?;
        let mut caches = Vec::new();
        let mut host = Vec::new();
        for (i, t) in registration.tensors().iter().enumerate() {
            let span = (t.blocks.saturating_sub(1)) * t.stride + t.page_bytes;
            caches.push(driver.import(t.base, span)?);
            let chunk_bytes = registration.chunk_bytes(i);
            let seg_chunks = (segment_bytes / chunk_bytes).max(1);
            let mut segments = Vec::new();
            let mut left = registration.chunks();
            while left > 0 {
                let n = left.min(seg_chunks);
                let bytes = n * chunk_bytes;
                let desc = BufferDesc {
                    role: BufferRole::OffloadHost {
                        cache: i as u32,
                        segment: segments.len() as u32,
                    },
                    tier: MemoryTier::PinnedHost,
                    bytes: Bytes(bytes),
                    fingerprint: LayoutFingerprint::unpaged(bytes),
                };
                segments.push((driver.alloc(&desc)?, bytes));
                left -= n;
            }
            host.push(HostCache {
                segments,
                seg_chunks,
                chunk_bytes,
            });
        }
        Ok(Transfers {
            driver,
            registration,
            caches,
            host,
            queues: [VecDeque::new(), VecDeque::new()],
            events: Vec::new(),
            timing_events: Vec::new(),
            broken: None,
            mutant: None,
        })
    }

    /// Plants `mutant` (tests only).
    pub fn plant(&mut self, mutant: Option<TransferMutant>) {
        self.mutant = mutant;
    }

    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    pub fn driver(&mut self) -> &mut D {
        &mut self.driver
    }

    /// An event from the pool of `purpose` (`Transfer`: ready and end marks; `Timing`: start
    /// marks), or a new one.
    fn event(&mut self, purpose: EventUse) -> Result<DrvEvent, DeviceError> {
        let pool = if purpose == EventUse::Timing {
            &mut self.timing_events
        } else {
            &mut self.events
        };
        match pool.pop() {
            Some(e) => Ok(e),
            None => self.driver.event_create(purpose),
        }
    }

    /// A job's ready, start and end events; on a refusal, those taken go back to their pools.
    fn events_of_a_job(&mut self) -> Result<(DrvEvent, DrvEvent, DrvEvent), DeviceError> {
        let ready = self.event(EventUse::Transfer)?;
        let start = match self.event(EventUse::Timing) {
            Ok(e) => e,
            Err(e) => {
                self.events.push(ready);
                return Err(e);
            }
        };
        match self.event(EventUse::Transfer) {
            Ok(end) => Ok((ready, start, end)),
            Err(e) => {
                self.events.push(ready);
                self.timing_events.push(start);
                Err(e)
            }
        }
    }

    /// Gives a job's events back to their pools.
    fn recycle(&mut self, m: Marks) {
        self.events.extend([m.ready, m.end]);
        self.timing_events.push(m.start);
    }

    /// Queues a job's copies after the work queued so far on the server's stream `stream`. An
    /// error of a driver call is returned, and the job is reported failed by
    /// [`Transfers::finished`] (once, whatever was queued of it).
    pub fn submit(
        &mut self,
        store: bool,
        id: u64,
        plan: &Plan,
        stream: u64,
    ) -> Result<(), DeviceError> {
        let (q, s) = queue_of(store);
        let failed = |id| Inflight {
            id,
            marks: None,
            bytes: 0,
            failed: true,
        };
        if let Some(why) = &self.broken {
            let e = DeviceError::Backend {
                detail: format!("the host tier stopped: {why}"),
            };
            self.queues[q].push_back(failed(id));
            return Err(e);
        }
        let (ready, start, end) = match self.events_of_a_job() {
            Ok(e) => e,
            Err(e) => {
                // Nothing was queued: the job is reported failed in its turn.
                self.queues[q].push_back(failed(id));
                return Err(e);
            }
        };
        let marks = Marks { ready, start, end };
        let mut job = Inflight {
            id,
            marks: Some(marks),
            bytes: plan.bytes,
            failed: false,
        };
        let queued = self.enqueue(store, s, plan, stream, marks);
        if queued.is_err() {
            // The end event still marks where the job's work stops, so the job is reported
            // only once the copies it queued are done (its chunks may be reused then). If even
            // that record fails, the stream is drained before the job is reported failed; if
            // that fails too, nothing tells when its copies end: the tier stops.
            if self.driver.event_record(s, end).is_err() {
                if let Err(e) = self.driver.stream_synchronize(s) {
                    self.broken =
                        Some(format!("the {} stream could not be drained: {e}", s.name()));
                }
                self.recycle(marks);
                self.queues[q].push_back(failed(id));
                return queued;
            }
            job.failed = true;
        }
        self.queues[q].push_back(job);
        queued
    }

    fn enqueue(
        &mut self,
        store: bool,
        s: StreamKind,
        plan: &Plan,
        stream: u64,
        job: Marks,
    ) -> Result<(), DeviceError> {
        let skip_wait = match self.mutant {
            Some(TransferMutant::StoreWithoutEvent) => store,
            Some(TransferMutant::LoadWithoutEvent) => !store,
            None => false,
        };
        if !skip_wait {
            self.driver.event_record_foreign(stream, job.ready)?;
            self.driver.stream_wait(s, job.ready)?;
        }
        self.driver.event_record(s, job.start)?;
        // Batches in list order on one stream: each batch's copies run after the previous ones'.
        let mut batch = FIRST_BATCH_COPIES;
        let mut copies = Vec::with_capacity(batch.min(plan.runs.len()));
        for run in &plan.runs {
            let cache = &self.host[run.tensor];
            let mut at = run.host;
            let mut device = run.device - self.registration.tensors()[run.tensor].base;
            let mut left = run.bytes;
            while left > 0 {
                let seg_bytes = cache.seg_chunks * cache.chunk_bytes;
                let (seg, off) = ((at / seg_bytes) as usize, at % seg_bytes);
                let (mem, len) = cache.segments[seg];
                let n = left.min(len - off);
                let h = Ptr {
                    mem,
                    offset: Bytes(off),
                    bytes: Bytes(n),
                };
                let d = Ptr {
                    mem: self.caches[run.tensor],
                    offset: Bytes(device),
                    bytes: Bytes(n),
                };
                copies.push(if store { (h, d) } else { (d, h) });
                if copies.len() == batch {
                    self.driver.copy_batch_async(s, &copies)?;
                    copies.clear();
                    batch = (2 * batch).min(BATCH_COPIES_MAX);
                }
                at += n;
                device += n;
                left -= n;
            }
        }
        if !copies.is_empty() {
            self.driver.copy_batch_async(s, &copies)?;
        }
        self.driver.event_record(s, job.end)
    }

    /// The jobs finished since the last call, each queue in submission order.
    pub fn finished(&mut self) -> Vec<Finished> {
        let mut out = Vec::new();
        for q in 0..2 {
            while let Some(job) = self.queues[q].front() {
                let Some(m) = job.marks else {
                    let job = self.queues[q].pop_front().expect("front exists");
                    out.push((job.id, false, 0, 0.0));
                    continue;
                };
                let state = self.driver.event_query(m.end);
                if state == EventState::Pending {
                    break;
                }
                let job = self.queues[q].pop_front().expect("front exists");
                let ok = state == EventState::Done && !job.failed;
                let secs = if ok {
                    self.driver
                        .event_elapsed_ns(m.start, m.end)
                        .map_or(0.0, |ns| ns as f64 * 1e-9)
                } else {
                    0.0
                };
                out.push((job.id, ok, if ok { job.bytes } else { 0 }, secs));
                self.recycle(m);
            }
        }
        out
    }

    /// Blocks until the named jobs (those still queued) are done.
    pub fn wait(&mut self, ids: &[u64]) {
        for q in &self.queues {
            for job in q.iter().filter(|j| ids.contains(&j.id)) {
                if let Some(m) = job.marks {
                    let _ = self.driver.event_synchronize(m.end);
                }
            }
        }
    }

    /// Host chunk `chunk` of cache `cache` (read on the host: wait for the jobs writing it
    /// first).
    pub fn read_host(&mut self, cache: usize, chunk: u64) -> Result<Vec<u8>, DeviceError> {
        let c = &self.host[cache];
        let (seg, off) = (
            (chunk / c.seg_chunks) as usize,
            (chunk % c.seg_chunks) * c.chunk_bytes,
        );
        let mut out = vec![0u8; c.chunk_bytes as usize];
        self.driver
            .read_pinned(c.segments[seg].0, Bytes(off), &mut out)?;
        Ok(out)
    }

    /// Pinned host bytes held in all.
    pub fn host_bytes(&self) -> u64 {
        self.host
            .iter()
            .flat_map(|c| c.segments.iter().map(|s| s.1))
            .sum()
    }
}
