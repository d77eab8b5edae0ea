//! The device pool (per layer one MLA KV buffer and one index-K buffer, paged) and the host mirror
//! (`layer_first` or `page_first`), both built from one `Layout`, each with a page allocator.

use crate::device::{BufferDesc, BufferId, BufferRole, Device, DeviceError, MemoryTier};
use crate::layout::{BufferKind, Bytes, LayerId, Layout, PageId, PagedView};

/// Hands out page ids; LIFO so reuse is immediate (which is what exposes use-after-free).
#[derive(Clone, Debug)]
pub struct PageAllocator {
    free: Vec<u32>,
    in_use: Vec<bool>,
}

impl PageAllocator {
    pub fn new(pages: u32) -> Self {
        PageAllocator {
            free: (0..pages).rev().collect(),
            in_use: vec![false; pages as usize],
        }
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
    pub fn is_used(&self, p: PageId) -> bool {
        self.in_use[p.index()]
    }
}

/// The device pool.
#[derive(Debug)]
pub struct DevicePool {
    pub kv: Vec<BufferId>,
    pub index_k: Vec<BufferId>,
    pub pages: PageAllocator,
}

/// The pinned-host mirror.
#[derive(Debug)]
pub struct HostPool {
    pub kv: BufferId,
    pub index_k: BufferId,
    pub pages: PageAllocator,
    /// The layout the mirror was built from (equal to the engine's, except under the mutants that
    /// re-create incidents 1 and 4).
    pub layout: Layout,
}

#[derive(Debug)]
pub struct Pools {
    pub layout: Layout,
    pub device: DevicePool,
    pub host: HostPool,
}

impl Pools {
    /// Allocates every pool buffer from `layout` (`host_layout` differs from it only under mutants).
    pub fn new<D: Device>(
        dev: &mut D,
        layout: Layout,
        host_layout: Layout,
    ) -> Result<Pools, DeviceError> {
        let mut kv = Vec::new();
        let mut index_k = Vec::new();
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
                    BufferKind::Kv => kv.push(id),
                    BufferKind::IndexK => index_k.push(id),
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
        let host_ik = mirror(BufferKind::IndexK)?;
        Ok(Pools {
            layout,
            device: DevicePool {
                kv,
                index_k,
                pages: PageAllocator::new(layout.device_pages()),
            },
            host: HostPool {
                kv: host_kv,
                index_k: host_ik,
                pages: PageAllocator::new(host_layout.host_pages()),
                layout: host_layout,
            },
        })
    }

    pub fn device_buffer(&self, kind: BufferKind, layer: LayerId) -> BufferId {
        match kind {
            BufferKind::Kv => self.device.kv[layer.index()],
            BufferKind::IndexK => self.device.index_k[layer.index()],
        }
    }
    pub fn device_side(&self, kind: BufferKind, layer: LayerId) -> (BufferId, PagedView) {
        (
            self.device_buffer(kind, layer),
            self.layout.device_layer_view(kind),
        )
    }
    pub fn host_side(&self, kind: BufferKind, layer: LayerId) -> (BufferId, PagedView) {
        let b = match kind {
            BufferKind::Kv => self.host.kv,
            BufferKind::IndexK => self.host.index_k,
        };
        (b, self.host.layout.host_layer_view(kind, layer))
    }
    pub fn host_bytes(&self) -> Bytes {
        self.host.layout.host_total_bytes()
    }
}
