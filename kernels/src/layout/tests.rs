use super::*;

fn params(ik: IndexKDtype, kv: KvDtype, host_layout: HostLayout) -> LayoutParams {
    LayoutParams {
        layers: 3,
        layer_base: 0,
        index_n_heads: 4,
        index_k_dtype: ik,
        kv_dtype: kv,
        device_pages: 10,
        host_pages: 25,
        host_layout,
    }
}

#[test]
fn page_sizes_are_the_design_constants() {
    assert_eq!(PageFormat::IndexK(IndexKDtype::Fp8).page_bytes(), 8448);
    assert_eq!(PageFormat::IndexK(IndexKDtype::Bf16).page_bytes(), 16384);
    assert_eq!(PageFormat::Kv(KvDtype::Bf16).token_bytes(), 1152);
    assert_eq!(PageFormat::Kv(KvDtype::Fp8Packed).token_bytes(), 656);
    assert_eq!(
        index_k_page::scale_offset(IndexKDtype::Fp8, 5),
        Some(8192 + 20)
    );
    assert_eq!(index_k_page::scale_offset(IndexKDtype::Bf16, 5), None);
    assert_eq!(
        index_k_page::value_offset(IndexKDtype::Bf16, 1, 3),
        (128 + 3) * 2
    );
}

#[test]
fn host_offsets_tile_the_mirror_without_overlap() {
    for hl in HostLayout::ALL {
        let l = Layout::new(params(IndexKDtype::Bf16, KvDtype::Fp8Packed, hl)).unwrap();
        for kind in BufferKind::ALL {
            let pb = l.page_bytes(kind).0;
            let mut starts: Vec<u64> = Vec::new();
            for layer in 0..l.layers() {
                for p in 0..l.host_pages() {
                    let off = l.host_page_offset(kind, LayerId(layer), PageId(p)).0;
                    let view = l.host_layer_view(kind, LayerId(layer));
                    assert_eq!(view.page_range(PageId(p)).start, off);
                    starts.push(off);
                }
            }
            starts.sort_unstable();
            for (i, s) in starts.iter().enumerate() {
                assert_eq!(*s, i as u64 * pb, "{hl:?} {kind:?}");
            }
            assert_eq!(starts.len() as u64 * pb, l.host_bytes(kind).0);
        }
    }
}

#[test]
fn overflow_is_an_error_not_a_panic() {
    let mut p = params(IndexKDtype::Bf16, KvDtype::Bf16, HostLayout::PageFirst);
    p.layers = u32::MAX;
    p.host_pages = u32::MAX;
    assert!(matches!(Layout::new(p), Err(LayoutError::Overflow { .. })));
}

#[test]
fn runs_coalesce_only_when_both_sides_are_consecutive() {
    let pairs = [
        (PageId(1), PageId(7)),
        (PageId(2), PageId(8)),
        (PageId(3), PageId(10)),
        (PageId(9), PageId(11)),
    ];
    let runs = coalesce_runs(&pairs);
    assert_eq!(
        runs,
        vec![
            PageRun {
                src: PageId(1),
                dst: PageId(7),
                count: 2
            },
            PageRun {
                src: PageId(3),
                dst: PageId(10),
                count: 1
            },
            PageRun {
                src: PageId(9),
                dst: PageId(11),
                count: 1
            },
        ]
    );
}
