use super::*;
use crate::device::{BufferDesc, MemoryTier};
use crate::layout::{IndexKDtype, KvDtype, LayerId};

/// The distinct pages of the rows' contexts, ascending, by a sort: what `used_pages` answers.
fn sorted_pages(page_table: &[i32], pt_stride: u32, context_lens: &[i32]) -> Vec<u32> {
    let mut pages = Vec::new();
    for (r, &len) in context_lens.iter().enumerate() {
        let n = (len.max(0) as u32).div_ceil(PAGE_TOKENS).min(pt_stride) as usize;
        let start = r * pt_stride as usize;
        pages.extend(
            page_table[start..start + n]
                .iter()
                .filter(|&&p| p >= 0)
                .map(|&p| p as u32),
        );
    }
    pages.sort_unstable();
    pages.dedup();
    pages
}

/// Dense tables (the bitmap) and sparse ones (the sort), with shared prefixes, negative
/// entries, empty rows and entries past a row's context, against a plain sort.
#[test]
fn used_pages_are_the_distinct_pages_of_the_contexts_ascending() {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % n
    };
    for case in 0..200 {
        let (rows, stride) = (1 + next(12) as usize, 1 + next(40) as u32);
        let spread = [64, 4096, 1 << 24][case % 3];
        let prefix: Vec<i32> = (0..stride).map(|_| next(spread) as i32).collect();
        let mut table = Vec::new();
        let mut lens = Vec::new();
        for _ in 0..rows {
            for (i, &shared) in prefix.iter().enumerate() {
                table.push(match next(8) {
                    0 => -1 - next(5) as i32,
                    1..=3 if i < 4 => shared,
                    _ => next(spread) as i32,
                });
            }
            // Some contexts longer than the row (its stride bounds the pages read).
            lens.push(next(stride as u64 * PAGE_TOKENS as u64 * 2 + 2) as i32 - 1);
        }
        assert_eq!(
            used_pages(&table, stride, &lens),
            sorted_pages(&table, stride, &lens),
            "case {case}: {rows} rows of stride {stride}, pages below {spread}"
        );
    }
    assert_eq!(used_pages(&[-1, -2], 2, &[128]), Vec::<u32>::new());
    let far = [i32::MAX, 0, i32::MAX];
    assert_eq!(used_pages(&far, 3, &[192]), vec![0, i32::MAX as u32]);
    assert_eq!(used_pages(&[], 0, &[]), Vec::<u32>::new());
}

#[test]
fn a_byte_range_is_empty_when_it_holds_no_byte() {
    let buf = BufferId(0);
    assert!(ByteRange::new(buf, Bytes(8), Bytes(0)).is_empty());
    assert!(!ByteRange::new(buf, Bytes(8), Bytes(1)).is_empty());
}

/// Buffer 0: a pool of 4 pages of `fmt`; every other buffer: 1 MiB of scratch.
fn descs(fmt: PageFormat) -> impl Fn(BufferId) -> BufferDesc {
    move |b: BufferId| {
        let (role, fingerprint, bytes) = match b.0 {
            0 => (
                BufferRole::Pool {
                    kind: fmt.kind(),
                    layer: LayerId(0),
                },
                fmt.fingerprint(),
                fmt.page_bytes() * 4,
            ),
            _ => (
                BufferRole::Scratch { name: "scratch" },
                LayoutFingerprint::unpaged(1 << 20),
                1 << 20,
            ),
        };
        BufferDesc {
            role,
            tier: MemoryTier::Device,
            bytes: Bytes(bytes),
            fingerprint,
        }
    }
}

fn region(buffer: u32, bytes: u64) -> Region {
    Region {
        buffer: BufferId(buffer),
        offset: Bytes::ZERO,
        bytes: Bytes(bytes),
    }
}

/// The four ops over a pool (two stored tokens or one query row of a 2-page context), each in
/// the formats of `ik` and `kv`, pool buffer 0.
fn pool_ops(ik: IndexKDtype, kv: KvDtype) -> Vec<Op> {
    let tags = RowTags {
        layer_global: 0,
        rows: Arc::from([RowTag {
            request: 1,
            position: 70,
        }]),
    };
    let drawn = Drawn {
        seed: 1,
        layer: 0,
        rows: Arc::from(
            [TokenAt {
                token: 5,
                position: 0,
            }; 2],
        ),
        tokens: None,
    };
    let rope = Rope::new(&tierkv_kernels::rope::RopeParams::deepseek_v32(4096));
    let (table, lens): (Arc<[i32]>, Arc<[i32]>) = (Arc::from([0, 1]), Arc::from([71]));
    vec![
        Op::IndexKStore(IndexKStore {
            dst: BufferId(0),
            args: args::IndexKStore {
                dtype: ik,
                ue8m0: false,
                slots: vec![0, 1].into(),
            },
            keys: drawn.clone(),
            gamma: Arc::from([1.0; 128]),
            beta: Arc::from([0.0; 128]),
            rope,
            tags: tags.clone(),
        }),
        Op::KvStore(KvStore {
            dst: BufferId(0),
            args: args::KvStore {
                dtype: kv,
                slots: vec![0, 1].into(),
            },
            rows: drawn,
            tags: tags.clone(),
        }),
        Op::IndexLogits(IndexLogits {
            args: args::IndexLogits {
                dtype: ik,
                heads: 1,
                page_table: table.clone().into(),
                pt_stride: 2,
                context_lens: lens.clone().into(),
                out_stride: 128,
            },
            q: region(1, 128),
            w: region(2, 4),
            k: BufferId(0),
            out: region(3, 128 * 4),
            tags: tags.clone(),
        }),
        Op::SparseRead(SparseRead {
            args: args::SparseRead {
                dtype: kv,
                rows: 1,
                k: 4,
            },
            slots: region(1, 4 * 4),
            kv: BufferId(0),
            page_table: table,
            pt_stride: 2,
            context_lens: lens,
            out: region(2, 8),
            tags,
        }),
    ]
}

/// Every op over a pool declares the pool's format: `check_op` runs it on a pool of that format
/// and refuses it, naming the op and the pool, on a pool of the other dtype (the check against
/// a store that ignores the pool's dtype, the incident `IndexKStore`'s dtype exists for).
#[test]
fn an_op_over_a_pool_of_another_format_is_refused() {
    let formats = |ik, kv| {
        [
            PageFormat::IndexK(ik),
            PageFormat::Kv(kv),
            PageFormat::IndexK(ik),
            PageFormat::Kv(kv),
        ]
    };
    let dtypes = [
        (IndexKDtype::Fp8, KvDtype::Bf16),
        (IndexKDtype::Bf16, KvDtype::Fp8Packed),
    ];
    for (i, &(ik, kv)) in dtypes.iter().enumerate() {
        let (other_ik, other_kv) = dtypes[1 - i];
        let ops = pool_ops(ik, kv);
        for ((op, fmt), other) in ops
            .iter()
            .zip(formats(ik, kv))
            .zip(formats(other_ik, other_kv))
        {
            let name = op.name();
            assert_eq!(name, Op::NAMES[op.kind()]);
            crate::device::check_op(op, descs(fmt)).unwrap_or_else(|e| panic!("{name}: {e}"));
            match crate::device::check_op(op, descs(other)) {
                Err(DeviceError::LayoutMismatch { op, buffer, .. }) => {
                    assert_eq!((op, buffer), (name, BufferId(0)))
                }
                r => panic!("{name} over a pool of {other:?}: {r:?}"),
            }
        }
    }
}

/// A linear copy between regions of different sizes is refused by its shape check, by name.
#[test]
fn a_linear_copy_touches_both_regions_and_unequal_ones_are_refused() {
    let op = Op::Copy(LinearCopy {
        src: region(1, 16),
        dst: region(2, 16),
    });
    assert_eq!(op.name(), "copy");
    crate::device::check_op(&op, descs(PageFormat::Kv(KvDtype::Bf16))).expect("equal sizes");
    // The devices' time model: a copy touches its bytes twice, read and written.
    assert_eq!(op.bytes_touched(), Bytes(32));
    let op = Op::Copy(LinearCopy {
        src: region(1, 16),
        dst: region(2, 24),
    });
    match crate::device::check_op(&op, descs(PageFormat::Kv(KvDtype::Bf16))) {
        Err(DeviceError::Kernel { op, detail }) => {
            assert_eq!((op, detail.as_str()), ("copy", "24 B from a 16 B region"))
        }
        r => panic!("a 16 B region copied into 24 B: {r:?}"),
    }
    // An empty copy at a buffer's very end is inside it; one byte there is not.
    let at_end = |bytes: u64| {
        let r = Region {
            buffer: BufferId(1),
            offset: Bytes(1 << 20),
            bytes: Bytes(bytes),
        };
        Op::Copy(LinearCopy { src: r, dst: r })
    };
    let fmt = PageFormat::Kv(KvDtype::Bf16);
    crate::device::check_op(&at_end(0), descs(fmt)).expect("an empty copy at the end");
    assert!(matches!(
        crate::device::check_op(&at_end(1), descs(fmt)),
        Err(DeviceError::OutOfBounds { .. })
    ));
}

/// Each op's detail, the text a refusal or a trace shows beside its name, gives its shape and
/// the pool it works on.
#[test]
fn an_ops_detail_gives_its_shape() {
    let fmt = PageFormat::IndexK(IndexKDtype::Fp8);
    let role = |b: BufferId| descs(fmt)(b).role;
    let pool = role(BufferId(0));
    let mut ops = pool_ops(IndexKDtype::Fp8, KvDtype::Bf16);
    ops.push(Op::TopK(TopK {
        args: args::TopK {
            k: 4,
            stride: 128,
            context_lens: vec![71, 9].into(),
            page_table: vec![0, 1, 2, 3].into(),
            pt_stride: 2,
        },
        logits: region(1, 2 * 128 * 4),
        out: region(2, 2 * 4 * 4),
    }));
    ops.push(Op::NextTokens(NextTokens {
        args: args::NextTokens {
            seed: 1,
            layers: 3,
            rows_max: 8,
            rows: 5,
        },
        digests: region(1, 3 * 8 * 8),
        out: region(2, 5 * 4),
        tags: RowTags {
            layer_global: 0,
            rows: Arc::from([]),
        },
    }));
    let details: Vec<String> = ops.iter().map(|op| op.spec().detail(&role)).collect();
    assert_eq!(
        details,
        [
            format!("2 tokens into {pool}"),
            format!("2 tokens into {pool}"),
            format!("1 rows over {pool}"),
            format!("1 rows x top-4 of {pool}"),
            "2 rows, k = 4".to_string(),
            "5 rows x 3 layers".to_string(),
        ]
    );
}

/// A query or output region not exactly the size its operand needs is refused by the op's
/// shape check, naming the op.
#[test]
fn a_region_of_the_wrong_size_is_refused() {
    let fmt = |op: &Op| match op {
        Op::IndexLogits(_) => PageFormat::IndexK(IndexKDtype::Fp8),
        _ => PageFormat::Kv(KvDtype::Bf16),
    };
    for mut op in pool_ops(IndexKDtype::Fp8, KvDtype::Bf16)
        .into_iter()
        .skip(2)
    {
        let name = op.name();
        crate::device::check_op(&op, descs(fmt(&op))).unwrap_or_else(|e| panic!("{name}: {e}"));
        match &mut op {
            Op::IndexLogits(o) => o.q.bytes = Bytes(o.q.bytes.0 - 4),
            Op::SparseRead(o) => o.out.bytes = Bytes(o.out.bytes.0 + 8),
            other => panic!("pool_ops changed: {}", other.name()),
        }
        match crate::device::check_op(&op, descs(fmt(&op))) {
            Err(DeviceError::Kernel { op, .. }) => assert_eq!(op, name),
            r => panic!("{name} with a region of the wrong size: {r:?}"),
        }
    }
}

/// A read of `len` bytes of `buffer` from `start`.
fn reads(buffer: u32, start: u64, len: u64) -> Access {
    Access {
        range: ByteRange::new(BufferId(buffer), Bytes(start), Bytes(len)),
        write: false,
    }
}

/// A write of `len` bytes of `buffer` from `start`.
fn writes(buffer: u32, start: u64, len: u64) -> Access {
    Access {
        range: ByteRange::new(BufferId(buffer), Bytes(start), Bytes(len)),
        write: true,
    }
}

/// What an op declares it reads and writes, written out from its shape: the race detector and
/// the undeclared-write check take these as the op's accesses.
#[test]
fn each_op_declares_what_it_reads_and_writes() {
    // Next tokens: each layer's rows of the digests buffer (`[layers][rows_max]` u64) and the
    // one u32 a row it writes; its tags are the rows given.
    let tags = RowTags {
        layer_global: 0,
        rows: Arc::from(
            [RowTag {
                request: 1,
                position: 5,
            }; 3],
        ),
    };
    let next = Op::NextTokens(NextTokens {
        args: args::NextTokens {
            seed: 1,
            layers: 2,
            rows_max: 4,
            rows: 3,
        },
        digests: region(5, 2 * 4 * 8),
        out: region(6, 3 * 4),
        tags: tags.clone(),
    });
    assert_eq!(
        next.accesses(),
        [reads(5, 0, 24), reads(5, 32, 24), writes(6, 0, 12)]
    );
    assert_eq!(next.tags(), Some(&tags));
    // A page copy: each page of each run, read from the source view, written to the
    // destination's, every row of each destination page written in full.
    let fmt = PageFormat::Kv(KvDtype::Bf16);
    let pb = fmt.page_bytes();
    let view = |base: u64, stride: u64| PagedView {
        base,
        page_stride: stride,
        pages: 8,
        fingerprint: fmt.fingerprint(),
    };
    let copy = Op::PageCopy(PageCopy {
        src: BufferId(1),
        src_view: view(100, 3 * pb),
        dst: BufferId(2),
        dst_view: view(0, pb),
        runs: vec![PageRun {
            src: PageId(1),
            dst: PageId(4),
            count: 2,
        }],
    });
    assert_eq!(
        copy.accesses(),
        [
            reads(1, 100 + 3 * pb, pb),
            writes(2, 4 * pb, pb),
            reads(1, 100 + 6 * pb, pb),
            writes(2, 5 * pb, pb),
        ]
    );
    assert_eq!(
        copy.spec().full_rows(),
        [(BufferId(2), 4, u64::MAX), (BufferId(2), 5, u64::MAX)]
    );
    // A store whose rows take pending tokens reads the tokens buffer too, beside the pool page
    // it writes; it writes in full one row a slot (slots 0 and 1: page 0, rows 0 and 1).
    let mut stores = 0;
    for op in pool_ops(IndexKDtype::Fp8, KvDtype::Bf16) {
        let Op::IndexKStore(mut store) = op else {
            continue;
        };
        stores += 1;
        let plain = Op::IndexKStore(store.clone()).accesses();
        assert!(plain
            .iter()
            .all(|a| a.range.buffer == BufferId(0) && a.write));
        assert_eq!(
            Op::IndexKStore(store.clone()).spec().full_rows(),
            [(BufferId(0), 0, 0b01), (BufferId(0), 0, 0b10)]
        );
        store.keys.tokens = Some(region(7, 8));
        let with_tokens = Op::IndexKStore(store).accesses();
        assert_eq!(with_tokens[0], reads(7, 0, 8));
        assert_eq!(with_tokens[1..], plain[..]);
    }
    assert_eq!(stores, 1, "the pool ops hold one index-K store");
}

/// A KV store declares the pool rows it writes, one whole bf16 row (576 values of 2 bytes) a
/// slot, and the tokens it reads when its rows take pending tokens; a KV store's and a sparse
/// read's tags are the rows they were given.
#[test]
fn kv_stores_and_sparse_reads_declare_their_rows_and_tags() {
    let ops = pool_ops(IndexKDtype::Fp8, KvDtype::Bf16);
    let Some(Op::KvStore(store)) = ops.iter().find(|o| matches!(o, Op::KvStore(_))).cloned() else {
        panic!("the pool ops hold a KV store");
    };
    assert_eq!(
        Op::KvStore(store.clone()).accesses(),
        [writes(0, 0, 1152), writes(0, 1152, 1152)]
    );
    let mut pending = store;
    pending.rows.tokens = Some(region(7, 8));
    assert_eq!(
        Op::KvStore(pending).accesses(),
        [reads(7, 0, 8), writes(0, 0, 1152), writes(0, 1152, 1152)]
    );
    // Both a sparse read's and a KV store's tags are the rows they were given.
    let want = [RowTag {
        request: 1,
        position: 70,
    }];
    for op in ops
        .iter()
        .filter(|o| matches!(o, Op::SparseRead(_) | Op::KvStore(_)))
    {
        assert_eq!(
            op.tags().map(|t| &t.rows[..]),
            Some(&want[..]),
            "{}",
            op.name()
        );
    }
}

/// A query prep's output regions are exactly its record's (2 rows of 1 head: 256 bytes of fp8
/// queries, 8 bytes of f32 weights): one byte short of either is refused, naming the op; and a
/// store's pending row naming a token past the tokens region is refused.
#[test]
fn a_query_preps_outputs_and_a_pending_rows_token_are_checked() {
    let inputs = Drawn {
        seed: 1,
        layer: 0,
        rows: Arc::from(
            [TokenAt {
                token: 5,
                position: 3,
            }; 2],
        ),
        tokens: None,
    };
    let prep = |q: u64, w: u64| {
        Op::QPrep(QPrep {
            args: args::QPrep {
                rows: 2,
                heads: 1,
                ue8m0: false,
            },
            inputs: inputs.clone(),
            rope: Rope::new(&tierkv_kernels::rope::RopeParams::deepseek_v32(4096)),
            q_out: region(1, q),
            w_out: region(2, w),
        })
    };
    let fmt = PageFormat::Kv(KvDtype::Bf16);
    crate::device::check_op(&prep(256, 8), descs(fmt)).expect("the record's sizes");
    for (q, w) in [(255, 8), (256, 7)] {
        match crate::device::check_op(&prep(q, w), descs(fmt)) {
            Err(DeviceError::Kernel { op, .. }) => assert_eq!(op, "q_prep"),
            r => panic!("q_out {q}, w_out {w}: {r:?}"),
        }
    }
    // Two pending rows, entries 0 and 1, over a tokens region of one u32 and of two.
    for (entries, ok) in [(1, false), (2, true)] {
        let Some(Op::KvStore(mut store)) = pool_ops(IndexKDtype::Fp8, KvDtype::Bf16)
            .into_iter()
            .find(|o| matches!(o, Op::KvStore(_)))
        else {
            panic!("the pool ops hold a KV store");
        };
        store.rows.rows = Arc::from([TokenAt::pending(0, 0), TokenAt::pending(1, 1)]);
        store.rows.tokens = Some(region(7, 4 * entries));
        let r = crate::device::check_op(&Op::KvStore(store), descs(fmt));
        assert_eq!(r.is_ok(), ok, "{entries} entries: {r:?}");
    }
}

/// The details of a query prep, a page copy and a linear copy give their shapes and buffers.
#[test]
fn a_preps_and_a_copys_detail_gives_its_shape() {
    let fmt = PageFormat::Kv(KvDtype::Bf16);
    let role = |b: BufferId| descs(fmt)(b).role;
    let (pool, scratch) = (role(BufferId(0)), role(BufferId(1)));
    let prep = QPrep {
        args: args::QPrep {
            rows: 2,
            heads: 3,
            ue8m0: false,
        },
        inputs: Drawn {
            seed: 1,
            layer: 0,
            rows: Arc::from([]),
            tokens: None,
        },
        rope: Rope::new(&tierkv_kernels::rope::RopeParams::deepseek_v32(4096)),
        q_out: region(1, 0),
        w_out: region(2, 0),
    };
    let view = PagedView {
        base: 0,
        page_stride: fmt.page_bytes(),
        pages: 4,
        fingerprint: fmt.fingerprint(),
    };
    let copy = PageCopy {
        src: BufferId(0),
        src_view: view,
        dst: BufferId(1),
        dst_view: view,
        runs: vec![
            PageRun {
                src: PageId(1),
                dst: PageId(2),
                count: 2,
            },
            PageRun {
                src: PageId(3),
                dst: PageId(0),
                count: 1,
            },
        ],
    };
    let linear = LinearCopy {
        src: region(1, 16),
        dst: region(2, 16),
    };
    assert_eq!(prep.detail(&role), "2 rows x 3 heads");
    assert_eq!(
        copy.detail(&role),
        format!(
            "{pool} → {scratch}: 3 pages in 2 runs (first run {}→{} x2)",
            PageId(1),
            PageId(2)
        )
    );
    assert_eq!(
        linear.detail(&role),
        format!("{scratch} → {scratch} (16 B)")
    );
}

/// A store's and a next-token op's shapes are checked: an index-K store with a slot fewer than
/// its drawn rows, and a next-token op whose output is not one u32 a row, are refused naming
/// the op.
#[test]
fn a_stores_and_a_next_token_ops_shapes_are_checked() {
    let fmt = PageFormat::IndexK(IndexKDtype::Fp8);
    let ops = pool_ops(IndexKDtype::Fp8, KvDtype::Bf16);
    let Some(Op::IndexKStore(mut store)) = ops
        .iter()
        .find(|o| matches!(o, Op::IndexKStore(_)))
        .cloned()
    else {
        panic!("an index-K store");
    };
    store.args.slots = vec![0].into();
    match crate::device::check_op(&Op::IndexKStore(store), descs(fmt)) {
        Err(DeviceError::Kernel { op, .. }) => assert_eq!(op, "index_k_store"),
        r => panic!("one slot for two rows: {r:?}"),
    }
    let next = |out: u64| {
        Op::NextTokens(NextTokens {
            args: args::NextTokens {
                seed: 1,
                layers: 1,
                rows_max: 4,
                rows: 3,
            },
            digests: region(5, 4 * 8),
            out: region(6, out),
            tags: RowTags {
                layer_global: 0,
                rows: Arc::from(
                    [RowTag {
                        request: 1,
                        position: 5,
                    }; 3],
                ),
            },
        })
    };
    crate::device::check_op(&next(12), descs(fmt)).expect("3 rows, 12 bytes");
    match crate::device::check_op(&next(8), descs(fmt)) {
        Err(DeviceError::Kernel { op, .. }) => assert_eq!(op, "next_tokens"),
        r => panic!("3 rows into 8 bytes: {r:?}"),
    }
}

/// A drawn input's positions are its rows', in row order.
#[test]
fn drawn_rows_give_their_positions_in_order() {
    let drawn = Drawn {
        seed: 1,
        layer: 0,
        rows: Arc::from([
            TokenAt {
                token: 5,
                position: 9,
            },
            TokenAt::pending(0, 3),
            TokenAt {
                token: 7,
                position: 4,
            },
        ]),
        tokens: None,
    };
    assert_eq!(drawn.positions(), [9, 3, 4]);
}

/// Declaring a page merges it only into a repeat of the access just before it (the same
/// buffer, direction and page): the same page of another buffer, the page written after read,
/// and the next page are each their own access.
#[test]
fn a_page_declared_again_merges_only_into_the_same_access_before_it() {
    let fmt = PageFormat::Kv(KvDtype::Bf16);
    let pb = fmt.page_bytes();
    let mut out = Vec::new();
    push_page(&mut out, BufferId(1), fmt, 3, false);
    push_page(&mut out, BufferId(1), fmt, 3, false);
    push_page(&mut out, BufferId(2), fmt, 3, false);
    push_page(&mut out, BufferId(2), fmt, 3, true);
    push_page(&mut out, BufferId(2), fmt, 4, true);
    let got: Vec<(u32, u64, bool)> = out
        .iter()
        .map(|a| (a.range.buffer.0, a.range.start.0 / pb, a.write))
        .collect();
    assert_eq!(
        got,
        [(1, 3, false), (2, 3, false), (2, 3, true), (2, 4, true)]
    );
}
