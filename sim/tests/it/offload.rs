//! The host tier's transfers for a server (`tierkv_engine::offload::transfer`) on the simulated
//! driver, under the race detector: a server's kernel writes its cache pages on the compute
//! stream and a store of them is issued at once (vllm#45704's pattern). The store waits for an
//! event recorded on the server's stream, so the detector finds it ordered after the write and
//! the host chunks hold what the kernel wrote; planted without that event, the detector finds
//! the race in every seed. Loads write the pages back.

use std::cell::RefCell;
use std::rc::Rc;

use tierkv_engine::device::{BufferDesc, BufferRole, MemoryTier, StreamKind};
use tierkv_engine::layout::{Bytes, LayoutFingerprint};
use tierkv_engine::offload::plan::{parse_format, CacheTensor, Group, Job, LayerRef, Registration};
use tierkv_engine::offload::transfer::{TransferMutant, Transfers};
use tierkv_engine::runtime::driver::{Driver, Mem, Ptr};
use tierkv_sim::driver::SimDriver;
use tierkv_sim::gpu::{GpuOptions, SimGpu, SimSide};

const KV: u64 = 64 * 656;
const IK: u64 = 64 * 132;
const BLOCKS: u64 = 6;

fn buffer(driver: &mut SimDriver, name: &'static str, tier: MemoryTier, bytes: u64) -> Mem {
    let desc = BufferDesc {
        role: BufferRole::Scratch { name },
        tier,
        bytes: Bytes(bytes),
        fingerprint: LayoutFingerprint::unpaged(bytes),
    };
    driver.alloc(&desc).expect("an allocation")
}

struct Server {
    gpu: Rc<RefCell<SimGpu>>,
    tier: Transfers<SimDriver>,
    caches: [(Mem, u64); 2],
    staging: [Mem; 2],
}

/// A simulated server with a KV and an index-K cache of `BLOCKS` pages each, and the host tier
/// of `BLOCKS` chunks over them.
fn server(seed: u64, mutant: Option<TransferMutant>) -> Server {
    let gpu = Rc::new(RefCell::new(
        SimGpu::new(seed, GpuOptions::default()).expect("a simulated GPU"),
    ));
    let mut driver = SimDriver::new(SimSide {
        gpu: gpu.clone(),
        side: 0,
    });
    let kv = buffer(
        &mut driver,
        "server kv cache",
        MemoryTier::Device,
        BLOCKS * KV,
    );
    let ik = buffer(
        &mut driver,
        "server index-k cache",
        MemoryTier::Device,
        BLOCKS * IK,
    );
    let staging = [
        buffer(
            &mut driver,
            "server kv source",
            MemoryTier::PinnedHost,
            BLOCKS * KV,
        ),
        buffer(
            &mut driver,
            "server index-k source",
            MemoryTier::PinnedHost,
            BLOCKS * IK,
        ),
    ];
    let caches = [(kv, driver.address(kv)), (ik, driver.address(ik))];
    let tensors = vec![
        CacheTensor {
            base: caches[0].1,
            blocks: BLOCKS,
            page_bytes: KV,
            stride: KV,
        },
        CacheTensor {
            base: caches[1].1,
            blocks: BLOCKS,
            page_bytes: IK,
            stride: IK,
        },
    ];
    let groups = vec![
        Group {
            tokens_per_block: 64,
            refs: vec![LayerRef {
                tensor: 0,
                ref_bytes: KV,
            }],
        },
        Group {
            tokens_per_block: 64,
            refs: vec![LayerRef {
                tensor: 1,
                ref_bytes: IK,
            }],
        },
    ];
    let formats = [
        parse_format("kv/fp8_packed").unwrap(),
        parse_format("index_k/fp8").unwrap(),
    ];
    let registration = Registration::new(tensors, groups, &formats, 1, BLOCKS).expect("registered");
    let mut tier = Transfers::new(driver, registration).expect("a host tier");
    tier.plant(mutant);
    Server {
        gpu,
        tier,
        caches,
        staging,
    }
}

impl Server {
    /// The server's kernel: fills every page of both caches with `value`, on the compute stream.
    fn write_caches(&mut self, value: u8) {
        for (i, &(cache, _)) in self.caches.iter().enumerate() {
            let bytes = BLOCKS * if i == 0 { KV } else { IK };
            let d = self.tier.driver();
            d.write_pinned(self.staging[i], Bytes(0), &vec![value; bytes as usize])
                .expect("a host write");
            let whole = |m| Ptr::whole(m, Bytes(bytes));
            d.copy_async(StreamKind::Compute, whole(cache), whole(self.staging[i]))
                .expect("the kernel queued");
        }
    }

    /// A job of `blocks` (their pages of both caches) to or from chunks `chunks`.
    fn transfer(&mut self, store: bool, id: u64, blocks: &[u64], chunks: &[u64]) {
        let mut ptrs = Vec::new();
        let mut sizes = Vec::new();
        for (i, &(_, base)) in self.caches.iter().enumerate() {
            let page = if i == 0 { KV } else { IK };
            ptrs.extend(blocks.iter().map(|b| base + b * page));
            sizes.extend(blocks.iter().map(|_| page));
        }
        let n = blocks.len() as u64;
        let both: Vec<u64> = chunks.iter().chain(chunks).copied().collect();
        let job = Job {
            ptrs: &ptrs,
            sizes: &sizes,
            group_blocks: &[n, n],
            group_refs: &[1, 1],
            block_indices: &[0, 0],
            chunks: &both,
        };
        let plan = self.tier.registration().plan(&job).expect("a plan");
        self.tier.submit(store, id, &plan, 0).expect("queued");
        self.tier.wait(&[id]);
        let done = self.tier.finished();
        assert_eq!(done.len(), 1, "{done:?}");
        assert!(done[0].0 == id && done[0].1, "job {id}: {done:?}");
    }

    fn races(&self) -> usize {
        self.gpu.borrow().races.len()
    }
}

#[test]
fn a_store_issued_right_after_a_kernel_is_ordered_after_it_and_stores_what_it_wrote() {
    for seed in 0..8 {
        let mut s = server(seed, None);
        for round in 0..4u8 {
            let value = 10 * round + seed as u8;
            s.write_caches(value);
            s.transfer(true, u64::from(round), &[1, 4], &[round as u64, 5]);
            for cache in 0..2 {
                let chunk = s
                    .tier
                    .read_host(cache, u64::from(round))
                    .expect("a host chunk");
                assert!(
                    chunk.iter().all(|&b| b == value),
                    "seed {seed} round {round} cache {cache}"
                );
            }
        }
        assert_eq!(
            s.races(),
            0,
            "seed {seed}: {:?}",
            s.gpu.borrow().races.first()
        );
        // Loads bring the chunks back into other pages.
        s.write_caches(0);
        s.transfer(false, 9, &[0, 2], &[3, 5]);
        let mut page = vec![0u8; KV as usize];
        let d = s.tier.driver();
        let probe = buffer(d, "probe", MemoryTier::PinnedHost, KV);
        d.copy_async(
            StreamKind::Compute,
            Ptr::whole(probe, Bytes(KV)),
            Ptr {
                mem: s.caches[0].0,
                offset: Bytes(0),
                bytes: Bytes(KV),
            },
        )
        .unwrap();
        d.stream_synchronize(StreamKind::Compute).unwrap();
        d.read_pinned(probe, Bytes(0), &mut page).unwrap();
        assert!(
            page.iter().all(|&b| b == 30 + seed as u8),
            "seed {seed}: block 0 holds chunk 3's bytes"
        );
        assert_eq!(
            s.races(),
            0,
            "seed {seed}: {:?}",
            s.gpu.borrow().races.first()
        );
    }
}

#[test]
fn without_the_event_the_race_detector_finds_the_store_racing_the_kernel() {
    for seed in 0..8 {
        let mut s = server(seed, Some(TransferMutant::StoreWithoutEvent));
        s.write_caches(7);
        s.transfer(true, 0, &[1], &[0]);
        assert!(
            s.races() > 0,
            "seed {seed}: the unordered store went unseen"
        );
    }
}

/// `tierkv sim --profile vllm`'s seeds: the clean host tier has no finding, with and without the
/// driver's faults, and moves blocks both ways; each planted mistake of the layer is caught.
#[test]
fn the_vllm_profile_is_clean_and_catches_each_mutant() {
    use tierkv_sim::offload::{run, MUTANTS};
    let (mut stores, mut loads, mut failed, mut hits) = (0, 0, 0, 0);
    for seed in 0..40 {
        let out = run(seed, None);
        assert!(out.findings.is_empty(), "seed {seed}: {:?}", out.findings);
        stores += out.stores;
        loads += out.loads;
        failed += out.failed_jobs;
        hits += out.hits;
    }
    assert!(
        stores > 100 && loads > 20 && hits > 20,
        "stores {stores}, loads {loads}, hits {hits}"
    );
    assert!(failed > 0, "no job failed by a driver fault in 40 seeds");
    for (name, mutant) in MUTANTS {
        let caught = (0..100).find(|&seed| !run(seed, Some(mutant)).findings.is_empty());
        assert!(caught.is_some(), "mutant {name} not caught in seeds 0..100");
    }
}

/// A simulated GPU with one server cache of `blocks` pages of `page` bytes, filled on the
/// compute stream with a pattern (`bytes`) from a pinned source, and a pinned probe to read it
/// back; its registration is one tensor in one group, one layer reference a page.
struct OneCache {
    gpu: Rc<RefCell<SimGpu>>,
    cache: Mem,
    source: Mem,
    probe: Mem,
    base: u64,
    bytes: Vec<u8>,
    page: u64,
    blocks: u64,
}

fn one_cache(seed: u64, name: &'static str, page: u64, blocks: u64) -> (OneCache, SimDriver) {
    let gpu = Rc::new(RefCell::new(
        SimGpu::new(seed, GpuOptions::default()).expect("a simulated GPU"),
    ));
    let mut driver = SimDriver::new(SimSide {
        gpu: gpu.clone(),
        side: 0,
    });
    let cache = buffer(&mut driver, name, MemoryTier::Device, blocks * page);
    let source = buffer(&mut driver, "source", MemoryTier::PinnedHost, blocks * page);
    let probe = buffer(&mut driver, "probe", MemoryTier::PinnedHost, blocks * page);
    let bytes: Vec<u8> = (0..blocks * page).map(|i| (i / 997 % 251) as u8).collect();
    let base = driver.address(cache);
    let c = OneCache {
        gpu,
        cache,
        source,
        probe,
        base,
        bytes,
        page,
        blocks,
    };
    c.fill(&mut driver, &c.bytes);
    (c, driver)
}

impl OneCache {
    fn whole(&self, m: Mem) -> Ptr {
        Ptr::whole(m, Bytes(self.blocks * self.page))
    }

    /// The server's kernel: writes `data` over the whole cache, on the compute stream.
    fn fill(&self, d: &mut SimDriver, data: &[u8]) {
        d.write_pinned(self.source, Bytes(0), data).unwrap();
        d.copy_async(
            StreamKind::Compute,
            self.whole(self.cache),
            self.whole(self.source),
        )
        .unwrap();
    }

    /// The cache's bytes, once the compute stream is done.
    fn read(&self, d: &mut SimDriver) -> Vec<u8> {
        d.copy_async(
            StreamKind::Compute,
            self.whole(self.probe),
            self.whole(self.cache),
        )
        .unwrap();
        d.stream_synchronize(StreamKind::Compute).unwrap();
        let mut got = vec![0u8; self.bytes.len()];
        d.read_pinned(self.probe, Bytes(0), &mut got).unwrap();
        got
    }

    /// The cache's registration in format `format`: `blocks_per_chunk` blocks a chunk, `chunks`
    /// chunks.
    fn registration(&self, format: &str, blocks_per_chunk: u64, chunks: u64) -> Registration {
        let tensors = vec![CacheTensor {
            base: self.base,
            blocks: self.blocks,
            page_bytes: self.page,
            stride: self.page,
        }];
        let groups = vec![Group {
            tokens_per_block: 64,
            refs: vec![LayerRef {
                tensor: 0,
                ref_bytes: self.page,
            }],
        }];
        let formats = [parse_format(format).unwrap()];
        Registration::new(tensors, groups, &formats, blocks_per_chunk, chunks).expect("registered")
    }

    fn races(&self) -> usize {
        self.gpu.borrow().races.len()
    }
}

/// Chunks of two blocks, jobs that start inside a chunk, and host segments of three chunks, so
/// that runs cross segment boundaries: every block comes back from the host tier as it went.
#[test]
fn runs_split_at_segment_boundaries_and_chunks_hold_two_blocks() {
    let (kv, driver) = one_cache(3, "server kv cache", KV, 12);
    let reg = kv.registration("kv/fp8_packed", 2, 8);
    // Segments of three two-block chunks.
    let mut tier = Transfers::with_segments(driver, reg, 3 * 2 * KV).expect("a host tier");
    assert_eq!(tier.host_bytes(), 8 * 2 * KV);
    // Blocks 0..9, the request's first block at its chunk's second slot: chunks 1..6, whose
    // slots 3..13 cross the segment boundary after chunk 2.
    let ptrs: Vec<u64> = (0..9).map(|b| kv.base + b * KV).collect();
    let sizes = vec![KV; 9];
    let chunks = [1u64, 2, 3, 4, 5];
    let job = Job {
        ptrs: &ptrs,
        sizes: &sizes,
        group_blocks: &[9],
        group_refs: &[1],
        block_indices: &[1],
        chunks: &chunks,
    };
    let plan = tier.registration().plan(&job).expect("a plan");
    // One coalesced run, host bytes 3..12 pages: the transfers split it at the segment
    // boundaries (6 and 12 pages).
    assert_eq!(plan.runs.len(), 1, "{:?}", plan.runs);
    assert_eq!((plan.runs[0].host, plan.runs[0].bytes), (3 * KV, 9 * KV));
    tier.submit(true, 1, &plan, 0).unwrap();
    tier.wait(&[1]);
    assert!(tier.finished()[0].1);
    // Wipe the cache, load the same blocks back into 3..12.
    kv.fill(tier.driver(), &vec![0; kv.bytes.len()]);
    let back: Vec<u64> = (3..12).map(|b| kv.base + b * KV).collect();
    let job = Job { ptrs: &back, ..job };
    let plan = tier.registration().plan(&job).expect("a plan");
    tier.submit(false, 2, &plan, 0).unwrap();
    tier.wait(&[2]);
    assert!(tier.finished()[0].1);
    let got = kv.read(tier.driver());
    let kv_bytes = KV as usize;
    assert_eq!(&got[3 * kv_bytes..12 * kv_bytes], &kv.bytes[..9 * kv_bytes]);
    assert!(got[..3 * kv_bytes].iter().all(|&b| b == 0));
    assert_eq!(kv.races(), 0, "{:?}", kv.gpu.borrow().races.first());
}

/// The recording `python/tests/test_vllm.py` makes of a small server on vLLM 0.34's own classes.
fn recorded_calls() -> tierkv_sim::offload::replay::Calls {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vllm-0.34-calls.jsonl");
    tierkv_sim::offload::replay::parse(&path).expect("the recorded fixture parses")
}

#[test]
fn the_recorded_vllm_calls_replay_clean_and_each_planted_race_is_caught() {
    let calls = recorded_calls();
    assert!(
        calls.calls.len() > 200 && calls.keys > 20,
        "{} calls",
        calls.calls.len()
    );
    let (mut stores, mut loads) = (0, 0);
    for seed in 0..40 {
        let out = tierkv_sim::offload::replay::run(seed, &calls, None);
        assert!(out.findings.is_empty(), "seed {seed}: {:?}", out.findings);
        stores += out.stores;
        loads += out.loads;
    }
    assert!(
        stores > 1000 && loads > 100,
        "{stores} stores, {loads} loads"
    );
    for (name, mutant) in tierkv_sim::offload::MUTANTS {
        let first = (0..100).find(|&s| {
            !tierkv_sim::offload::replay::run(s, &calls, Some(mutant))
                .findings
                .is_empty()
        });
        assert!(
            first.is_some(),
            "{name}: not caught in 100 seeds of the recording"
        );
    }
}

#[test]
fn a_recorded_answer_the_replay_does_not_give_is_a_finding_before_any_fault() {
    // The recording's first lookup answered "miss"; claim it answered "hit".
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vllm-0.34-calls.jsonl");
    let text = std::fs::read_to_string(&path).expect("the fixture");
    let tampered = text.replacen("\"found\":\"miss\"", "\"found\":\"hit\"", 1);
    assert_ne!(tampered, text);
    let dir = std::env::temp_dir().join(format!("tierkv-tampered-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let file = dir.join("calls.jsonl");
    std::fs::write(&file, tampered).expect("written");
    let calls = tierkv_sim::offload::replay::parse(&file).expect("it parses");
    let out = tierkv_sim::offload::replay::run(0, &calls, None);
    assert!(
        out.findings
            .iter()
            .any(|f| f.contains("lookup of key 0 answered Miss, recorded Some(Hit)")),
        "{:?}",
        out.findings
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_bad_call_file_is_refused_naming_the_line() {
    let dir = std::env::temp_dir().join(format!("tierkv-calls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let register = r#"{"call":"register","blocks":4,"chunks":4,"blocks_per_chunk":1,"formats":["kv/fp8_packed","index_k/fp8"],"write_policy":"write_through"}"#;
    let store =
        r#"{"call":"prepare_store","keys":["aa","ab"],"stored":["aa","ab"],"chunks":[0,1]}"#;
    let job = |j: u32, b: u32| {
        format!(
            r#"{{"call":"submit_store","job":{j},"groups":[{{"blocks":[{b}],"chunks":[0]}},{{"blocks":[{b}],"chunks":[1]}}]}}"#
        )
    };
    for (text, want) in [
        (String::new(), "no registration line"),
        (
            r#"{"call":"lookup","key":"aa"}"#.to_string(),
            "no registration line",
        ),
        (
            format!("{store}\n{}", job(1, 0)),
            "line 2: a job before the registration line",
        ),
        (
            format!("{register}\n{store}\n{}", job(1, 4)),
            "line 3: group 0: block 4 is not one of the 4 registered",
        ),
        (
            format!("{register}\n{store}\n{}\n{}", job(1, 0), job(2, 0)),
            "line 4: job 2 names block 0 of group 0, which job 1 still moves",
        ),
        (
            format!("{register}\n{}", job(1, 0)),
            "line 2: group 0: host chunk 0 was given to no key",
        ),
        (
            format!("{register}\n{{\"call\":\"complete_load\",\"keys\":[\"aa\"]}}"),
            "line 2: complete_load of key 0, which no earlier prepare left pending",
        ),
        (
            format!("{register}\n{{\"call\":\"lookup\",\"key\":\"xyz\"}}"),
            "not the hex of",
        ),
        (
            format!("{register}\n{{\"call\":\"fly\"}}"),
            "line 2: unknown call `fly`",
        ),
        (format!("{register}\nnot json"), "line 2: expected"),
        (
            format!("{register}\n{register}"),
            "line 2: a second registration",
        ),
        (
            register.replace("\"blocks\":4", "\"blocks\":65536"),
            "`blocks` must be an integer in 1..=1024",
        ),
        (
            register.replace("\"blocks_per_chunk\":1", "\"blocks_per_chunk\":2"),
            "`blocks_per_chunk` must be",
        ),
        (register.replace("index_k/fp8", "index_k/bf16"), "`formats`"),
        (register.replace("\"write_through\"", "7"), "`write_policy`"),
    ] {
        let path = dir.join("calls.jsonl");
        std::fs::write(&path, &text).expect("written");
        let err = tierkv_sim::offload::replay::parse(&path)
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "{err:?} does not say {want:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A job of 1,000 scattered pages, more than its first batches hold (256, then 512: the last
/// batch is partial): every page of it is stored and loaded back, and nothing else is written.
/// (The simulated driver runs a batch's copies one by one, so the batch sizes themselves are
/// not seen here; a copy dropped or repeated at a batch's edge is.)
#[test]
fn a_job_of_many_scattered_pages_is_moved_whole() {
    use tierkv_engine::offload::transfer::FIRST_BATCH_COPIES;
    let moved = 1_000u64;
    // More copies than the first two batches, fewer than the first three.
    assert!(moved > 3 * FIRST_BATCH_COPIES as u64 && moved < 7 * FIRST_BATCH_COPIES as u64);
    let (ik, driver) = one_cache(5, "server index-k cache", IK, 2 * moved);
    let reg = ik.registration("index_k/fp8", 1, moved);
    let mut tier = Transfers::new(driver, reg).expect("a host tier");
    // The even blocks into chunks in reverse order: no two pages coalesce into one run.
    let ptrs: Vec<u64> = (0..moved).map(|b| ik.base + 2 * b * IK).collect();
    let sizes = vec![IK; moved as usize];
    let chunks: Vec<u64> = (0..moved).rev().collect();
    let job = Job {
        ptrs: &ptrs,
        sizes: &sizes,
        group_blocks: &[moved],
        group_refs: &[1],
        block_indices: &[0],
        chunks: &chunks,
    };
    let plan = tier.registration().plan(&job).expect("a plan");
    assert_eq!(plan.runs.len(), moved as usize);
    tier.submit(true, 1, &plan, 0).unwrap();
    tier.wait(&[1]);
    assert!(tier.finished()[0].1);
    // Wipe the cache and load the chunks into the odd blocks.
    ik.fill(tier.driver(), &vec![0; ik.bytes.len()]);
    let back: Vec<u64> = (0..moved).map(|b| ik.base + (2 * b + 1) * IK).collect();
    let job = Job { ptrs: &back, ..job };
    let plan = tier.registration().plan(&job).expect("a plan");
    tier.submit(false, 2, &plan, 0).unwrap();
    tier.wait(&[2]);
    assert!(tier.finished()[0].1);
    let got = ik.read(tier.driver());
    let page = IK as usize;
    for b in 0..moved as usize {
        let (even, odd) = (2 * b * page, (2 * b + 1) * page);
        assert!(
            got[even..even + page].iter().all(|&x| x == 0),
            "block {} was written",
            2 * b
        );
        assert_eq!(
            &got[odd..odd + page],
            &ik.bytes[even..even + page],
            "block {} does not hold block {}",
            2 * b + 1,
            2 * b
        );
    }
    assert_eq!(ik.races(), 0, "{:?}", ik.gpu.borrow().races.first());
}
