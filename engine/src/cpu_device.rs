//! Running ops on host memory with the kernels' CPU references ([`run_op`]), shared by the in-order
//! CPU device below and the simulator's GPU; and [`InOrderDevice`], which runs each op the moment it
//! is enqueued — every stream is then trivially ordered, so it is for unit tests of the engine's
//! logic, not of its ordering (the simulator adds the interleavings).

use crate::device::*;
use crate::layout::{BufferKind, Bytes};
use tierkv_kernels::cpu;

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
    pub fn region(&self, r: Region) -> &[u8] {
        &self.bufs[r.buffer.0 as usize][r.offset as usize..(r.offset + r.bytes) as usize]
    }
    fn region_mut(&mut self, r: Region) -> &mut [u8] {
        &mut self.bufs[r.buffer.0 as usize][r.offset as usize..(r.offset + r.bytes) as usize]
    }
    /// Runs `f` with one buffer taken out mutably and the rest readable.
    fn with_mut<T>(&mut self, b: BufferId, f: impl FnOnce(&Memory, &mut [u8]) -> T) -> T {
        let mut taken = std::mem::take(&mut self.bufs[b.0 as usize]);
        let out = f(self, &mut taken);
        self.bufs[b.0 as usize] = taken;
        out
    }
}

pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
        .collect()
}
pub fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().expect("4")))
        .collect()
}
pub fn u64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
        .collect()
}
fn put<const N: usize, T: Copy>(dst: &mut [u8], vals: &[T], to: impl Fn(T) -> [u8; N]) {
    assert_eq!(dst.len(), vals.len() * N, "region size");
    for (c, v) in dst.chunks_exact_mut(N).zip(vals) {
        c.copy_from_slice(&to(*v));
    }
}

fn kerr(op: &'static str) -> impl Fn(tierkv_kernels::KernelError) -> DeviceError {
    move |e| DeviceError::Kernel {
        op,
        detail: e.to_string(),
    }
}

/// Runs one op on `mem` with the CPU references. The caller has already checked it (`check_op`).
pub fn run_op(op: &Op, mem: &mut Memory) -> Result<(), DeviceError> {
    let name = op.name();
    match op {
        Op::IndexKStore {
            dst,
            dtype,
            ue8m0,
            keys,
            gamma,
            beta,
            rope,
            slots,
            ..
        } => {
            let fp = mem.desc(*dst).fingerprint;
            let args = cpu::IndexKStoreArgs {
                dtype: *dtype,
                ue8m0: *ue8m0,
                keys,
                gamma,
                beta,
                rope,
                slots,
            };
            mem.with_mut(*dst, |_, d| cpu::index_k_store(&args, d, fp))
                .map_err(kerr(name))
        }
        Op::KvStore {
            dst,
            dtype,
            rows,
            slots,
            ..
        } => {
            let fp = mem.desc(*dst).fingerprint;
            let args = cpu::KvStoreArgs {
                dtype: *dtype,
                rows,
                slots,
            };
            mem.with_mut(*dst, |_, d| cpu::kv_store(&args, d, fp))
                .map_err(kerr(name))
        }
        Op::QPrep {
            heads,
            q,
            weights,
            rope,
            q_out,
            w_out,
        } => {
            let n = rope.len() / 64;
            let mut qo = vec![0u8; n * *heads as usize * 128];
            let mut wo = vec![0f32; n * *heads as usize];
            let args = cpu::QPrepArgs {
                heads: *heads as usize,
                q,
                weights,
                rope,
            };
            cpu::q_prep(&args, &mut qo, &mut wo).map_err(kerr(name))?;
            mem.region_mut(*q_out)[..qo.len()].copy_from_slice(&qo);
            put(
                &mut mem.region_mut(*w_out)[..wo.len() * 4],
                &wo,
                f32::to_le_bytes,
            );
            Ok(())
        }
        Op::IndexLogits {
            dtype,
            heads,
            q,
            w,
            k,
            page_table,
            pt_stride,
            context_lens,
            out,
            out_stride,
            ..
        } => {
            let rows = context_lens.len();
            let h = *heads as usize;
            let qb = mem.region(*q)[..rows * h * 128].to_vec();
            let wv = f32s(&mem.region(*w)[..rows * h * 4]);
            let args = cpu::IndexLogitsArgs {
                dtype: *dtype,
                heads: h,
                q: &qb,
                weights: &wv,
                page_table,
                pt_stride: *pt_stride as usize,
                context_lens,
                out_stride: *out_stride as usize,
            };
            let mut o = vec![0f32; rows * *out_stride as usize];
            cpu::index_logits(&args, mem.bytes(*k), mem.desc(*k).fingerprint, &mut o)
                .map_err(kerr(name))?;
            put(
                &mut mem.region_mut(*out)[..o.len() * 4],
                &o,
                f32::to_le_bytes,
            );
            Ok(())
        }
        Op::TopK {
            k,
            logits,
            stride,
            context_lens,
            page_table,
            pt_stride,
            out,
        } => {
            let rows = context_lens.len();
            let lv = f32s(&mem.region(*logits)[..rows * *stride as usize * 4]);
            let args = cpu::TopKArgs {
                k: *k as usize,
                logits: &lv,
                stride: *stride as usize,
                context_lens,
                page_table,
                pt_stride: *pt_stride as usize,
            };
            let mut o = vec![0i32; rows * *k as usize];
            cpu::topk(&args, &mut o).map_err(kerr(name))?;
            put(
                &mut mem.region_mut(*out)[..o.len() * 4],
                &o,
                i32::to_le_bytes,
            );
            Ok(())
        }
        Op::SparseRead {
            dtype,
            k,
            slots,
            kv,
            context_lens,
            out,
            ..
        } => {
            let rows = context_lens.len();
            let sv = i32s(&mem.region(*slots)[..rows * *k as usize * 4]);
            let args = cpu::SparseReadArgs {
                dtype: *dtype,
                k: *k as usize,
                slots: &sv,
            };
            let mut o = vec![0u64; rows];
            cpu::sparse_read(&args, mem.bytes(*kv), mem.desc(*kv).fingerprint, &mut o)
                .map_err(kerr(name))?;
            put(
                &mut mem.region_mut(*out)[..o.len() * 8],
                &o,
                u64::to_le_bytes,
            );
            Ok(())
        }
        Op::PageCopy {
            src,
            src_view,
            dst,
            dst_view,
            runs,
        } => {
            assert_ne!(
                src, dst,
                "page_copy within one buffer is not an engine operation"
            );
            mem.with_mut(*dst, |m, d| {
                cpu::page_copy(m.bytes(*src), src_view, d, dst_view, runs)
            })
            .map_err(kerr(name))
        }
        Op::Copy { src, dst } => {
            assert_eq!(src.bytes, dst.bytes, "copy sizes");
            let data = mem.region(*src).to_vec();
            mem.region_mut(*dst).copy_from_slice(&data);
            Ok(())
        }
    }
}

/// A device that runs every op at once, in enqueue order, with the CPU references. Events are done
/// as soon as they are recorded. Faults can be injected into copies for tests of failure handling.
#[derive(Debug, Default)]
pub struct InOrderDevice {
    pub mem: Memory,
    events: Vec<EventState>,
    /// Copies (PageCopy) to fail from now on, counted down.
    pub fail_next_copies: u32,
    /// Whether any op failed since the last record, per stream.
    failed_since_record: [bool; 3],
    /// Ops run, by name (tests look at what happened).
    pub log: Vec<&'static str>,
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
    /// Raw view of a buffer, for tests.
    pub fn peek(&self, b: BufferId) -> &[u8] {
        self.mem.bytes(b)
    }
    pub fn buffers_of(&self, kind: BufferKind) -> Vec<BufferId> {
        (0..self.mem.descs.len() as u32)
            .map(BufferId)
            .filter(|b| match self.mem.desc(*b).role {
                BufferRole::Pool { kind: k, .. } | BufferRole::Mirror { kind: k } => k == kind,
                BufferRole::Scratch { .. } => false,
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
    fn new_event(&mut self) -> EventId {
        self.events.push(EventState::Done);
        EventId(self.events.len() as u32 - 1)
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) {
        let failed = std::mem::take(&mut self.failed_since_record[stream.index()]);
        self.events[ev.0 as usize] = if failed {
            EventState::Failed
        } else {
            EventState::Done
        };
    }
    fn wait(&mut self, _stream: StreamKind, _ev: EventId) {}
    fn query(&mut self, ev: EventId) -> EventState {
        self.events[ev.0 as usize]
    }
    fn synchronize(&mut self, ev: EventId) -> EventState {
        self.events[ev.0 as usize]
    }
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError> {
        check_op(&op, |b| self.mem.desc(b))?;
        self.log.push(op.name());
        if matches!(op, Op::PageCopy { .. }) && self.fail_next_copies > 0 {
            self.fail_next_copies -= 1;
            self.failed_since_record[stream.index()] = true;
            return Ok(());
        }
        run_op(&op, &mut self.mem)
    }
    fn host_read(&mut self, buf: BufferId, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        check_host_access("host_read", buf, self.mem.desc(buf), offset, out.len())?;
        out.copy_from_slice(&self.mem.bytes(buf)[offset as usize..offset as usize + out.len()]);
        Ok(())
    }
    fn host_write(&mut self, buf: BufferId, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        check_host_access("host_write", buf, self.mem.desc(buf), offset, data.len())?;
        self.mem.bufs[buf.0 as usize][offset as usize..offset as usize + data.len()]
            .copy_from_slice(data);
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
