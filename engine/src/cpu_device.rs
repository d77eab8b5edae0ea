//! Running ops on host memory with the kernels' CPU references ([`run_op`]), shared by the in-order
//! CPU device below and the simulator's GPU; and [`InOrderDevice`], which runs each op the moment it
//! is enqueued — every stream is then trivially ordered, so it is for unit tests of the engine's
//! logic, not of its ordering (the simulator adds the interleavings).

use crate::device::op::kernel_refusal;
use crate::device::*;
use crate::layout::{f32_bytes, f32_count, i32_bytes, i32_count, u64_bytes, BufferKind, Bytes};
use std::borrow::Cow;
use tierkv_kernels::cpu;
use tierkv_kernels::cpu::draw;
use tierkv_kernels::cpu::numerics::{le_f32s, le_i32s, le_u32s, le_u64s};

/// Buffers as plain bytes, indexed by `BufferId`.
#[derive(Default, Debug)]
pub struct Memory {
    pub bufs: Vec<Vec<u8>>,
    pub descs: Vec<BufferDesc>,
}

/// The byte that fills fresh buffers, so unwritten memory never passes for data (never zeros).
pub const POISON: u8 = 0xCB;

impl Memory {
    pub fn alloc(&mut self, desc: BufferDesc) -> BufferId {
        let id = BufferId(self.bufs.len() as u32);
        self.bufs.push(vec![POISON; desc.bytes.usize()]);
        self.descs.push(desc);
        id
    }
    pub fn desc(&self, b: BufferId) -> BufferDesc {
        self.descs[b.0 as usize]
    }
    pub fn bytes(&self, b: BufferId) -> &[u8] {
        &self.bufs[b.0 as usize]
    }
    pub fn range(&self, r: ByteRange) -> &[u8] {
        &self.bufs[r.buffer.0 as usize][r.span()]
    }
    pub fn range_mut(&mut self, r: ByteRange) -> &mut [u8] {
        &mut self.bufs[r.buffer.0 as usize][r.span()]
    }
    pub fn region(&self, r: Region) -> &[u8] {
        self.range(r.range())
    }
    /// The first `bytes` of a region (a launch may use less of a scratch region than it spans).
    fn head(&self, r: Region, bytes: Bytes) -> &[u8] {
        assert!(bytes <= r.bytes, "{bytes} B of a {} B region", r.bytes);
        self.range(ByteRange::new(r.buffer, r.offset, bytes))
    }
    fn head_mut(&mut self, r: Region, bytes: Bytes) -> &mut [u8] {
        assert!(bytes <= r.bytes, "{bytes} B of a {} B region", r.bytes);
        self.range_mut(ByteRange::new(r.buffer, r.offset, bytes))
    }
    /// Runs `f` with one buffer taken out mutably and the rest readable.
    fn with_mut<T>(&mut self, b: BufferId, f: impl FnOnce(&Memory, &mut [u8]) -> T) -> T {
        let mut taken = std::mem::take(&mut self.bufs[b.0 as usize]);
        let out = f(self, &mut taken);
        self.bufs[b.0 as usize] = taken;
        out
    }
}

fn put<const N: usize, T: Copy>(dst: &mut [u8], vals: &[T], to: impl Fn(T) -> [u8; N]) {
    assert_eq!(dst.len(), vals.len() * N, "region size");
    for (c, v) in dst.chunks_exact_mut(N).zip(vals) {
        c.copy_from_slice(&to(*v));
    }
}

/// Runs one op on `mem` with the CPU references. The caller has already checked it (`check_op`).
pub fn run_op(op: &Op, mem: &mut Memory) -> Result<(), DeviceError> {
    let r = match op {
        Op::IndexKStore(o) => index_k_store(o, mem),
        Op::KvStore(o) => kv_store(o, mem),
        Op::QPrep(o) => q_prep(o, mem),
        Op::IndexLogits(o) => index_logits(o, mem),
        Op::TopK(o) => topk(o, mem),
        Op::SparseRead(o) => sparse_read(o, mem),
        Op::PageCopy(o) => page_copy(o, mem),
        Op::Copy(o) => {
            let data = mem.region(o.src).to_vec();
            mem.range_mut(o.dst.range()).copy_from_slice(&data);
            Ok(())
        }
        Op::NextTokens(o) => next_tokens(o, mem),
    };
    r.map_err(kernel_refusal(op.name()))
}

type KError = tierkv_kernels::KernelError;
type KResult = Result<(), KError>;

/// Positions past this are computed per op rather than kept (64 MiB of rows a thread).
const ROPE_MEMO_POSITIONS: u32 = 1 << 18;

thread_local! {
    /// The RoPE rows of positions `0..len` of the last model seen on this thread: the CPU
    /// device's counterpart of the CUDA device's table (every layer stores the same positions,
    /// and a simulation runs one model per thread at a time).
    static ROPE_MEMO: std::cell::RefCell<(Option<Rope>, Vec<[f32; 64]>)> =
        const { std::cell::RefCell::new((None, Vec::new())) };
}

/// The RoPE rows of the drawn rows' positions (`rope.rows`), each row computed once per thread
/// and model.
fn rope_rows(rope: &Rope, d: &Drawn) -> Vec<f32> {
    let max = d.rows.iter().map(|t| t.position).max().unwrap_or(0);
    if max >= ROPE_MEMO_POSITIONS {
        return rope.rows(d.rows.iter().map(|t| t.position));
    }
    ROPE_MEMO.with(|m| {
        let (memo_of, rows) = &mut *m.borrow_mut();
        if *memo_of != Some(*rope) {
            *memo_of = Some(*rope);
            rows.clear();
        }
        for p in rows.len() as u32..=max {
            rows.push(rope.row(p));
        }
        let mut out = Vec::with_capacity(d.rows.len() * 64);
        for t in d.rows.iter() {
            out.extend_from_slice(&rows[t.position as usize]);
        }
        out
    })
}

/// The drawn rows with every pending token read from the op's tokens region.
fn resolved<'a>(d: &'a Drawn, mem: &Memory) -> Result<Cow<'a, [TokenAt]>, KError> {
    match d.tokens {
        None => Ok(Cow::Borrowed(&d.rows)),
        Some(t) => draw::resolve_pending(&d.rows, &le_u32s(mem.region(t))).map(Cow::Owned),
    }
}

/// The arguments of a draw of `d`'s rows.
fn draw_args<'a>(d: &Drawn, rows: &'a [TokenAt]) -> draw::DrawArgs<'a> {
    draw::DrawArgs {
        seed: d.seed,
        layer: d.layer,
        rows,
    }
}

fn next_tokens(o: &NextTokens, mem: &mut Memory) -> KResult {
    let digests = le_u64s(mem.region(o.digests));
    let tokens = draw::next_tokens(&o.args, &digests)?;
    put(mem.range_mut(o.out.range()), &tokens, u32::to_le_bytes);
    Ok(())
}

fn index_k_store(o: &IndexKStore, mem: &mut Memory) -> KResult {
    let fp = mem.desc(o.dst).fingerprint;
    let rows = resolved(&o.keys, mem)?;
    let keys = draw::index_keys(&draw_args(&o.keys, &rows));
    let rope = rope_rows(&o.rope, &o.keys);
    let x = cpu::IndexKStoreInputs {
        keys: &keys,
        gamma: &o.gamma,
        beta: &o.beta,
        rope: &rope,
    };
    mem.with_mut(o.dst, |_, d| cpu::index_k_store(&o.args, &x, d, fp))
}

fn kv_store(o: &KvStore, mem: &mut Memory) -> KResult {
    let fp = mem.desc(o.dst).fingerprint;
    let drawn = resolved(&o.rows, mem)?;
    let rows = draw::kv_rows(&draw_args(&o.rows, &drawn));
    mem.with_mut(o.dst, |_, d| cpu::kv_store(&o.args, &rows, d, fp))
}

fn q_prep(o: &QPrep, mem: &mut Memory) -> KResult {
    let heads = o.args.heads;
    let [_, _, _, (_, q_out), (_, w_out)] = o.args.operands();
    let mut qo = vec![0u8; q_out.usize()];
    let mut wo = vec![0f32; f32_count(w_out) as usize];
    let rows = resolved(&o.inputs, mem)?;
    let a = draw_args(&o.inputs, &rows);
    let (q, weights) = (draw::queries(&a, heads), draw::head_weights(&a, heads));
    let rope = rope_rows(&o.rope, &o.inputs);
    let x = cpu::QPrepInputs {
        q: &q,
        weights: &weights,
        rope: &rope,
    };
    cpu::q_prep(&o.args, &x, &mut qo, &mut wo)?;
    mem.head_mut(o.q_out, q_out).copy_from_slice(&qo);
    put(mem.head_mut(o.w_out, w_out), &wo, f32::to_le_bytes);
    Ok(())
}

fn index_logits(o: &IndexLogits, mem: &mut Memory) -> KResult {
    index_logits_from_pages(o, mem, &mut cpu::logits::DecodeEach::default())
}

/// `index_logits` with each page's decoded keys from `keys` (see `cpu::index_logits_from_pages`), for
/// an executor that keeps them; errors as `run_op`'s.
pub fn run_index_logits_from_pages(
    o: &IndexLogits,
    mem: &mut Memory,
    keys: &mut dyn cpu::PageKeys,
) -> Result<(), DeviceError> {
    index_logits_from_pages(o, mem, keys).map_err(kernel_refusal("index_logits"))
}

fn index_logits_from_pages(
    o: &IndexLogits,
    mem: &mut Memory,
    keys: &mut dyn cpu::PageKeys,
) -> KResult {
    let [(_, q), (_, w), _, _, (_, out)] = o.args.operands();
    let qb = mem.head(o.q, q).to_vec();
    let wv = le_f32s(mem.head(o.w, w));
    let mut out = vec![0f32; f32_count(out) as usize];
    cpu::index_logits_from_pages(
        &o.args,
        (&qb, &wv),
        mem.bytes(o.k),
        mem.desc(o.k).fingerprint,
        &mut out,
        keys,
    )?;
    put(
        mem.head_mut(o.out, f32_bytes(out.len() as u64)),
        &out,
        f32::to_le_bytes,
    );
    Ok(())
}

fn topk(o: &TopK, mem: &mut Memory) -> KResult {
    let [(_, logits), _, _, (_, out)] = o.args.operands();
    let lv = le_f32s(mem.head(o.logits, logits));
    let mut out = vec![0i32; i32_count(out) as usize];
    cpu::topk(&o.args, &lv, &mut out)?;
    put(
        mem.head_mut(o.out, i32_bytes(out.len() as u64)),
        &out,
        i32::to_le_bytes,
    );
    Ok(())
}

fn sparse_read(o: &SparseRead, mem: &mut Memory) -> KResult {
    sparse_read_hashed(o, mem, &mut |_, row| cpu::row_hash(row))
}

/// `sparse_read` with its rows' hashes from `hash(offset, row)` (see
/// `cpu::sparse_read_hashed`), for an executor that memoizes them; errors as `run_op`'s.
pub fn run_sparse_read_hashed(
    o: &SparseRead,
    mem: &mut Memory,
    hash: &mut dyn FnMut(usize, &[u8]) -> u64,
) -> Result<(), DeviceError> {
    sparse_read_hashed(o, mem, hash).map_err(kernel_refusal("sparse_read"))
}

fn sparse_read_hashed(
    o: &SparseRead,
    mem: &mut Memory,
    hash: &mut dyn FnMut(usize, &[u8]) -> u64,
) -> KResult {
    let [(_, slots), _] = o.args.operands();
    let sv = le_i32s(mem.head(o.slots, slots));
    let rows = o.args.rows as u64;
    let mut out = vec![0u64; rows as usize];
    cpu::sparse_read_hashed(
        &o.args,
        &sv,
        mem.bytes(o.kv),
        mem.desc(o.kv).fingerprint,
        &mut out,
        hash,
    )?;
    put(mem.head_mut(o.out, u64_bytes(rows)), &out, u64::to_le_bytes);
    Ok(())
}

fn page_copy(o: &PageCopy, mem: &mut Memory) -> KResult {
    assert_ne!(
        o.src, o.dst,
        "page_copy within one buffer is not an engine operation"
    );
    mem.with_mut(o.dst, |m, d| {
        cpu::page_copy(m.bytes(o.src), &o.src_view, d, &o.dst_view, &o.runs)
    })
}

/// A device that runs every op at once, in enqueue order, with the CPU references. Events are done
/// as soon as they are recorded. Faults can be injected into copies and kernels for tests of failure
/// handling.
#[derive(Debug, Default)]
pub struct InOrderDevice {
    pub mem: Memory,
    events: Vec<EventState>,
    /// Copies (PageCopy) to fail from now on, counted down.
    pub fail_next_copies: u32,
    /// Kernels (every op but a PageCopy) to fail from now on, counted down.
    pub fail_next_kernels: u32,
    /// Event records to refuse from now on, counted down, as a device in error refuses them
    /// (`DeviceError::InError`: the caller recovers and records again); nothing is recorded.
    pub in_error_next_records: u32,
    /// Whether any op failed since the last record, per stream.
    failed_since_record: [bool; 3],
    /// Ops run, by name (tests look at what happened).
    pub log: Vec<&'static str>,
    /// Stream waits made, in order (tests look at what happened).
    pub waits: Vec<(StreamKind, EventId)>,
    /// `recover` calls made, and whether they fail (a lost device, for tests).
    pub recoveries: u32,
    pub recover_fails: bool,
    /// For tests: each recovery moves `context_generation` on, as a recreated context's would
    /// (the memory is kept: the generation alone says it was lost).
    pub recover_recreates: bool,
    generation: u64,
}

impl InOrderDevice {
    pub fn new() -> Self {
        Self::default()
    }
    /// Total bytes allocated on each tier.
    pub fn allocated(&self, tier: MemoryTier) -> Bytes {
        Bytes(
            self.mem
                .descs
                .iter()
                .filter(|d| d.tier == tier)
                .map(|d| d.bytes.0)
                .sum(),
        )
    }
    pub fn buffers_of(&self, kind: BufferKind) -> Vec<BufferId> {
        (0..self.mem.descs.len() as u32)
            .map(BufferId)
            .filter(|b| match self.mem.desc(*b).role {
                BufferRole::Pool { kind: k, .. } | BufferRole::Mirror { kind: k } => k == kind,
                BufferRole::Scratch { .. } | BufferRole::OffloadHost { .. } => false,
            })
            .collect()
    }
}

impl Device for InOrderDevice {
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError> {
        Ok(self.mem.alloc(desc))
    }
    fn desc(&self, buf: BufferId) -> BufferDesc {
        self.mem.desc(buf)
    }
    fn new_event(&mut self) -> Result<EventId, DeviceError> {
        self.events.push(EventState::Done);
        Ok(EventId(self.events.len() as u32 - 1))
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        if self.in_error_next_records > 0 {
            self.in_error_next_records -= 1;
            return Err(DeviceError::InError {
                cause: DeviceFault::Failed {
                    op: "record",
                    stream,
                },
            });
        }
        let failed = std::mem::take(&mut self.failed_since_record[stream.index()]);
        self.events[ev.0 as usize] = if failed {
            EventState::Failed
        } else {
            EventState::Done
        };
        Ok(())
    }
    fn wait(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.waits.push((stream, ev));
        Ok(())
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        self.recoveries += 1;
        if self.recover_fails {
            return Err(DeviceError::Backend {
                detail: "injected: the device is lost".into(),
            });
        }
        if self.recover_recreates {
            self.generation += 1;
        }
        // A failure here is the failed op's alone (`fail_next_copies`, `fail_next_kernels`):
        // nothing stays broken.
        Ok(())
    }
    fn context_generation(&self) -> u64 {
        // Its faults are the failed op's alone: nothing is recreated unless a test says so.
        self.generation
    }
    fn query(&mut self, ev: EventId) -> EventState {
        self.events[ev.0 as usize]
    }
    fn synchronize(&mut self, ev: EventId) -> EventState {
        self.events[ev.0 as usize]
    }
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError> {
        check_op(&op, |b| self.mem.desc(b))?;

        self.log.push(op.name());
        let fail = match op {
            Op::PageCopy(_) => &mut self.fail_next_copies,
            _ => &mut self.fail_next_kernels,
        };
        if *fail > 0 {
            *fail -= 1;
            self.failed_since_record[stream.index()] = true;
            return Ok(());
        }
        run_op(&op, &mut self.mem)
    }
    fn host_read(
        &mut self,
        buf: BufferId,
        offset: Bytes,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        check_host_access("host_read", buf, self.mem.desc(buf), offset, out.len())?;
        let r = ByteRange::new(buf, offset, Bytes(out.len() as u64));
        out.copy_from_slice(self.mem.range(r));
        Ok(())
    }
    fn host_write(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        check_host_access("host_write", buf, self.mem.desc(buf), offset, data.len())?;
        let r = ByteRange::new(buf, offset, Bytes(data.len() as u64));
        self.mem.range_mut(r).copy_from_slice(data);
        Ok(())
    }
}

/// A clock that only moves when told to (tests).
#[derive(Debug, Default)]
pub struct ManualClock(pub std::cell::Cell<u64>);

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{BufferDesc, BufferRole, MemoryTier};
    use crate::layout::LayoutFingerprint;

    fn desc(tier: MemoryTier, bytes: u64) -> BufferDesc {
        BufferDesc {
            role: BufferRole::Scratch { name: "test" },
            tier,
            bytes: Bytes(bytes),
            fingerprint: LayoutFingerprint::unpaged(bytes),
        }
    }

    #[test]
    fn allocated_counts_each_tier_apart() {
        let mut d = InOrderDevice::new();
        Device::alloc(&mut d, desc(MemoryTier::Device, 100)).unwrap();
        Device::alloc(&mut d, desc(MemoryTier::Device, 28)).unwrap();
        Device::alloc(&mut d, desc(MemoryTier::PinnedHost, 7)).unwrap();
        assert_eq!(d.allocated(MemoryTier::Device), Bytes(128));
        assert_eq!(d.allocated(MemoryTier::PinnedHost), Bytes(7));
    }

    #[test]
    fn a_manual_clock_reads_what_it_was_set_to() {
        let c = ManualClock::default();
        assert_eq!(c.now_ns(), 0);
        c.0.set(1234);
        assert_eq!(c.now_ns(), 1234);
    }

    /// Host writes land in pinned memory, at their offset, and read back.
    #[test]
    fn host_writes_read_back() {
        let mut d = InOrderDevice::new();
        let b = Device::alloc(&mut d, desc(MemoryTier::PinnedHost, 16)).unwrap();
        d.host_write(b, Bytes(4), &[1, 2, 3]).unwrap();
        d.host_write(b, Bytes(0), &[9; 4]).unwrap();
        d.host_write(b, Bytes(7), &[8; 1]).unwrap();
        let mut out = [0u8; 5];
        d.host_read(b, Bytes(3), &mut out).unwrap();
        assert_eq!(out, [9, 1, 2, 3, 8]);
    }

    /// The per-thread memo of RoPE rows answers each model its own rows: a thread that runs
    /// one model's ops and then another's (the simulator's workers run seed after seed) gets
    /// the second model's rows, not the first's kept.
    #[test]
    fn rope_rows_follow_the_model_on_one_thread() {
        use tierkv_kernels::rope::RopeParams;
        let drawn = |positions: &[u32]| Drawn {
            seed: 0,
            layer: 0,
            rows: positions
                .iter()
                .map(|&position| TokenAt { token: 1, position })
                .collect(),
            tokens: None,
        };
        let one = Rope::new(&RopeParams::deepseek_v32(4096));
        let other = Rope::new(&RopeParams {
            theta: 50_000.0,
            ..RopeParams::deepseek_v32(4096)
        });
        assert_ne!(one, other);
        for rope in [one, other, one] {
            for positions in [&[3, 0, 70][..], &[200, 5]] {
                assert_eq!(
                    rope_rows(&rope, &drawn(positions)),
                    rope.rows(positions.iter().copied()),
                    "{positions:?}"
                );
            }
        }
    }
}
