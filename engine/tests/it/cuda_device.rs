//! The production CUDA device (feature `cuda`, on a GPU machine): both page-transfer strategies
//! move exactly the bytes the CPU reference moves, between device memory and pinned mapped host
//! memory in both host layouts; and the whole engine on the GPU produces exactly the outputs it
//! produces on the in-order CPU device (the kernels are bit-exact, so the digests — and so the
//! generated tokens — must be identical).
#![cfg(feature = "cuda")]

use tierkv_engine::cpu_device::{InOrderDevice, ManualClock};
use tierkv_engine::device::*;
use tierkv_engine::layout::*;
use tierkv_engine::runtime::cuda::{CopyStrategy, CudaDevice};
use tierkv_engine::runtime::MonotonicClock;
use tierkv_engine::{Config, Engine, EngineOptions, Output, RequestSpec};
use tierkv_kernels::cpu::numerics::mix64;
use tierkv_kernels::cuda::launch::LogitsKernel;

fn host_buf(dev: &mut CudaDevice, l: &Layout, kind: BufferKind) -> BufferId {
    dev.alloc(BufferDesc {
        role: BufferRole::Mirror { kind },
        tier: MemoryTier::PinnedHost,
        bytes: l.host_bytes(kind),
        fingerprint: l.fingerprint(kind),
    })
    .unwrap()
}

#[test]
fn both_transfer_strategies_move_the_right_bytes() {
    for strategy in [CopyStrategy::MemcpyRuns, CopyStrategy::Gather] {
        for host_layout in HostLayout::ALL {
            let l = Layout::new(LayoutParams {
                layers: 3,
                layer_base: 0,
                index_n_heads: 1,
                index_k_dtype: IndexKDtype::Bf16,
                kv_dtype: KvDtype::Fp8Packed,
                device_pages: 40,
                host_pages: 100,
                host_layout,
            })
            .unwrap();
            let mut dev = CudaDevice::new(strategy).unwrap();
            for kind in BufferKind::ALL {
                let host = host_buf(&mut dev, &l, kind);
                let pool = dev
                    .alloc(BufferDesc {
                        role: BufferRole::Pool {
                            kind,
                            layer: LayerId(1),
                        },
                        tier: MemoryTier::Device,
                        bytes: l.device_layer_bytes(kind),
                        fingerprint: l.fingerprint(kind),
                    })
                    .unwrap();
                // Random host bytes in, scattered pages to the device, back to other host pages.
                let seed = 0x1234 ^ kind as u64 ^ (host_layout as u64) << 8;
                let src: Vec<u8> = (0..l.host_bytes(kind).0)
                    .map(|i| mix64(seed ^ i) as u8)
                    .collect();
                dev.host_write(host, Bytes(0), &src).unwrap();
                let hv = l.host_layer_view(kind, LayerId(2));
                let dv = l.device_layer_view(kind);
                let there: Vec<(PageId, PageId)> = (0..30)
                    .map(|i| (PageId((i * 7 + 3) % 100), PageId(39 - i)))
                    .collect();
                let back: Vec<(PageId, PageId)> =
                    (0..30).map(|i| (PageId(39 - i), PageId(i + 50))).collect();
                dev.enqueue(
                    StreamKind::Load,
                    Op::PageCopy(PageCopy {
                        src: host,
                        src_view: hv,
                        dst: pool,
                        dst_view: dv,
                        runs: coalesce_runs(&there),
                    }),
                )
                .unwrap();
                let ev = dev.new_event().unwrap();
                dev.record(StreamKind::Load, ev).unwrap();
                dev.wait(StreamKind::Write, ev).unwrap();
                dev.enqueue(
                    StreamKind::Write,
                    Op::PageCopy(PageCopy {
                        src: pool,
                        src_view: dv,
                        dst: host,
                        dst_view: hv,
                        runs: coalesce_runs(&back),
                    }),
                )
                .unwrap();
                let done = dev.new_event().unwrap();
                dev.record(StreamKind::Write, done).unwrap();
                assert_eq!(dev.synchronize(done), EventState::Done);
                let mut got = vec![0u8; src.len()];
                dev.host_read(host, Bytes(0), &mut got).unwrap();
                // The same two copies on the CPU reference.
                let mut want = src.clone();
                let mut pool_cpu = vec![0u8; l.device_layer_bytes(kind).usize()];
                tierkv_kernels::cpu::page_copy(
                    &want,
                    &hv,
                    &mut pool_cpu,
                    &dv,
                    &coalesce_runs(&there),
                )
                .unwrap();
                tierkv_kernels::cpu::page_copy(
                    &pool_cpu,
                    &dv,
                    &mut want,
                    &hv,
                    &coalesce_runs(&back),
                )
                .unwrap();
                assert!(
                    got == want,
                    "{strategy:?} {host_layout:?} {kind:?}: host bytes differ"
                );
            }
        }
    }
}

type Produced = (
    std::collections::BTreeMap<(u64, u32), Vec<u64>>,
    std::collections::BTreeMap<u64, Vec<u32>>,
);

fn by_request(outs: &[Output]) -> Produced {
    let mut digests = std::collections::BTreeMap::new();
    let mut finished = std::collections::BTreeMap::new();
    for o in outs {
        match o {
            Output::Digests {
                request,
                position,
                digests: d,
            } => {
                digests.insert((*request, *position), d.clone());
            }
            Output::Finished { request, generated } => {
                finished.insert(*request, generated.clone());
            }
            _ => {}
        }
    }
    (digests, finished)
}

fn run(engine_outputs: &mut Vec<Output>, mut step: impl FnMut() -> (bool, Vec<Output>)) {
    for _ in 0..100_000 {
        let (idle, out) = step();
        engine_outputs.extend(out);
        if idle {
            return;
        }
    }
    panic!("no quiescence");
}

/// The GPU engine (the compute stream's ops launched from CUDA graphs, the production default)
/// computes what the CPU engine computes, request by request, bit for bit.
#[test]
fn the_engine_on_the_gpu_matches_the_engine_on_the_cpu() {
    engine_on_gpu_and_cpu(LogitsKernel::Exact, false, true);
}

/// The same with every kernel launched on its own (`DrivenDevice::set_graphs(false)`).
#[test]
fn the_engine_on_the_gpu_without_graphs_matches_the_engine_on_the_cpu() {
    engine_on_gpu_and_cpu(LogitsKernel::Exact, false, false);
}

/// The engine running one step ahead on the GPU (each step enqueued before the previous one is
/// waited for, its pending tokens generated and read on the device) computes what the in-order
/// engine on the CPU computes, request by request, bit for bit.
#[test]
fn the_engine_running_ahead_on_the_gpu_matches_the_engine_on_the_cpu() {
    engine_on_gpu_and_cpu(LogitsKernel::Exact, true, true);
}

/// The production default: logits on the tensor cores, within 1e-5 of their magnitude but not
/// bit-exact, so a top-k can differ from the CPU's at a near-tie and change that request's
/// digests. Every request must still finish with the tokens it asked for, the engine must stay
/// consistent, and the run prints how many digest rows agree with the CPU.
#[test]
fn the_engine_on_the_gpu_with_tensor_core_logits_runs_the_same_requests() {
    engine_on_gpu_and_cpu(LogitsKernel::TensorCore, false, true);
}

fn engine_on_gpu_and_cpu(logits: LogitsKernel, gpu_ahead: bool, graphs: bool) {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.model.layers = 2;
    cfg.model.index_n_heads = 4;
    cfg.model.index_topk = 48;
    cfg.model.context_tokens_max = 1024;
    cfg.cache.device_pages = 20; // tiny: evictions, backups and load-backs happen
    let synth = tierkv_engine::synth::Synth::new(5);
    let prompts: Vec<Vec<u32>> = (0..12u64)
        .map(|i| {
            let mut p: Vec<u32> = (0..192).map(|t| synth.token(1 + i % 3, t)).collect();
            p.extend((0..40 + i * 9).map(|t| synth.token(100 + i, t)));
            p
        })
        .collect();
    let opts = EngineOptions {
        seed: 5,
        ..Default::default()
    };
    let mut cpu = Engine::new(
        cfg.clone(),
        InOrderDevice::new(),
        ManualClock::default(),
        opts,
    )
    .unwrap();
    let mut dev = CudaDevice::new(CopyStrategy::default()).unwrap();
    dev.driver.logits = logits;
    dev.set_graphs(graphs);
    let gpu_opts = EngineOptions {
        overlap: gpu_ahead,
        ..opts
    };
    let mut gpu = Engine::new(cfg, dev, MonotonicClock::new(), gpu_opts).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for (round, chunk) in prompts.chunks(4).enumerate() {
        // Between rounds the device tier is emptied: the shared prefixes come back from the host
        // tier through layer-wise loads (and the completion ring's host callbacks).
        cpu.evict_device(usize::MAX).unwrap();
        gpu.evict_device(usize::MAX).unwrap();
        for p in chunk {
            cpu.submit(RequestSpec {
                prompt: p.clone(),
                max_new_tokens: 6,
            })
            .unwrap();
            gpu.submit(RequestSpec {
                prompt: p.clone(),
                max_new_tokens: 6,
            })
            .unwrap();
        }
        run(&mut a, || {
            let r = cpu.step().unwrap();
            cpu.check_invariants();
            (r.idle, cpu.drain_outputs())
        });
        run(&mut b, || {
            let r = gpu.step().unwrap();
            gpu.check_invariants();
            (r.idle, gpu.drain_outputs())
        });
        // Scheduling may differ (a GPU event can still be pending where the CPU's is done), so
        // compare what each request produced, not the order of the outputs.
        let (da, fa) = by_request(&a);
        let (db, fb) = by_request(&b);
        if logits == LogitsKernel::Exact {
            assert_eq!((&da, &fa), (&db, &fb), "outputs differ after round {round}");
        } else {
            let lens = |f: &std::collections::BTreeMap<u64, Vec<u32>>| {
                f.iter().map(|(r, g)| (*r, g.len())).collect::<Vec<_>>()
            };
            assert_eq!(
                lens(&fa),
                lens(&fb),
                "finished requests differ after round {round}"
            );
            assert_eq!(
                da.keys().collect::<Vec<_>>(),
                db.keys().collect::<Vec<_>>(),
                "digest rows differ after round {round}"
            );
        }
    }
    let (da, _) = by_request(&a);
    let (db, _) = by_request(&b);
    let same = da.iter().filter(|(k, v)| db.get(*k) == Some(*v)).count();
    eprintln!(
        "{logits:?} logits: {same}/{} digest rows equal to the CPU engine's",
        da.len()
    );
    assert!(
        gpu.metrics.loads > 0 || gpu.metrics.backups > 0,
        "the run moved pages between tiers"
    );
    eprintln!(
        "GPU engine = CPU engine over {} outputs; loads {}, backups {}",
        b.len(),
        gpu.metrics.loads,
        gpu.metrics.backups
    );
    gpu.check_quiescent().unwrap();
}

/// The runtime's answer to a stream-ordered allocation the pool cannot grow for: CUDA's
/// out-of-memory comes back as `OutOfMemory` (the error the runtime trims the pool on), and the
/// trim after a context synchronisation succeeds, with allocations working after it.
#[test]
fn the_stream_ordered_pool_reports_out_of_memory_and_trims() {
    use tierkv_engine::runtime::driver::Driver;
    let mut dev = CudaDevice::new(CopyStrategy::default()).unwrap();
    let s = StreamKind::Compute;
    // More than any GPU holds.
    let r = dev.driver.alloc_async(s, 1 << 50);
    assert!(
        matches!(r, Err(DeviceError::OutOfMemory { .. })),
        "an allocation of 1 PiB answered {r:?}"
    );
    let m = dev.driver.alloc_async(s, 64 << 20).unwrap();
    dev.driver.free_async(s, m).unwrap();
    dev.driver.context_synchronize().unwrap();
    dev.driver.trim_pool().unwrap();
    let m = dev.driver.alloc_async(s, 64 << 20).unwrap();
    dev.driver.free_async(s, m).unwrap();
    dev.driver.context_synchronize().unwrap();
}
