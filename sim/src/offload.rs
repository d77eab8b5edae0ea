//! `tierkv sim --profile vllm`: the host tier of vLLM's offloading interface under the
//! simulator. A seeded server (the calls vLLM's offloading connector makes, modelled here: it
//! computes blocks, offers them for storing, looks blocks up, loads hits into device blocks it
//! freed, reads the blocks it holds every step) drives tierkv's scheduler side
//! (`tierkv_engine::offload::OffloadIndex`) and worker side (`offload::plan` and
//! `offload::transfer::Transfers`) on the simulated driver, with the simulator's schedules and
//! the driver's faults.
//!
//! Oracles: the race detector (every copy of a job against the server's kernels and reads on its
//! compute stream); contents (a stored chunk holds exactly the bytes the server wrote for its
//! key; a loaded block holds the key's bytes, checked when the job is reported done); the
//! index's invariants after every step; every job reported exactly once.
//!
//! Not modelled yet: the call sequence is drawn here, not recorded from a running vLLM; one
//! server, one worker; GPU faults other than the driver's refusals (a refused call fails its
//! job, which the server then recomputes or drops as vLLM does).

// The two caches are numbered (`c`) throughout, as the plan and the host tier number them.
#![allow(clippy::needless_range_loop)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use tierkv_engine::config::WritePolicy;
use tierkv_engine::device::{BufferDesc, BufferRole, DeviceError, MemoryTier, StreamKind};
use tierkv_engine::layout::{Bytes, IndexKDtype, KvDtype, LayoutFingerprint, PageFormat};
use tierkv_engine::offload::plan::{CacheTensor, Group, Job, LayerRef, Registration};
use tierkv_engine::offload::transfer::{TransferMutant, Transfers};
use tierkv_engine::offload::{Lookup, OffloadIndex};
use tierkv_engine::runtime::driver::{Driver, Mem, Ptr};

use crate::driver::SimDriver;
use crate::gpu::{GpuOptions, SimGpu, SimSide};
use crate::rng::Rng;
use crate::schedule::{Policy, Source};

pub mod replay;

/// The two caches' page formats (DeepSeek's fp8 MLA rows, fp8 index-K rows) and the bytes of
/// their pages (64 tokens).
const FORMATS: [PageFormat; 2] = [
    PageFormat::Kv(KvDtype::Fp8Packed),
    PageFormat::IndexK(IndexKDtype::Fp8),
];
const PAGES: [u64; 2] = [FORMATS[0].page_bytes(), FORMATS[1].page_bytes()];

/// The planted mistakes of this layer (`--mutant`).
pub const MUTANTS: [(&str, TransferMutant); 2] = [
    ("store-without-event", TransferMutant::StoreWithoutEvent),
    ("load-without-event", TransferMutant::LoadWithoutEvent),
];

/// What one seed drew.
#[derive(Clone, Debug)]
pub struct Shape {
    pub device_blocks: u64,
    pub chunks: u64,
    pub keys: u64,
    pub steps: u32,
    pub selective: bool,
    pub driver_fault_rate: f64,
}

impl Shape {
    pub fn draw(seed: u64) -> Shape {
        let mut r = Rng::new(seed ^ 0x0ff1_0ad5);
        Shape {
            device_blocks: r.range(6, 17),
            chunks: r.range(4, 13),
            keys: r.range(8, 40),
            steps: r.range(12, 40) as u32,
            selective: r.chance(0.3),
            driver_fault_rate: if r.chance(0.4) {
                0.002 + 0.02 * r.unit()
            } else {
                0.0
            },
        }
    }
}

/// What a seed did and found.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub findings: Vec<String>,
    pub stores: u64,
    pub loads: u64,
    pub failed_jobs: u64,
    pub refused_calls: u64,
    pub hits: u64,
    pub evictions: u64,
    /// A replay's recorded answers its own index did not give (`replay`): expected where the
    /// driver's faults failed jobs the recording completed.
    pub divergences: u64,
}

struct PendingJob {
    store: bool,
    keys: Vec<u64>,
    blocks: Vec<u64>,
}

/// The simulated server and tierkv's two sides.
struct Server {
    gpu: Rc<RefCell<SimGpu>>,
    tier: Transfers<SimDriver>,
    index: OffloadIndex,
    caches: [(Mem, u64); 2],
    scratch: [Mem; 2],
    probe: [Mem; 2],
    /// Device block → the key whose bytes it holds.
    held: BTreeMap<u64, u64>,
    free: Vec<u64>,
    jobs: BTreeMap<u64, PendingJob>,
    next_job: u64,
    out: Outcome,
}

fn key_bytes(key: u64) -> [u8; 8] {
    key.to_be_bytes()
}

/// Byte `i` of the page of cache `cache` that holds key `key`.
fn content(key: u64, cache: usize, i: usize) -> u8 {
    let x = key.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((cache as u64) << 56) ^ (i as u64 >> 3);
    (x ^ (x >> 29)).to_le_bytes()[i & 7]
}

fn page_of(key: u64, cache: usize) -> Vec<u8> {
    (0..PAGES[cache] as usize)
        .map(|i| content(key, cache, i))
        .collect()
}

/// An allocation of the server's: its pages are race-detector cells when `page` names their
/// format (its caches), the whole buffer one cell otherwise.
fn alloc(
    d: &mut SimDriver,
    name: &'static str,
    tier: MemoryTier,
    bytes: u64,
    page: Option<PageFormat>,
) -> Result<Mem, DeviceError> {
    let desc = BufferDesc {
        role: BufferRole::Scratch { name },
        tier,
        bytes: Bytes(bytes),
        fingerprint: page.map_or(LayoutFingerprint::unpaged(bytes), |f| f.fingerprint()),
    };
    d.alloc(&desc)
}

/// Retries a call of the server's own (not tierkv's) that the driver refused by a fault of its
/// own: a server's kernels are not what is under test. Counts the refusals.
fn retry<T>(out: &mut Outcome, mut f: impl FnMut() -> Result<T, DeviceError>) -> T {
    for _ in 0..1000 {
        match f() {
            Ok(t) => return t,
            Err(_) => out.refused_calls += 1,
        }
    }
    panic!("a server call refused 1000 times in a row: the fault rate is broken")
}

/// The server's two caches (`(allocation, address)` each) of `blocks` pages, registered with a
/// host tier of `chunks` chunks of one block: one KV group each.
fn registration(caches: [(Mem, u64); 2], blocks: u64, chunks: u64) -> Result<Registration, String> {
    let tensors = (0..2)
        .map(|c| CacheTensor {
            base: caches[c].1,
            blocks,
            page_bytes: PAGES[c],
            stride: PAGES[c],
        })
        .collect();
    let groups = (0..2)
        .map(|c| Group {
            tokens_per_block: 64,
            refs: vec![LayerRef {
                tensor: c,
                ref_bytes: PAGES[c],
            }],
        })
        .collect();
    Registration::new(tensors, groups, &FORMATS, 1, chunks).map_err(|e| e.to_string())
}

impl Server {
    fn new(seed: u64, shape: &Shape, mutant: Option<TransferMutant>) -> Result<Server, String> {
        let opts = GpuOptions {
            schedule: Source::Draw {
                index: 0,
                policy: Policy::RandomWalk,
            },
            driver_fault_rate: shape.driver_fault_rate,
            ..GpuOptions::default()
        };
        let gpu = Rc::new(RefCell::new(
            SimGpu::new(seed, opts).map_err(|e| e.to_string())?,
        ));
        let mut d = SimDriver::new(SimSide {
            gpu: gpu.clone(),
            side: 0,
        });
        let b = shape.device_blocks;
        let mut mem = |name, tier, bytes, page| {
            alloc(&mut d, name, tier, bytes, page).map_err(|e| e.to_string())
        };
        let kv = mem(
            "server kv cache",
            MemoryTier::Device,
            b * PAGES[0],
            Some(FORMATS[0]),
        )?;
        let ik = mem(
            "server index-k cache",
            MemoryTier::Device,
            b * PAGES[1],
            Some(FORMATS[1]),
        )?;
        let scratch = [
            mem("kv reads", MemoryTier::Device, PAGES[0], None)?,
            mem("index-k reads", MemoryTier::Device, PAGES[1], None)?,
        ];
        let probe = [
            mem("kv probe", MemoryTier::PinnedHost, PAGES[0], None)?,
            mem("index-k probe", MemoryTier::PinnedHost, PAGES[1], None)?,
        ];
        let caches = [(kv, d.address(kv)), (ik, d.address(ik))];
        let reg = registration(caches, b, shape.chunks)?;
        let mut tier = Transfers::new(d, reg).map_err(|e| e.to_string())?;
        tier.plant(mutant);
        gpu.borrow_mut().arm_driver_faults();
        let policy = if shape.selective {
            WritePolicy::WriteThroughSelective
        } else {
            WritePolicy::WriteThrough
        };
        let index = OffloadIndex::new(shape.chunks, policy, true).map_err(|e| e.to_string())?;
        Ok(Server {
            gpu,
            tier,
            index,
            caches,
            scratch,
            probe,
            held: BTreeMap::new(),
            free: (0..b).rev().collect(),
            jobs: BTreeMap::new(),
            next_job: 0,
            out: Outcome::default(),
        })
    }

    fn page(&self, cache: usize, block: u64) -> Ptr {
        Ptr {
            mem: self.caches[cache].0,
            offset: Bytes(block * PAGES[cache]),
            bytes: Bytes(PAGES[cache]),
        }
    }

    /// The server's kernel: writes key `key`'s bytes into device block `block` (from pageable
    /// memory: the driver takes the bytes before it returns, so the next kernel's bytes never
    /// race this one's).
    fn compute(&mut self, key: u64, block: u64) {
        for c in 0..2 {
            let dst = self.page(c, block);
            let bytes = page_of(key, c);
            let Server { tier, out, .. } = self;
            retry(out, || {
                tier.driver()
                    .copy_pageable(StreamKind::Compute, dst, &bytes)
            });
        }
        self.held.insert(block, key);
    }

    /// The server's step reads every block it holds (attention over its requests' KV).
    fn read_held(&mut self) {
        let blocks: Vec<u64> = self.held.keys().copied().collect();
        for block in blocks {
            for c in 0..2 {
                let (src, dst) = (
                    self.page(c, block),
                    Ptr::whole(self.scratch[c], Bytes(PAGES[c])),
                );
                let Server { tier, out, .. } = self;
                retry(out, || {
                    tier.driver().copy_async(StreamKind::Compute, dst, src)
                });
            }
        }
    }

    /// A device block for a new key: a free one, else one the server stops holding (no job in
    /// flight moving it, and none of `keep`: blocks computed this step and not yet offered);
    /// `None` when every block is busy.
    fn take_block(&mut self, r: &mut Rng, keep: &[u64]) -> Option<u64> {
        if let Some(b) = self.free.pop() {
            return Some(b);
        }
        let blocks: Vec<u64> = self
            .held
            .keys()
            .copied()
            .filter(|b| !self.busy(*b) && !keep.contains(b))
            .collect();
        if blocks.is_empty() {
            return None;
        }
        let b = *r.pick(&blocks);
        self.held.remove(&b);
        Some(b)
    }

    /// Whether a job still in flight moves block `b`.
    fn busy(&self, b: u64) -> bool {
        self.jobs.values().any(|j| j.blocks.contains(&b))
    }

    /// Queues a job of `keys` between device `blocks` and host `chunks`.
    fn submit(&mut self, store: bool, keys: Vec<u64>, blocks: Vec<u64>, chunks: &[u32]) {
        let mut ptrs = Vec::new();
        let mut sizes = Vec::new();
        for c in 0..2 {
            ptrs.extend(blocks.iter().map(|b| self.caches[c].1 + b * PAGES[c]));
            sizes.extend(blocks.iter().map(|_| PAGES[c]));
        }
        let n = blocks.len() as u64;
        let both: Vec<u64> = chunks.iter().chain(chunks).map(|&c| u64::from(c)).collect();
        let job = Job {
            ptrs: &ptrs,
            sizes: &sizes,
            group_blocks: &[n, n],
            group_refs: &[1, 1],
            block_indices: &[0, 0],
            chunks: &both,
        };
        let plan = match self.tier.registration().plan(&job) {
            Ok(p) => p,
            Err(e) => {
                self.out
                    .findings
                    .push(format!("a job the server built correctly was refused: {e}"));
                return;
            }
        };
        let id = self.next_job;
        self.next_job += 1;
        // A refused call fails the job: `finished` reports it.
        let _ = self.tier.submit(store, id, &plan, 0);
        self.jobs.insert(
            id,
            PendingJob {
                store,
                keys,
                blocks,
            },
        );
    }

    fn keys(keys: &[u64]) -> Vec<[u8; 8]> {
        keys.iter().map(|&k| key_bytes(k)).collect()
    }

    /// Ends the jobs the host tier reports done, checking what they moved.
    fn collect(&mut self) {
        for (id, ok, _, _) in self.tier.finished() {
            let Some(job) = self.jobs.remove(&id) else {
                self.out
                    .findings
                    .push(format!("job {id} reported done twice, or never submitted"));
                continue;
            };
            if !ok {
                self.out.failed_jobs += 1;
            }
            let names = Self::keys(&job.keys);
            let refs: Vec<&[u8]> = names.iter().map(|k| k.as_slice()).collect();
            if job.store {
                self.out.stores += 1;
                if ok {
                    self.check_stored(&job.keys);
                }
                if let Err(e) = self.index.complete_store(&refs, ok) {
                    self.out
                        .findings
                        .push(format!("complete_store refused: {e}"));
                }
            } else {
                self.out.loads += 1;
                for (&key, &block) in job.keys.iter().zip(&job.blocks) {
                    if ok {
                        self.check_loaded(key, block);
                        self.held.insert(block, key);
                    } else {
                        // vLLM recomputes the blocks of a failed load.
                        self.compute(key, block);
                    }
                }
                if let Err(e) = self.index.complete_load(&refs) {
                    self.out
                        .findings
                        .push(format!("complete_load refused: {e}"));
                }
            }
        }
    }

    /// Each stored key's chunk holds the key's bytes (read on the host once its job is done).
    fn check_stored(&mut self, keys: &[u64]) {
        for &key in keys {
            let Some(chunk) = self.index.chunk_of(&key_bytes(key)) else {
                continue;
            };
            for c in 0..2 {
                match self.tier.read_host(c, u64::from(chunk)) {
                    Ok(bytes) if bytes == page_of(key, c) => {}
                    Ok(_) => self.out.findings.push(format!("content: host chunk {chunk} of cache {c} does not hold key {key}'s bytes after its store")),
                    Err(e) => self.out.findings.push(format!("a host chunk could not be read: {e}")),
                }
            }
        }
    }

    /// A loaded block holds the key's bytes (copied out on the compute stream after the job).
    fn check_loaded(&mut self, key: u64, block: u64) {
        for c in 0..2 {
            let (src, dst) = (
                self.page(c, block),
                Ptr::whole(self.probe[c], Bytes(PAGES[c])),
            );
            let Server { tier, out, .. } = self;
            retry(out, || {
                tier.driver().copy_async(StreamKind::Compute, dst, src)
            });
            retry(out, || {
                tier.driver().stream_synchronize(StreamKind::Compute)
            });
            let mut bytes = vec![0u8; PAGES[c] as usize];
            retry(out, || {
                tier.driver().read_pinned(dst.mem, Bytes(0), &mut bytes)
            });
            if bytes != page_of(key, c) {
                self.out.findings.push(format!("content: device block {block} of cache {c} does not hold key {key}'s bytes after its load"));
            }
        }
    }

    /// One step of the server: read what it holds, compute new blocks and offer them for
    /// storing, look keys up and load the hits, then collect finished jobs.
    fn step(&mut self, r: &mut Rng, shape: &Shape) {
        self.read_held();
        self.offer_new(r, shape);
        self.load_hits(r, shape);
        if r.chance(0.3) {
            let ids: Vec<u64> = self.jobs.keys().copied().collect();
            self.tier.wait(&ids);
        }
        self.collect();
        self.index.check_invariants();
    }

    /// New blocks computed and offered for storing; what the index admits is stored.
    fn offer_new(&mut self, r: &mut Rng, shape: &Shape) {
        // New blocks computed and offered.
        let mut computed = Vec::new();
        for _ in 0..r.range(1, 4) {
            let key = r.below(shape.keys);
            if computed.iter().any(|&(k, _)| k == key) || self.held.values().any(|&k| k == key) {
                continue;
            }
            let keep: Vec<u64> = computed.iter().map(|c: &(u64, u64)| c.1).collect();
            let Some(block) = self.take_block(r, &keep) else {
                break;
            };
            self.compute(key, block);
            computed.push((key, block));
        }
        let names = Self::keys(&computed.iter().map(|c| c.0).collect::<Vec<_>>());
        let refs: Vec<&[u8]> = names.iter().map(|k| k.as_slice()).collect();
        match self.index.prepare_store(&refs) {
            Ok(Some(store)) if !store.keys.is_empty() => {
                self.out.evictions += store.evicted.len() as u64;
                let keys: Vec<u64> = store
                    .keys
                    .iter()
                    .map(|k| u64::from_be_bytes(k[..8].try_into().expect("8 bytes")))
                    .collect();
                let blocks = keys
                    .iter()
                    .map(|k| computed.iter().find(|c| c.0 == *k).expect("offered").1)
                    .collect();
                self.submit(true, keys, blocks, &store.chunks);
            }
            Ok(_) => {}
            Err(e) => self
                .out
                .findings
                .push(format!("prepare_store refused the server's offer: {e}")),
        }
    }

    /// Lookups; the hits loaded into blocks the server frees for them.
    fn load_hits(&mut self, r: &mut Rng, shape: &Shape) {
        // Lookups; hits loaded into blocks the server frees for them.
        let wanted: Vec<u64> = (0..r.range(0, 3)).map(|_| r.below(shape.keys)).collect();
        let mut hits = Vec::new();
        for key in wanted {
            if self.index.lookup(&key_bytes(key)) == Lookup::Hit
                && !hits.contains(&key)
                && !self.held.values().any(|&k| k == key)
            {
                hits.push(key);
            }
        }
        let mut blocks = Vec::new();
        for _ in &hits {
            match self.take_block(r, &[]) {
                Some(b) => blocks.push(b),
                None => break,
            }
        }
        // Blocks taken for hits that cannot all be loaded go back to the free list.
        if blocks.len() < hits.len() {
            self.free.append(&mut blocks);
            hits.clear();
        }
        if !hits.is_empty() {
            let names = Self::keys(&hits);
            let refs: Vec<&[u8]> = names.iter().map(|k| k.as_slice()).collect();
            match self.index.prepare_load(&refs) {
                Ok(chunks) => {
                    self.out.hits += hits.len() as u64;
                    self.submit(false, hits, blocks, &chunks);
                }
                Err(e) => self
                    .out
                    .findings
                    .push(format!("prepare_load refused a hit: {e}")),
            }
        }
    }
}

/// Runs one seed of the profile (`mutant`: a planted mistake, or none for the clean tier).
pub fn run(seed: u64, mutant: Option<TransferMutant>) -> Outcome {
    let shape = Shape::draw(seed);
    let mut server = match Server::new(seed, &shape, mutant) {
        Ok(s) => s,
        Err(e) => {
            return Outcome {
                findings: vec![format!("setup: {e}")],
                ..Outcome::default()
            }
        }
    };
    let mut r = Rng::new(seed).fork(0x0ff1);
    for _ in 0..shape.steps {
        server.step(&mut r, &shape);
    }
    let ids: Vec<u64> = server.jobs.keys().copied().collect();
    server.tier.wait(&ids);
    server.collect();
    if !server.jobs.is_empty() {
        let n = server.jobs.len();
        server.out.findings.push(format!(
            "{n} jobs never reported done after waiting for them"
        ));
    }
    let races = server.gpu.borrow().races.clone();
    if let Some(race) = races.first() {
        server
            .out
            .findings
            .push(format!("race: {} race(s), first {:?}", races.len(), race));
    }
    server.out
}
