//! The device pool (per layer one MLA KV buffer and one index-K buffer, paged) and the host mirror
//! (`layer_first` or `page_first`), both built from one `Layout`, each with a page allocator.
//!
//! The pool buffers are private. Two doors lead to them, and the types keep them apart:
//! - the model step reads and writes a layer's buffers through `Pools::gated`, which takes a
//!   `Gated` proof that only the layer gate makes, after the compute stream waited for the
//!   layer's loads (`gate.rs`);
//! - the cache controller moves whole pages between tiers through [`PoolSide`]s, whose buffer no
//!   one can take out: the only thing a side does is become one end of a `PageCopy`.

use crate::device::{BufferDesc, BufferId, BufferRole, Device, DeviceError, MemoryTier, Op};
use crate::gate::Gated;
use crate::layout::{BufferKind, LayerId, Layout, PageId, PageRun, PagedView};
use crate::mutants::Mutants;
use crate::probe::{self, Probe};

/// Injected allocation faults (FoundationDB's BUGGIFY): the simulator has a share of page
/// allocations refused as if the tier were full, which drives the engine through its "no room"
/// paths at any moment of a run, not only when a pool really fills. Off by default (production):
/// then an allocation pays one branch on an empty `Option`. The draws come from their own
/// seeded generator (not a source of randomness the engine could observe otherwise), so a run
/// stays a function of its seed. Not yet behind a feature as the mutants are.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineFaults {
    /// Seeds the draws (one generator per tier).
    pub seed: u64,
    /// Probability that a device-page allocation is refused.
    pub device_pages_refused_rate: f64,
    /// Probability that a host-page allocation is refused.
    pub host_pages_refused_rate: f64,
}

/// An allocator's injected refusals: a splitmix64 generator and a rate.
#[derive(Clone, Copy, Debug)]
struct Refusals {
    state: u64,
    rate: f64,
    probe: Probe,
}

impl Refusals {
    fn fire(&mut self) -> bool {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = tierkv_kernels::cpu::numerics::mix64(self.state);
        ((z >> 11) as f64 / (1u64 << 53) as f64) < self.rate
    }
}

/// Hands out page ids; LIFO so reuse is immediate (which is what exposes use-after-free).
#[derive(Clone, Debug)]
pub struct PageAllocator {
    free: Vec<u32>,
    in_use: Vec<bool>,
    refusals: Option<Refusals>,
}

impl PageAllocator {
    pub fn new(pages: u32) -> Self {
        PageAllocator {
            free: (0..pages).rev().collect(),
            in_use: vec![false; pages as usize],
            refusals: None,
        }
    }
    /// Refuses a share `rate` of the allocations from now on (none when `rate` is 0), drawn
    /// from `seed`; each refusal hits `probe`.
    fn refuse(&mut self, seed: u64, rate: f64, probe: Probe) {
        self.refusals = (rate > 0.0).then_some(Refusals {
            state: seed,
            rate,
            probe,
        });
    }
    pub fn capacity(&self) -> u32 {
        self.in_use.len() as u32
    }
    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }
    pub fn used_count(&self) -> u32 {
        self.capacity() - self.free_count()
    }
    /// `n` pages, or none at all.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<PageId>> {
        if n > self.free.len() {
            return None;
        }
        if let Some(r) = &mut self.refusals {
            if n > 0 && r.fire() {
                probe::hit(r.probe);
                return None;
            }
        }
        let pages: Vec<PageId> = (0..n)
            .map(|_| {
                let p = self.free.pop().expect("counted");
                assert!(!self.in_use[p as usize], "page {p} handed out twice");
                self.in_use[p as usize] = true;
                PageId(p)
            })
            .collect();
        Some(pages)
    }
    pub fn free(&mut self, pages: &[PageId]) {
        for p in pages {
            assert!(self.in_use[p.index()], "page {p} freed twice");
            self.in_use[p.index()] = false;
            self.free.push(p.0);
        }
    }
}

/// One side of a page transfer: a pool buffer and where its pages are. The buffer stays inside:
/// [`PoolSide::copy_to`] is the only thing a side is good for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolSide {
    buffer: BufferId,
    view: PagedView,
}

impl PoolSide {
    /// Where the side's pages are, and their format.
    pub fn view(&self) -> PagedView {
        self.view
    }
    /// Mutants 1 and 4's point: the copy takes `src`'s item size for this side too. The clean
    /// engine's copy sees the side as it is.
    pub(crate) fn as_copied_from(self, src: &PoolSide, mutants: Mutants) -> PoolSide {
        if !mutants.copy_trusts_source_size() {
            return self;
        }
        let mut view = self.view;
        view.fingerprint = src.view.fingerprint;
        PoolSide { view, ..self }
    }
    /// The op that copies `runs` of pages from this side to `dst`.
    pub fn copy_to(self, dst: PoolSide, runs: Vec<PageRun>) -> Op {
        Op::PageCopy(crate::device::PageCopy {
            src: self.buffer,
            src_view: self.view,
            dst: dst.buffer,
            dst_view: dst.view,
            runs,
        })
    }
}

/// The device pool and the pinned-host mirror.
#[derive(Debug)]
pub struct Pools {
    layout: Layout,
    /// The zoo's switches (empty in production builds): mutants 1 and 4 size the mirror wrongly.
    mutants: Mutants,
    device_kv: Vec<BufferId>,
    device_index_k: Vec<BufferId>,
    host_kv: BufferId,
    host_index_k: BufferId,
    pub device_pages: PageAllocator,
    pub host_pages: PageAllocator,
}

impl Pools {
    /// Injects allocation refusals at `faults`' rates from now on (zero rates: none).
    pub fn inject(&mut self, faults: EngineFaults) {
        self.device_pages.refuse(
            faults.seed ^ 0xD0,
            faults.device_pages_refused_rate,
            Probe::FaultDevicePagesRefused,
        );
        self.host_pages.refuse(
            faults.seed ^ 0x05,
            faults.host_pages_refused_rate,
            Probe::FaultHostPagesRefused,
        );
    }

    /// Allocates every pool buffer from `layout` (the mirror from `mutants.host_layout(layout)`,
    /// which is `layout` itself on the clean engine).
    pub fn new<D: Device>(
        dev: &mut D,
        layout: Layout,
        mutants: Mutants,
    ) -> Result<Pools, DeviceError> {
        let host_layout = mutants.host_layout(layout);
        let mut device_kv = Vec::new();
        let mut device_index_k = Vec::new();
        for l in 0..layout.layers() {
            for kind in BufferKind::ALL {
                let id = dev.alloc(BufferDesc {
                    role: BufferRole::Pool {
                        kind,
                        layer: LayerId(l),
                    },
                    tier: MemoryTier::Device,
                    bytes: layout.device_layer_bytes(kind),
                    fingerprint: layout.fingerprint(kind),
                })?;
                match kind {
                    BufferKind::Kv => device_kv.push(id),
                    BufferKind::IndexK => device_index_k.push(id),
                }
            }
        }
        let mut mirror = |kind| {
            dev.alloc(BufferDesc {
                role: BufferRole::Mirror { kind },
                tier: MemoryTier::PinnedHost,
                bytes: host_layout.host_bytes(kind),
                fingerprint: host_layout.fingerprint(kind),
            })
        };
        let host_kv = mirror(BufferKind::Kv)?;
        let host_index_k = mirror(BufferKind::IndexK)?;
        Ok(Pools {
            layout,
            mutants,
            device_kv,
            device_index_k,
            host_kv,
            host_index_k,
            device_pages: PageAllocator::new(layout.device_pages()),
            host_pages: PageAllocator::new(host_layout.host_pages()),
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// The layout the mirror is built from: the pools' own, except under mutants 1 and 4.
    pub fn host_layout(&self) -> Layout {
        self.mutants.host_layout(self.layout)
    }

    /// A layer's buffer for the model step, behind the gate's proof that the compute stream
    /// waited for the layer's loads.
    pub(crate) fn gated(&self, g: &Gated<'_>) -> BufferId {
        let l = g.layer().index();
        match g.kind() {
            BufferKind::Kv => self.device_kv[l],
            BufferKind::IndexK => self.device_index_k[l],
        }
    }
    /// The device side of a layer's page transfers.
    pub fn device_side(&self, kind: BufferKind, layer: LayerId) -> PoolSide {
        let buffer = match kind {
            BufferKind::Kv => self.device_kv[layer.index()],
            BufferKind::IndexK => self.device_index_k[layer.index()],
        };
        PoolSide {
            buffer,
            view: self.layout.device_layer_view(kind),
        }
    }
    /// The host side of a layer's page transfers.
    pub fn host_side(&self, kind: BufferKind, layer: LayerId) -> PoolSide {
        let buffer = match kind {
            BufferKind::Kv => self.host_kv,
            BufferKind::IndexK => self.host_index_k,
        };
        PoolSide {
            buffer,
            view: self.host_layout().host_layer_view(kind, layer),
        }
    }
}

#[cfg(test)]
mod tests;
