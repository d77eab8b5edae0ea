//! The in-order CPU device's injected copy failures (`InOrderDevice::fail_next_copies`): each
//! failed copy moves nothing and fails the next event its stream records; the count runs down,
//! and the copies after it move their bytes. And its host accesses: pinned memory only, inside
//! the buffer.

use tierkv_engine::cpu_device::InOrderDevice;
use tierkv_engine::device::*;
use tierkv_engine::layout::*;

/// One layer, 4 device pages and 8 host pages.
fn layout() -> Layout {
    Layout::new(LayoutParams {
        layers: 1,
        layer_base: 0,
        index_n_heads: 1,
        index_k_dtype: IndexKDtype::Bf16,
        kv_dtype: KvDtype::Fp8Packed,
        device_pages: 4,
        host_pages: 8,
        host_layout: HostLayout::LayerFirst,
    })
    .unwrap()
}

#[test]
fn injected_copy_failures_fail_their_event_and_run_out() {
    let l = layout();
    let kind = BufferKind::Kv;
    let mut dev = InOrderDevice::default();
    let mut buffer = |role, tier, bytes| {
        dev.alloc(BufferDesc {
            role,
            tier,
            bytes,
            fingerprint: l.fingerprint(kind),
        })
        .unwrap()
    };
    let host = buffer(
        BufferRole::Mirror { kind },
        MemoryTier::PinnedHost,
        l.host_bytes(kind),
    );
    let pool = buffer(
        BufferRole::Pool {
            kind,
            layer: LayerId(0),
        },
        MemoryTier::Device,
        l.device_layer_bytes(kind),
    );
    let src: Vec<u8> = (0..l.host_bytes(kind).0)
        .map(|i| (i % 251) as u8 + 1)
        .collect();
    dev.host_write(host, Bytes(0), &src).unwrap();
    let load = |page: u32| {
        Op::PageCopy(PageCopy {
            src: host,
            src_view: l.host_layer_view(kind, LayerId(0)),
            dst: pool,
            dst_view: l.device_layer_view(kind),
            runs: coalesce_runs(&[(PageId(page), PageId(page))]),
        })
    };
    let before = dev.mem.bytes(pool).to_vec();
    dev.fail_next_copies = 2;
    let mut states = Vec::new();
    for page in 0..3 {
        dev.enqueue(StreamKind::Load, load(page)).unwrap();
        let ev = dev.new_event().unwrap();
        dev.record(StreamKind::Load, ev).unwrap();
        states.push(dev.synchronize(ev));
    }
    assert_eq!(
        states,
        [EventState::Failed, EventState::Failed, EventState::Done],
        "two injected failures, then a copy that runs"
    );
    assert_eq!(dev.fail_next_copies, 0);
    // Each page's bytes in the pool, and the host page it was loaded from.
    let dv = l.device_layer_view(kind);
    let hv = l.host_layer_view(kind, LayerId(0));
    let at = |v: &PagedView, page: u32| {
        let r = v.page_range(PageId(page));
        r.start as usize..r.end as usize
    };
    let after = dev.mem.bytes(pool);
    for page in 0..2 {
        assert_eq!(
            after[at(&dv, page)],
            before[at(&dv, page)],
            "failed copy {page} moved bytes"
        );
    }
    assert_eq!(
        after[at(&dv, 2)],
        src[at(&hv, 2)],
        "the copy after the failures did not move its page"
    );
}

#[test]
fn the_host_reads_and_writes_pinned_memory_only_and_inside_it() {
    let mut dev = InOrderDevice::default();
    let kind = BufferKind::Kv;
    let fingerprint = layout().fingerprint(kind);
    let pinned = (dev.alloc(BufferDesc {
        role: BufferRole::Mirror { kind },
        tier: MemoryTier::PinnedHost,
        bytes: Bytes(64),
        fingerprint,
    }))
    .unwrap();
    let device = (dev.alloc(BufferDesc {
        role: BufferRole::Pool {
            kind,
            layer: LayerId(0),
        },
        tier: MemoryTier::Device,
        bytes: Bytes(64),
        fingerprint,
    }))
    .unwrap();
    let mut out = [0u8; 16];
    dev.host_write(pinned, Bytes(48), &[7; 16]).expect("inside");
    dev.host_read(pinned, Bytes(48), &mut out).expect("inside");
    assert_eq!(out, [7; 16]);
    for e in [
        dev.host_read(device, Bytes(0), &mut out),
        dev.host_write(device, Bytes(0), &out),
    ] {
        assert!(matches!(e, Err(DeviceError::NotHostMemory { .. })), "{e:?}");
        // The message names the buffer as the simulator's findings and traces do.
        let msg = e.unwrap_err().to_string();
        assert!(msg.contains(&format!(" buf{} ", device.0)), "{msg}");
    }
    for e in [
        dev.host_read(pinned, Bytes(49), &mut out),
        dev.host_write(pinned, Bytes(u64::MAX), &out),
    ] {
        assert!(
            matches!(e, Err(DeviceError::OutOfBounds { size: 64, .. })),
            "{e:?}"
        );
    }
}
