use super::*;

/// Each stream has its own index into per-stream state, in `ALL`'s order.
#[test]
fn each_stream_has_its_own_index() {
    let got: Vec<usize> = StreamKind::ALL.iter().map(|s| s.index()).collect();
    assert_eq!(got, [0, 1, 2]);
}

#[test]
fn device_timing_adds_up_per_field_and_per_op() {
    let mut step = DeviceTiming {
        busy_ns: 5,
        stalled_ns: 7,
        launches: 13,
        launches_from_graphs: 9,
        ..DeviceTiming::default()
    };
    step.busy_by_op_ns[1] = 3;
    step.enqueue_ns[2] = 11;
    let mut sum = step;
    sum.add(&step);
    assert_eq!((sum.busy_ns, sum.stalled_ns), (10, 14));
    assert_eq!((sum.busy_by_op_ns[1], sum.enqueue_ns[2]), (6, 22));
    assert_eq!(sum.busy_by_op_ns[0] + sum.enqueue_ns[0], 0);
    assert_eq!((sum.launches, sum.launches_from_graphs), (26, 18));
}

/// Errors and reports name buffers by role.
#[test]
fn buffer_roles_are_named_for_reports() {
    let pool = BufferRole::Pool {
        kind: BufferKind::IndexK,
        layer: LayerId(3),
    };
    let mirror = BufferRole::Mirror {
        kind: BufferKind::Kv,
    };
    let scratch = BufferRole::Scratch { name: "logits" };
    let names = [pool, mirror, scratch].map(|r| r.to_string());
    assert_eq!(names[2], "scratch logits");
    assert!(
        names[0].starts_with("device ") && names[0].ends_with(" layer 3"),
        "{names:?}"
    );
    assert!(
        names[1].starts_with("host ") && names[1].ends_with(" mirror"),
        "{names:?}"
    );
    assert_ne!(
        names[0],
        BufferRole::Pool {
            kind: BufferKind::Kv,
            layer: LayerId(3)
        }
        .to_string()
    );
}

/// Top-k's `k` and the sizes of its logits and selection regions are checked at enqueue:
/// an op whose `k` and output disagree is refused, naming what was wrong.
#[test]
fn topk_k_and_its_regions_are_checked_at_enqueue() {
    use crate::layout::INDEX_TOPK_MAX;
    let region = |bytes| Region {
        buffer: BufferId(0),
        offset: Bytes::ZERO,
        bytes: Bytes(bytes),
    };
    // Two rows of 64 positions, one page each.
    let topk = |k: u32, logits: u64, out: u64| {
        Op::TopK(TopK {
            args: args::TopK {
                k,
                stride: 64,
                context_lens: vec![64, 10].into(),
                page_table: vec![0, 1].into(),
                pt_stride: 1,
            },
            logits: region(logits),
            out: region(out),
        })
    };
    let desc = |_| BufferDesc {
        role: BufferRole::Scratch { name: "scratch" },
        tier: MemoryTier::Device,
        bytes: Bytes(1 << 20),
        fingerprint: LayoutFingerprint::unpaged(1 << 20),
    };
    let refusal = |op: Op| match check_op(&op, desc) {
        Err(DeviceError::Kernel { op: "topk", detail }) => detail,
        other => panic!("expected a topk refusal, got {other:?}"),
    };
    assert_eq!(check_op(&topk(8, 2 * 64 * 4, 2 * 8 * 4), desc), Ok(()));
    let detail = refusal(topk(0, 512, 0));
    assert!(detail.contains("argument `k`: 0 is outside"), "{detail}");
    let over = INDEX_TOPK_MAX + 1;
    let detail = refusal(topk(over, 512, 2 * over as u64 * 4));
    assert!(
        detail.contains(&format!("1..={INDEX_TOPK_MAX}")),
        "{detail}"
    );
    let detail = refusal(topk(8, 2 * 64 * 4, 8 * 4));
    assert!(
        detail.contains("buffer `out` is 32 B but must be 64 B"),
        "{detail}"
    );
    let detail = refusal(topk(8, 64 * 4, 2 * 8 * 4));
    assert!(
        detail.contains("buffer `logits` is 256 B but must be 512 B"),
        "{detail}"
    );
}
