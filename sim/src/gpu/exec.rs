//! The executor: an op's data effect at its completion — the launch's device arguments patched
//! in, the content oracle's check of what it reads, garbage for a failed copy, and the kernels'
//! CPU references (or the CUDA kernels, `--device cuda`) on the simulator's memory, with what
//! they may keep from op to op.

use super::*;

/// (buffer, page index) → the page as it was decoded.
type KeptPages = FastMap<(BufferId, usize), KeptPage>;

type KeptRow = (Box<[u8]>, u64);

/// What performs an op's data effect when the simulation says it completes.
pub(super) enum Executor {
    /// The kernels' CPU references on the simulator's memory, with what they can keep from op to
    /// op.
    Cpu(Box<Kept>),
    /// The CUDA kernels and copies on a real GPU, through mirrors of the simulator's buffers.
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda_exec::CudaExec>),
}

impl Executor {
    #[cfg(feature = "cuda")]
    pub(super) fn cuda() -> Result<Executor, DeviceError> {
        Ok(Executor::Cuda(Box::new(crate::cuda_exec::CudaExec::new()?)))
    }
    /// Without CUDA the kernels' stand-in answers `BuiltWithoutCuda`, and no kernels exist to
    /// build an executor on.
    #[cfg(not(feature = "cuda"))]
    pub(super) fn cuda() -> Result<Executor, DeviceError> {
        let kernels =
            tierkv_kernels::cuda::launch::Kernels::global().map_err(|e| DeviceError::Backend {
                detail: format!("--device cuda: {e}"),
            })?;
        Ok(kernels.unreachable())
    }
    pub(super) fn run(&mut self, op: &Op, mem: &mut Memory) -> Result<(), DeviceError> {
        match self {
            Executor::Cpu(kept) => match op {
                Op::SparseRead(o) => {
                    let buffer = o.kv;
                    let hashes = &mut kept.row_hashes;
                    run_sparse_read_hashed(o, mem, &mut |at, row| hashes.get(buffer, at, row))
                }
                Op::IndexLogits(o) => run_index_logits_from_pages(
                    o,
                    mem,
                    &mut DecodedPages {
                        buffer: o.k,
                        kept: &mut kept.pages,
                    },
                ),
                _ => run_op(op, mem),
            },
            #[cfg(feature = "cuda")]
            Executor::Cuda(c) => c.run(op, mem),
        }
    }
}

/// What the CPU executor keeps from op to op, each entry with the bytes it was computed from and
/// used only while they are unchanged: compared byte for byte rather than trusted to the write
/// generations, so that no write the simulator did not account for can leave a stale entry. At
/// most one entry per row or page of the pools read.
#[derive(Default)]
pub(super) struct Kept {
    row_hashes: RowHashes,
    pages: KeptPages,
}

/// An index-K page's bytes, the dtype they were decoded as, and its keys.
pub(super) struct KeptPage {
    bytes: Box<[u8]>,
    dtype: IndexKDtype,
    keys: Box<KeyBlock>,
}

/// A logits op's pages, decoded once and kept while their bytes stay the same (a query reads
/// the pages the previous one did).
pub(super) struct DecodedPages<'a> {
    buffer: BufferId,
    kept: &'a mut KeptPages,
}

impl PageKeys for DecodedPages<'_> {
    fn page(&mut self, dtype: IndexKDtype, index: usize, bytes: &[u8]) -> &KeyBlock {
        let e = self
            .kept
            .entry((self.buffer, index))
            .or_insert_with(|| KeptPage {
                bytes: Box::from(&[][..]),
                dtype,
                keys: KeyBlock::new(),
            });
        if *e.bytes != *bytes || e.dtype != dtype {
            if e.bytes.len() == bytes.len() {
                e.bytes.copy_from_slice(bytes);
            } else {
                e.bytes = bytes.into();
            }
            e.dtype = dtype;
            e.keys.decode(dtype, bytes);
        }
        &e.keys
    }
}

/// The `row_hash` of every KV row a `sparse_read` hashed, by where it lies (a query selects the
/// rows the previous one did, give or take a few).
#[derive(Default)]
pub(super) struct RowHashes {
    /// (buffer, byte offset) → the row's bytes and their hash.
    rows: FastMap<(BufferId, usize), KeptRow>,
}

impl RowHashes {
    fn get(&mut self, buffer: BufferId, at: usize, row: &[u8]) -> u64 {
        match self.rows.get_mut(&(buffer, at)) {
            Some((bytes, h)) if **bytes == *row => *h,
            Some((bytes, h)) if bytes.len() == row.len() => {
                bytes.copy_from_slice(row);
                *h = row_hash(row);
                *h
            }
            _ => {
                let h = row_hash(row);
                self.rows.insert((buffer, at), (row.into(), h));
                h
            }
        }
    }
}

/// What the simulator knows the bytes of paged buffers hold, beside the bytes: the token rows
/// a failed, skipped or refused op left garbage in, each page's write generation (the content
/// oracle's cache key), and the tokens buffers a skipped `next_tokens` left stale.
#[derive(Default)]
pub(super) struct PageMarks {
    /// Token rows (bit `t` of a page's mask) that hold garbage.
    tainted: crate::fasthash::FastMap<(BufferId, u64), u64>,
    /// Writes per paged-buffer page.
    generation: crate::fasthash::FastMap<(BufferId, u64), u64>,
    /// Tokens buffers whose last `next_tokens` was skipped (a failed step): what they hold is
    /// not the tokens of any step.
    stale_tokens: std::collections::BTreeSet<BufferId>,
}

impl PageMarks {
    /// Rows `rows` (a mask of token rows) of `page` hold garbage.
    pub(super) fn taint(&mut self, buf: BufferId, page: u64, rows: u64) {
        *self.tainted.entry((buf, page)).or_default() |= rows;
    }

    /// Rows `rows` of `page` were written whole: they hold good bytes again.
    pub(super) fn clean(&mut self, buf: BufferId, page: u64, rows: u64) {
        if let Some(m) = self.tainted.get_mut(&(buf, page)) {
            *m &= !rows;
            if *m == 0 {
                self.tainted.remove(&(buf, page));
            }
        }
    }

    /// Whether any token row of `page` holds garbage.
    pub(super) fn any_tainted(&self, buf: BufferId, page: u64) -> bool {
        self.tainted.contains_key(&(buf, page))
    }

    /// `page` was written (by any op): its generation moves on.
    pub(super) fn written(&mut self, buf: BufferId, page: u64) {
        *self.generation.entry((buf, page)).or_default() += 1;
    }

    /// A skipped `next_tokens` left `buf` stale (true), or one that ran made it data (false).
    pub(super) fn set_stale_tokens(&mut self, buf: BufferId, stale: bool) {
        if stale {
            self.stale_tokens.insert(buf);
        } else {
            self.stale_tokens.remove(&buf);
        }
    }

    pub(super) fn stale_tokens(&self, buf: BufferId) -> bool {
        self.stale_tokens.contains(&buf)
    }
}

impl crate::oracles::content::PageState for PageMarks {
    fn tainted_rows(&self, buf: BufferId, page: u64) -> u64 {
        self.tainted.get(&(buf, page)).copied().unwrap_or(0)
    }
    fn generation(&self, buf: BufferId, page: u64) -> u64 {
        self.generation.get(&(buf, page)).copied().unwrap_or(0)
    }
}

impl SimGpu {
    /// A launch's arrays as its kernel reads them: from their device ranges, now.
    pub(super) fn patch(&self, op: &mut Op, args: &LaunchArgs) {
        for &(field, range) in &args.patches {
            let bytes = self.mem.range(range);
            let word = |i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
            let ints = match (field, &mut *op) {
                (ArgField::Slots, Op::IndexKStore(o)) => o.args.slots.to_mut(),
                (ArgField::Slots, Op::KvStore(o)) => o.args.slots.to_mut(),
                (ArgField::PageTable, Op::IndexLogits(o)) => o.args.page_table.to_mut(),
                (ArgField::PageTable, Op::TopK(o)) => o.args.page_table.to_mut(),
                (ArgField::ContextLens, Op::IndexLogits(o)) => o.args.context_lens.to_mut(),
                (ArgField::ContextLens, Op::TopK(o)) => o.args.context_lens.to_mut(),
                (ArgField::Rows, o) => {
                    let rows = match o {
                        Op::IndexKStore(o) => &mut o.keys.rows,
                        Op::KvStore(o) => &mut o.rows.rows,
                        Op::QPrep(o) => &mut o.inputs.rows,
                        o => panic!("{} has no drawn rows", o.name()),
                    };
                    assert!(bytes.len() >= 8 * rows.len(), "rows past their upload");
                    // The op's own copy: the engine's other ops share the rows it holds.
                    for (i, r) in std::sync::Arc::make_mut(rows).iter_mut().enumerate() {
                        r.token = word(2 * i);
                        r.position = word(2 * i + 1);
                    }
                    continue;
                }
                (f, o) => panic!("{} has no {f:?}", o.name()),
            };
            assert!(bytes.len() >= 4 * ints.len(), "{field:?} past its upload");
            for (i, x) in ints.iter_mut().enumerate() {
                *x = word(i) as i32;
            }
        }
    }

    /// The content oracle on every row the op reads, in the memory it reads them from.
    pub(super) fn check_content(&mut self, rec: &OpRec, end: u64) {
        let Some(c) = self.content.clone() else {
            return;
        };
        let found = c
            .borrow_mut()
            .check_reads(&rec.op, &self.mem, &self.page_marks);
        for (oracle, msg) in found {
            self.finding(
                oracle,
                format!("op {} ({}) at {} ns: {msg}", rec.id, rec.op.name(), end),
            );
        }
    }

    /// A failed copy leaves garbage where it was writing, taints the rows it would have
    /// written, and marks its stream so the next record reports the failure.
    pub(super) fn fail_copy(&mut self, s: usize, rec: &OpRec) {
        self.stats.failed_copies += 1;
        self.streams[s].failed_since_record = true;
        for (j, a) in rec
            .op
            .accesses()
            .into_iter()
            .filter(|a| a.write)
            .enumerate()
        {
            let garbage =
                self.faults
                    .keyed_bits(KEY_GARBAGE, s, rec.key.wrapping_mul(64) ^ j as u64);
            for (i, b) in self.mem.range_mut(a.range).iter_mut().enumerate() {
                *b = (garbage >> ((i % 8) * 8)) as u8 ^ i as u8;
            }
            self.bump_generations(a.range);
        }
        // `full_rows`, not the op's own: a linear copy into a paged buffer (one run of a page
        // copy, `CopyStrategy::MemcpyRuns`) leaves its pages garbage too.
        for (buf, page, rows) in self.full_rows(&rec.op) {
            self.page_marks.taint(buf, page, rows);
        }
    }

    /// The op's data effect, by the executor; rows it writes in full hold good bytes again.
    /// Bytes it changed outside its declared writes are a finding.
    pub(super) fn perform(&mut self, rec: &OpRec) {
        let shadows = undeclared::before(&rec.op, rec.id, &self.mem, &mut self.shadow_arena);
        // Undeclared reads are probed by running the CPU reference twice.
        let probed = self.read_probes.entry(rec.op.name()).or_default();
        let reads = match self.exec {
            Executor::Cpu(_) if undeclared::ReadProbe::sampled(rec.id, *probed) => {
                let p = undeclared::ReadProbe::before(&rec.op, &self.mem);
                *probed += p.is_some() as u32;
                p
            }
            _ => None,
        };
        if let Err(e) = self.exec.run(&rec.op, &mut self.mem) {
            self.finding(
                OracleKind::Layout,
                format!("op {} ({}) failed to run: {e}", rec.id, rec.op.name()),
            );
        }
        let stray = reads.and_then(|p| {
            p.after(&rec.op, &mut self.mem, |op, mem| {
                // The first run's error, if any, was reported above.
                let _ = run_op(op, mem);
            })
        });
        if let Some(stray) = stray {
            let changed: Vec<String> = stray.changed.iter().map(|&b| self.describe(b)).collect();
            let msg = format!(
                "op {} ({} {}) reads bytes it did not declare: run again with the bytes beside its declared reads changed (in {}), it wrote byte {} of {} differently",
                rec.id,
                rec.op.name(),
                op_detail(&rec.op, &self.mem),
                changed.join(", "),
                stray.output.1,
                self.describe(stray.output.0)
            );
            self.finding(OracleKind::Undeclared, msg);
        }
        if let Some(stray) = undeclared::after(&shadows, &self.mem, &self.shadow_arena) {
            let msg = format!(
                "op {} ({} {}) changed bytes {}..{} of {}, which it did not declare it writes",
                rec.id,
                rec.op.name(),
                op_detail(&rec.op, &self.mem),
                stray.bytes.start,
                stray.bytes.end,
                self.describe(stray.buffer)
            );
            self.finding(OracleKind::Undeclared, msg);
        }
        let writes: Vec<ByteRange> = rec
            .op
            .accesses()
            .into_iter()
            .filter(|a| a.write)
            .map(|a| a.range)
            .collect();
        for &r in &writes {
            self.bump_generations(r);
        }
        for (buf, page, rows) in self.full_rows(&rec.op) {
            self.page_marks.clean(buf, page, rows);
        }
        self.pending_tokens(&rec.op);
        if let Op::PageCopy(_) = rec.op {
            self.stats.copy_bytes += writes.iter().map(|r| r.len().0).sum::<u64>();
        }
    }

    /// An engine running one step ahead: a `next_tokens` that ran makes its tokens data and
    /// tells the content oracle the tokens its rows generated (provisionally: the engine
    /// confirms each when it emits it); a store that drew a pending row from tokens that a
    /// skipped `next_tokens` left stale wrote garbage there, like a failed copy (the engine must
    /// discard the step, as it discards the failed one before it).
    pub(super) fn pending_tokens(&mut self, op: &Op) {
        let drawn = match op {
            Op::NextTokens(o) => {
                self.page_marks.set_stale_tokens(o.out.buffer, false);
                if let Some(c) = &self.content {
                    let got = tierkv_kernels::cpu::numerics::le_u32s(self.mem.region(o.out));
                    let mut c = c.borrow_mut();
                    for (tag, &token) in o.tags.rows.iter().zip(&got) {
                        c.generated(tag.request, tag.position + 1, token);
                    }
                }
                return;
            }
            Op::IndexKStore(o) => &o.keys,
            Op::KvStore(o) => &o.rows,
            _ => return,
        };
        let Some(t) = drawn.tokens else {
            return;
        };
        if !self.page_marks.stale_tokens(t.buffer) {
            return;
        }
        probes::hit(SimProbe::StaleTokensDrawn);
        // A store's full rows are one per slot, in the drawn rows' order.
        for (row, (buf, page, bit)) in drawn.rows.iter().zip(op.spec().full_rows()) {
            if row.pending_index().is_some() {
                self.page_marks.taint(buf, page, bit);
            }
        }
    }

    /// The token rows `op` writes whole, per page (`OpSpec::full_rows`); a linear copy into a
    /// paged buffer (a pitched copy's row of the runtime's `CopyStrategy::MemcpyRuns`) writes
    /// the pages it covers whole.
    pub(super) fn full_rows(&self, op: &Op) -> Vec<(BufferId, u64, u64)> {
        let Op::Copy(c) = op else {
            return op.spec().full_rows();
        };
        let desc = self.mem.desc(c.dst.buffer);
        if !desc.fingerprint.is_paged() {
            return Vec::new();
        }
        let pb = desc.fingerprint.page_bytes.max(1);
        let (start, end) = (c.dst.offset.0, c.dst.offset.0 + c.dst.bytes.0);
        (start.div_ceil(pb)..end / pb)
            .map(|p| (c.dst.buffer, p, u64::MAX))
            .collect()
    }

    /// The current side's context was recreated: every device buffer it allocated holds garbage
    /// (keyed by the side, its new generation and the buffer), every page of its paged buffers
    /// is garbage in all rows and written anew, and its unpaged buffers hold no step's tokens.
    /// Pinned host buffers keep their bytes (the host tier is host memory).
    pub(super) fn lose_device_memory(&mut self) {
        let side = self.side;
        self.contexts.generation[side] += 1;
        let generation = self.contexts.generation[side];
        probes::hit(SimProbe::FaultContextRecreated);
        self.log(&[15, 3, side as u64, generation]);
        for b in 0..self.mem.descs.len() {
            let buf = BufferId(b as u32);
            let desc = self.mem.desc(buf);
            if self.contexts.buffer_side[b] as usize != side || desc.tier != MemoryTier::Device {
                continue;
            }
            let garbage = self
                .faults
                .keyed_bits(KEY_GARBAGE, side, (generation << 32) ^ b as u64 ^ 1 << 63)
                .to_le_bytes();
            for word in self.mem.bufs[b].chunks_mut(8) {
                word.copy_from_slice(&garbage[..word.len()]);
            }
            if desc.fingerprint.is_paged() {
                let pb = desc.fingerprint.page_bytes.max(1);
                for p in 0..desc.bytes.0 / pb {
                    self.page_marks.taint(buf, p, u64::MAX);
                    self.page_marks.written(buf, p);
                }
            } else {
                self.page_marks.set_stale_tokens(buf, true);
            }
        }
    }

    /// Every paged-buffer page an op writes gets a new write generation (the content oracle's
    /// cache key).
    pub(super) fn bump_generations(&mut self, r: ByteRange) {
        let desc = self.mem.desc(r.buffer);
        if !desc.fingerprint.is_paged() {
            return;
        }
        let pb = desc.fingerprint.page_bytes.max(1);
        for p in r.start.0 / pb..r.end.0.div_ceil(pb) {
            self.page_marks.written(r.buffer, p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierkv_engine::device::args;
    use tierkv_engine::layout::PageFormat;

    /// What the executor keeps is used only while its bytes are unchanged: a row or page whose
    /// bytes changed is hashed or decoded again, whoever changed them.
    #[test]
    fn kept_entries_follow_the_bytes() {
        let mut kept = Kept::default();
        let b = BufferId(7);
        let mut row = vec![3u8; 64];
        let h = kept.row_hashes.get(b, 128, &row);
        assert_eq!(h, row_hash(&row));
        row[5] = 4;
        assert_eq!(kept.row_hashes.get(b, 128, &row), row_hash(&row));
        assert_ne!(kept.row_hashes.get(b, 128, &row), h);

        let dtype = IndexKDtype::Bf16;
        let mut page = vec![0u8; PageFormat::IndexK(dtype).page_bytes() as usize];
        page[0..2].copy_from_slice(&half::bf16::from_f32(1.5).to_bits().to_le_bytes());
        let mut pages = DecodedPages {
            buffer: b,
            kept: &mut kept.pages,
        };
        assert_eq!(pages.page(dtype, 2, &page).kt[0][0], 1.5);
        page[0..2].copy_from_slice(&half::bf16::from_f32(-2.0).to_bits().to_le_bytes());
        assert_eq!(pages.page(dtype, 2, &page).kt[0][0], -2.0);
        // Another page and another buffer are entries of their own.
        assert_eq!(pages.page(dtype, 3, &vec![0u8; page.len()]).kt[0][0], 0.0);
        assert_eq!(pages.page(dtype, 2, &page).kt[0][0], -2.0);
        let mut other = DecodedPages {
            buffer: BufferId(8),
            kept: &mut kept.pages,
        };
        assert_eq!(other.page(dtype, 2, &vec![0u8; page.len()]).kt[0][0], 0.0);
        assert_eq!(kept.pages.len(), 3);
    }

    /// The executor's kept paths write `run_op`'s very bytes, op after op, while the pools'
    /// bytes change under them (a few bytes, a whole page) and across both index-K dtypes.
    #[test]
    fn kept_paths_equal_the_reference() {
        use tierkv_engine::layout::{BufferKind, KvDtype, LayerId, LayoutFingerprint};
        let mut rng = crate::rng::Rng::new(0x5EED);
        // Small bytes: finite fp8 and bf16 values and f32 scales.
        let fill = |rng: &mut crate::rng::Rng, b: &mut [u8]| {
            b.iter_mut().for_each(|x| *x = rng.below(0x38) as u8)
        };
        let pool = |mem: &mut Memory, kind, format: PageFormat, pages: u64| {
            mem.alloc(BufferDesc {
                role: BufferRole::Pool {
                    kind,
                    layer: LayerId(0),
                },
                tier: MemoryTier::Device,
                bytes: Bytes(pages * format.page_bytes()),
                fingerprint: format.fingerprint(),
            })
        };
        let scratch = |mem: &mut Memory, bytes: u64| {
            let buffer = mem.alloc(BufferDesc {
                role: BufferRole::Scratch { name: "test" },
                tier: MemoryTier::Device,
                bytes: Bytes(bytes),
                fingerprint: LayoutFingerprint::unpaged(bytes),
            });
            Region {
                buffer,
                offset: Bytes::ZERO,
                bytes: Bytes(bytes),
            }
        };
        let tags = RowTags {
            layer_global: 0,
            rows: vec![
                RowTag {
                    request: 0,
                    position: 0
                };
                2
            ]
            .into(),
        };
        for dtype in [IndexKDtype::Fp8, IndexKDtype::Bf16] {
            let (heads, pages, pt_stride) = (3u32, 6u64, 5u32);
            let mut mem = Memory::default();
            let ik = pool(
                &mut mem,
                BufferKind::IndexK,
                PageFormat::IndexK(dtype),
                pages,
            );
            let kv_format = PageFormat::Kv(KvDtype::Fp8Packed);
            let kv = pool(&mut mem, BufferKind::Kv, kv_format, pages);
            let (q, w) = (scratch(&mut mem, 2 * 3 * 128), scratch(&mut mem, 2 * 3 * 4));
            let (out, sel, digests) = (
                scratch(&mut mem, 2 * 320 * 4),
                scratch(&mut mem, 2 * 16 * 4),
                scratch(&mut mem, 2 * 8),
            );
            for b in [ik, kv, q.buffer, w.buffer] {
                fill(&mut rng, &mut mem.bufs[b.0 as usize]);
            }
            let slots: Vec<u8> = (0..32)
                .flat_map(|_| (rng.below(pages * 64) as i32).to_le_bytes())
                .collect();
            mem.bufs[sel.buffer.0 as usize].copy_from_slice(&slots);
            let page_table: Vec<i32> = (0..2 * pt_stride)
                .map(|_| rng.below(pages) as i32)
                .collect();
            let logits = Op::IndexLogits(IndexLogits {
                args: args::IndexLogits {
                    dtype,
                    heads,
                    page_table: page_table.clone().into(),
                    pt_stride,
                    context_lens: vec![100, 300].into(),
                    out_stride: 320,
                },
                q,
                w,
                k: ik,
                out,
                tags: tags.clone(),
            });
            let read = Op::SparseRead(SparseRead {
                args: args::SparseRead {
                    dtype: KvDtype::Fp8Packed,
                    rows: 2,
                    k: 16,
                },
                slots: sel,
                kv,
                page_table: page_table.into(),
                pt_stride,
                context_lens: vec![100, 300].into(),
                out: digests,
                tags: tags.clone(),
            });
            let mut exec = Executor::Cpu(Box::default());
            let mut reference = Memory {
                bufs: mem.bufs.clone(),
                descs: mem.descs.clone(),
            };
            for round in 0..4 {
                match round {
                    1 => {
                        // A few bytes of a page and of a row the ops read.
                        for b in [ik, kv] {
                            let at = rng.below(mem.bufs[b.0 as usize].len() as u64) as usize;
                            mem.bufs[b.0 as usize][at] ^= 0x11;
                            reference.bufs[b.0 as usize][at] ^= 0x11;
                        }
                    }
                    2 => {
                        let n = mem.bufs[ik.0 as usize].len();
                        fill(&mut rng, &mut mem.bufs[ik.0 as usize][..n / 2]);
                        reference.bufs[ik.0 as usize] = mem.bufs[ik.0 as usize].clone();
                    }
                    _ => {}
                }
                for op in [&logits, &read] {
                    exec.run(op, &mut mem).expect("the kept path runs");
                    run_op(op, &mut reference).expect("the reference runs");
                }
                for r in [out, digests] {
                    assert_eq!(
                        mem.region(r),
                        reference.region(r),
                        "{dtype:?} round {round}: the kept path wrote other bytes"
                    );
                }
            }
        }
    }
}
