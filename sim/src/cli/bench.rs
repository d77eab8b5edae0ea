//! `tierkv bench` (feature `cuda`): times the kernels and page transfers on the GPU against the
//! device-copy bandwidth measured in the same run and, given `--torch-json`, against the PyTorch
//! implementations of `bench/torch_bench.py` run on the same machine just before.
//!
//! Every time is the median of repeated runs between CUDA events, after warm-up. Bytes moved count
//! each input read once and each output written once.

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Results of `bench/torch_bench.py` (JSON lines) to compare with.
    #[arg(long)]
    pub torch_json: Option<std::path::PathBuf>,
    /// Write the results table (markdown) here too.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Timed repetitions per measurement.
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
}

#[cfg(not(feature = "cuda"))]
pub fn run_bench(_: BenchArgs) -> i32 {
    eprintln!("tierkv bench needs a GPU build: cargo run --release -p tierkv-sim --features cuda -- bench");
    2
}

#[cfg(feature = "cuda")]
pub fn run_bench(args: BenchArgs) -> i32 {
    match imp::run(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("bench failed: {e}");
            1
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::BenchArgs;
    use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
    use half::bf16;
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use tierkv_engine::runtime::cuda::PinnedHost;
    use tierkv_kernels::cpu::numerics::{e4m3_encode, mix64};
    use tierkv_kernels::cuda::launch::{DevPtr, Kernels, LogitsKernel};
    use tierkv_kernels::layout::*;
    use tierkv_kernels::rope::rope_row;

    type R<T> = Result<T, String>;

    fn e<E: std::fmt::Display>(x: E) -> String {
        x.to_string()
    }

    struct Ctx {
        k: &'static Kernels,
        s: Arc<CudaStream>,
        reps: usize,
    }

    fn ptr(s: &Arc<CudaStream>, d: &CudaSlice<u8>) -> DevPtr {
        let (p, _g) = d.device_ptr(s);
        DevPtr {
            ptr: p,
            bytes: d.len() as u64,
        }
    }

    impl Ctx {
        fn buf(&self, bytes: usize) -> R<CudaSlice<u8>> {
            self.s.alloc_zeros::<u8>(bytes.max(1)).map_err(e)
        }
        fn up<T: Copy>(&self, v: &[T]) -> R<CudaSlice<u8>> {
            // SAFETY: plain data viewed as bytes.
            let b = unsafe {
                std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v))
            };
            self.s.clone_htod(b).map_err(e)
        }
        /// Median milliseconds of `f` between events, after warm-up.
        fn time(&self, mut f: impl FnMut() -> R<()>) -> R<f64> {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            for _ in 0..3 {
                f()?;
            }
            self.s.synchronize().map_err(e)?;
            let mut ms = Vec::new();
            for _ in 0..self.reps {
                let a = self.k.ctx.new_event(flags).map_err(e)?;
                let b = self.k.ctx.new_event(flags).map_err(e)?;
                a.record(&self.s).map_err(e)?;
                f()?;
                b.record(&self.s).map_err(e)?;
                b.synchronize().map_err(e)?;
                ms.push(a.elapsed_ms(&b).map_err(e)? as f64);
            }
            ms.sort_by(|x, y| x.partial_cmp(y).unwrap());
            Ok(ms[ms.len() / 2])
        }
    }

    struct Row {
        name: String,
        ms: f64,
        bytes: u64,
        note: String,
    }

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            ((mix64(s) >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        }
    }

    pub fn run(a: &BenchArgs) -> R<()> {
        let k = Kernels::global().map_err(e)?;
        let s = k.ctx.new_stream().map_err(e)?;
        let c = Ctx {
            k,
            s: s.clone(),
            reps: a.reps,
        };
        let name = k.ctx.name().unwrap_or_default();
        println!("device: {name}");
        let mut rows: Vec<Row> = Vec::new();

        // 1. Ceilings: a large device-to-device copy, and one large pinned copy each way.
        let big = 2usize << 30;
        let (x, y) = (c.buf(big)?, c.buf(big)?);
        let (xp, yp) = (ptr(&s, &x), ptr(&s, &y));
        let ms = c.time(|| {
            // SAFETY: both buffers are `big` bytes.
            let r = unsafe { sys::cuMemcpyDtoDAsync_v2(yp.ptr, xp.ptr, big, s.cu_stream()) };
            if r == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(format!("{r:?}"))
            }
        })?;
        let copy_bw = 2.0 * big as f64 / (ms * 1e-3);
        rows.push(Row {
            name: "device copy 2 GiB (read + write)".into(),
            ms,
            bytes: 2 * big as u64,
            note: "ceiling".into(),
        });
        drop((x, y));
        let hbytes = 1usize << 30;
        let host = PinnedHost::new(&k.ctx, hbytes).map_err(e)?;
        let dev = c.buf(hbytes)?;
        let dp = ptr(&s, &dev);
        let h2d = c.time(|| {
            // SAFETY: both sides are `hbytes` bytes.
            let r = unsafe { sys::cuMemcpyAsync(dp.ptr, host.dev, hbytes, s.cu_stream()) };
            if r == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(format!("{r:?}"))
            }
        })?;
        let d2h = c.time(|| {
            // SAFETY: as above.
            let r = unsafe { sys::cuMemcpyAsync(host.dev, dp.ptr, hbytes, s.cu_stream()) };
            if r == sys::CUresult::CUDA_SUCCESS {
                Ok(())
            } else {
                Err(format!("{r:?}"))
            }
        })?;
        let h2d_bw = hbytes as f64 / (h2d * 1e-3);
        let d2h_bw = hbytes as f64 / (d2h * 1e-3);
        rows.push(Row {
            name: "pinned H2D 1 GiB, one cuMemcpyAsync".into(),
            ms: h2d,
            bytes: hbytes as u64,
            note: "transfer ceiling".into(),
        });
        rows.push(Row {
            name: "pinned D2H 1 GiB, one cuMemcpyAsync".into(),
            ms: d2h,
            bytes: hbytes as u64,
            note: "transfer ceiling".into(),
        });
        drop((host, dev));

        // 2. index_k_store, 1M tokens.
        let n = 1usize << 20;
        let mut r = rng(1);
        let keys: Vec<bf16> = (0..n * 128).map(|_| bf16::from_f32(r() * 4.0)).collect();
        let rope: Vec<f32> = (0..n)
            .flat_map(|i| rope_row((i % 131_072) as u32))
            .collect();
        let gamma = vec![1.0f32; 128];
        let beta = vec![0.0f32; 128];
        let slots: Vec<i32> = (0..n as i32).collect();
        let (kd, rd, gd, bd, sd) = (
            c.up(&keys)?,
            c.up(&rope)?,
            c.up(&gamma)?,
            c.up(&beta)?,
            c.up(&slots)?,
        );
        for dtype in IndexKDtype::ALL {
            let fmt = PageFormat::IndexK(dtype);
            let pool = c.buf((n / 64) * fmt.page_bytes() as usize)?;
            let pp = ptr(&s, &pool);
            let ms = c.time(|| {
                k.index_k_store(
                    &s,
                    dtype,
                    false,
                    ptr(&s, &kd),
                    ptr(&s, &gd),
                    ptr(&s, &bd),
                    ptr(&s, &rd),
                    &slots,
                    ptr(&s, &sd),
                    pp,
                    fmt.fingerprint(),
                )
                .map_err(e)
            })?;
            let bytes = (n * 256 + n * 256 + n * 4) as u64 + pp.bytes;
            rows.push(Row {
                name: format!("index_k_store 1M tokens {}", dtype.name()),
                ms,
                bytes,
                note: String::new(),
            });
        }
        drop((kd, rd, gd, bd, sd));

        // 3. index_logits, batch 64 x 64K context, 64 heads; 4. topk on its output.
        let mut tuning: Vec<String> = Vec::new();
        let (bsz, ctx, heads) = (64usize, 65_536usize, 64usize);
        let pt_stride = ctx / 64;
        let pages = bsz * pt_stride;
        let page_table: Vec<i32> = (0..pages as i32).collect();
        let lens = vec![ctx as i32; bsz];
        let q: Vec<u8> = (0..bsz * heads * 128)
            .map(|_| e4m3_encode(r() * 200.0))
            .collect();
        let w: Vec<f32> = (0..bsz * heads).map(|_| r() * 0.01).collect();
        let (qd, wd, ptd, ld) = (c.up(&q)?, c.up(&w)?, c.up(&page_table)?, c.up(&lens)?);
        let out = c.buf(bsz * ctx * 4)?;
        let op = ptr(&s, &out);
        for dtype in IndexKDtype::ALL {
            let fmt = PageFormat::IndexK(dtype);
            let mut host_pool: Vec<u8> = (0..pages * fmt.page_bytes() as usize)
                .map(|i| {
                    if dtype == IndexKDtype::Fp8 {
                        e4m3_encode(r() * 400.0)
                    } else {
                        (mix64(i as u64) >> 17) as u8 & 0x3F
                    }
                })
                .collect();
            if dtype == IndexKDtype::Fp8 {
                // Real key scales (the bytes above would read as arbitrary floats, inf and NaN).
                let pb = fmt.page_bytes() as usize;
                for (i, page) in host_pool.chunks_exact_mut(pb).enumerate() {
                    for t in 0..64u32 {
                        let at = index_k_page::scale_offset(dtype, t).expect("fp8 scales");
                        let scale =
                            0.01 * (1.0 + (mix64(i as u64 * 64 + t as u64) % 100) as f32 / 100.0);
                        page[at..at + 4].copy_from_slice(&scale.to_le_bytes());
                    }
                }
            }
            let pool = c.up(&host_pool)?;
            drop(host_pool);
            let kp = ptr(&s, &pool);
            let run = |kind: LogitsKernel| {
                k.index_logits_with(
                    kind,
                    &s,
                    dtype,
                    heads,
                    ptr(&s, &qd),
                    ptr(&s, &wd),
                    &page_table,
                    pt_stride,
                    ptr(&s, &ptd),
                    &lens,
                    ptr(&s, &ld),
                    kp,
                    fmt.fingerprint(),
                    op,
                    ctx,
                )
                .map_err(e)
            };
            let bytes = kp.bytes + (q.len() + w.len() * 4 + page_table.len() * 4) as u64 + op.bytes;
            let flops = 2.0 * (bsz * ctx * heads * 128) as f64;
            let tflops = |ms: f64| flops / (ms * 1e-3) / 1e12;
            let mut results: Vec<Vec<f32>> = Vec::new();
            for kind in [LogitsKernel::Exact, LogitsKernel::TensorCore] {
                let ms = c.time(|| run(kind))?;
                let mut host = vec![0u8; out.len()];
                s.memcpy_dtoh(&out, &mut host).map_err(e)?;
                s.synchronize().map_err(e)?;
                results.push(
                    host.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                );
                let note = match kind {
                    LogitsKernel::Exact => format!("{:.1} TFLOP/s fp32 FMA", tflops(ms)),
                    LogitsKernel::TensorCore => {
                        // Agreement with the exact kernel on this very input, relative to the
                        // largest logit (the conformance test checks the real bound).
                        let (x, t) = (&results[0], &results[1]);
                        let top = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                        // NaN anywhere makes `worst` NaN (f32::max would skip it).
                        let worst = x.iter().zip(t).fold(0f32, |m, (a, b)| {
                            let d = if a == b { 0.0 } else { (a - b).abs() };
                            if d.is_nan() || m.is_nan() {
                                f32::NAN
                            } else {
                                m.max(d)
                            }
                        });
                        if !top.is_finite() || !worst.is_finite() {
                            return Err(format!(
                                "index_logits {}: non-finite logits (largest {top}, worst difference {worst})",
                                dtype.name()
                            ));
                        }
                        format!(
                            "{:.1} TFLOP/s mma.sync; max |Δ| vs exact {:.1e} of the largest logit",
                            tflops(ms),
                            worst / top
                        )
                    }
                };
                rows.push(Row {
                    name: format!(
                        "index_logits {} 64 x 64K, 64 heads, {}",
                        match kind {
                            LogitsKernel::Exact => "exact",
                            LogitsKernel::TensorCore => "tensor-core",
                        },
                        dtype.name()
                    ),
                    ms,
                    bytes,
                    note,
                });
            }
            // The tensor-core kernel's launch shape: CTAs per launch x L2 prefetch distance.
            use std::sync::atomic::Ordering::Relaxed;
            use tierkv_kernels::cuda::launch::{
                LOGITS_MMA_AHEAD, LOGITS_MMA_CTAS, LOGITS_MMA_VARIANT,
            };
            let slot = &LOGITS_MMA_VARIANT[(dtype == IndexKDtype::Bf16) as usize];
            let defaults = (
                LOGITS_MMA_CTAS.load(Relaxed),
                LOGITS_MMA_AHEAD.load(Relaxed),
                slot.load(Relaxed),
            );
            for (vi, v) in tierkv_kernels::cuda::logits_mma_variants(dtype)
                .iter()
                .enumerate()
            {
                for ctas in [1056usize, 2112, 4224] {
                    for ahead in [0usize, 2] {
                        slot.store(vi, Relaxed);
                        LOGITS_MMA_CTAS.store(ctas, Relaxed);
                        LOGITS_MMA_AHEAD.store(ahead, Relaxed);
                        let ms = c.time(|| run(LogitsKernel::TensorCore))?;
                        tuning.push(format!(
                            "| {} | {ctas} | {ahead} | {ms:.4} | {:.0} | {:.0}% |",
                            v.kernel,
                            bytes as f64 / (ms * 1e-3) / 1e9,
                            100.0 * bytes as f64 / (ms * 1e-3) / copy_bw
                        ));
                    }
                }
            }
            LOGITS_MMA_CTAS.store(defaults.0, Relaxed);
            LOGITS_MMA_AHEAD.store(defaults.1, Relaxed);
            slot.store(defaults.2, Relaxed);
        }
        for topk in [512usize, 2048] {
            let sel = c.buf(bsz * topk * 4)?;
            let sp = ptr(&s, &sel);
            let ms = c.time(|| {
                k.topk(
                    &s,
                    topk,
                    op,
                    ctx,
                    &lens,
                    ptr(&s, &ld),
                    &page_table,
                    pt_stride,
                    ptr(&s, &ptd),
                    sp,
                )
                .map_err(e)
            })?;
            rows.push(Row {
                name: format!("topk k={topk}, 64 x 64K"),
                ms,
                bytes: op.bytes + sp.bytes,
                note: String::new(),
            });
        }
        drop((qd, wd, ptd, ld, out));

        // 5. Page transfers of one 128K-token layer (2048 pages of KV + index-K), each way.
        let layout = Layout::new(LayoutParams {
            layers: 1,
            layer_base: 0,
            index_n_heads: 64,
            index_k_dtype: IndexKDtype::Fp8,
            kv_dtype: KvDtype::Fp8Packed,
            device_pages: 2048,
            host_pages: 4096,
            host_layout: HostLayout::LayerFirst,
        })
        .map_err(e)?;
        let mut perm: Vec<u32> = (0..4096).collect();
        for i in (1..perm.len()).rev() {
            let j = (mix64(i as u64 ^ 77) % (i as u64 + 1)) as usize;
            perm.swap(i, j);
        }
        let scattered: Vec<(PageId, PageId)> = (0..2048)
            .map(|d| (PageId(perm[d as usize]), PageId(d)))
            .collect();
        let contiguous: Vec<(PageId, PageId)> = (0..2048).map(|d| (PageId(d), PageId(d))).collect();
        let mut moved = 0u64;
        let mut bufs = Vec::new();
        for kind in BufferKind::ALL {
            let host = PinnedHost::new(&k.ctx, layout.host_bytes(kind).usize()).map_err(e)?;
            let dev = c.buf(layout.device_layer_bytes(kind).usize())?;
            moved += 2048 * layout.page_bytes(kind).0;
            bufs.push((kind, host, dev));
        }
        let ops = |strategy: tierkv_engine::runtime::cuda::CopyStrategy| {
            tierkv_engine::runtime::cuda::CudaOps {
                ctx: k.ctx.clone(),
                kernels: k,
                strategy,
                logits: LogitsKernel::default(),
            }
        };
        use tierkv_engine::device::{BufferDesc, BufferId, BufferRole, MemoryTier, Op};
        let descs: Vec<BufferDesc> = bufs
            .iter()
            .flat_map(|(kind, _, _)| {
                [
                    BufferDesc {
                        role: BufferRole::Mirror { kind: *kind },
                        tier: MemoryTier::PinnedHost,
                        bytes: layout.host_bytes(*kind),
                        fingerprint: layout.fingerprint(*kind),
                    },
                    BufferDesc {
                        role: BufferRole::Pool {
                            kind: *kind,
                            layer: LayerId(0),
                        },
                        tier: MemoryTier::Device,
                        bytes: layout.device_layer_bytes(*kind),
                        fingerprint: layout.fingerprint(*kind),
                    },
                ]
            })
            .collect();
        let ptrs: Vec<DevPtr> = bufs
            .iter()
            .flat_map(|(_, h, d)| {
                [
                    DevPtr {
                        ptr: h.dev,
                        bytes: h.bytes as u64,
                    },
                    ptr(&s, d),
                ]
            })
            .collect();
        for (label, pairs) in [("scattered", &scattered), ("contiguous", &contiguous)] {
            for to_device in [true, false] {
                for strategy in [
                    tierkv_engine::runtime::cuda::CopyStrategy::MemcpyRuns,
                    tierkv_engine::runtime::cuda::CopyStrategy::Gather,
                ] {
                    let o = ops(strategy);
                    let mut list = Vec::new();
                    for (i, (kind, _, _)) in bufs.iter().enumerate() {
                        let (hb, db) = (BufferId(2 * i as u32), BufferId(2 * i as u32 + 1));
                        let hv = layout.host_layer_view(*kind, LayerId(0));
                        let dv = layout.device_layer_view(*kind);
                        let runs = if to_device {
                            coalesce_runs(pairs)
                        } else {
                            coalesce_runs(&pairs.iter().map(|&(h, d)| (d, h)).collect::<Vec<_>>())
                        };
                        list.push(if to_device {
                            Op::PageCopy {
                                src: hb,
                                src_view: hv,
                                dst: db,
                                dst_view: dv,
                                runs,
                            }
                        } else {
                            Op::PageCopy {
                                src: db,
                                src_view: dv,
                                dst: hb,
                                dst_view: hv,
                                runs,
                            }
                        });
                    }
                    let runs: usize = list
                        .iter()
                        .map(|o| {
                            if let Op::PageCopy { runs, .. } = o {
                                runs.len()
                            } else {
                                0
                            }
                        })
                        .sum();
                    let ms = c.time(|| {
                        for op in &list {
                            o.run(&s, op, &|b| (ptrs[b.0 as usize], descs[b.0 as usize]))
                                .map_err(e)?;
                        }
                        Ok(())
                    })?;
                    let ceiling = if to_device { h2d_bw } else { d2h_bw };
                    rows.push(Row {
                        name: format!(
                            "page transfer 128K-token layer, {label}, {} , {:?}",
                            if to_device {
                                "host→device"
                            } else {
                                "device→host"
                            },
                            strategy
                        ),
                        ms,
                        bytes: moved,
                        note: format!(
                            "{runs} runs; {:.0}% of one large pinned copy",
                            100.0 * moved as f64 / (ms * 1e-3) / ceiling
                        ),
                    });
                }
            }
        }

        // The table, with PyTorch beside it where the script measured the same operation.
        let torch: BTreeMap<String, f64> = match &a.torch_json {
            Some(p) => std::fs::read_to_string(p)
                .map_err(e)?
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter_map(|v| Some((v["name"].as_str()?.to_string(), v["ms"].as_f64()?)))
                .collect(),
            None => BTreeMap::new(),
        };
        let mut md = String::new();
        md.push_str(&format!("device: {name}; device copy bandwidth {:.0} GB/s (read + write); pinned H2D {:.1} GB/s, D2H {:.1} GB/s\n\n", copy_bw / 1e9, h2d_bw / 1e9, d2h_bw / 1e9));
        md.push_str("| operation | time ms | GB/s | vs device copy | PyTorch ms | vs PyTorch | note |\n|---|---:|---:|---:|---:|---:|---|\n");
        for row in &rows {
            let bw = row.bytes as f64 / (row.ms * 1e-3);
            let key = torch_key(&row.name);
            let (tms, speed) = match key.and_then(|k| torch.get(k)) {
                Some(t) => (format!("{t:.3}"), format!("{:.2}x", t / row.ms)),
                None => ("-".into(), "-".into()),
            };
            md.push_str(&format!(
                "| {} | {:.3} | {:.0} | {:.0}% | {} | {} | {} |\n",
                row.name,
                row.ms,
                bw / 1e9,
                100.0 * bw / copy_bw,
                tms,
                speed,
                row.note
            ));
        }
        md.push_str("\nTensor-core logits launch shape (64 x 64K, 64 heads):\n\n| variant | CTAs | L2 prefetch ahead | ms | GB/s | vs device copy |\n|---|---:|---:|---:|---:|---:|\n");
        for t in &tuning {
            md.push_str(t);
            md.push('\n');
        }
        print!("{md}");
        if let Some(p) = &a.out {
            std::fs::write(p, &md).map_err(e)?;
        }
        Ok(())
    }

    /// The name the PyTorch script uses for the same operation.
    fn torch_key(name: &str) -> Option<&'static str> {
        Some(match name {
            n if n.starts_with("device copy") => "device copy",
            n if n.starts_with("index_k_store 1M tokens fp8") => "index_k_store fp8",
            n if n.starts_with("index_k_store 1M tokens bf16") => "index_k_store bf16",
            n if n.starts_with("index_logits") && n.ends_with("fp8") => "index_logits fp8",
            n if n.starts_with("index_logits") && n.ends_with("bf16") => "index_logits bf16",
            n if n.starts_with("topk k=512") => "topk 512",
            n if n.starts_with("topk k=2048") => "topk 2048",
            n if n.contains("scattered") && n.contains("host→device") && n.contains("Gather") => {
                "page transfer scattered h2d"
            }
            n if n.contains("scattered") && n.contains("device→host") && n.contains("Gather") => {
                "page transfer scattered d2h"
            }
            _ => return None,
        })
    }
}
