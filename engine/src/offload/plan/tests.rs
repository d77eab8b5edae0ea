//! The plan against page copies written out by hand, and the registration's refusals.

use super::*;

const KV: u64 = 64 * 656; // 64 tokens of fp8 MLA rows
const IK: u64 = 64 * 132; // 64 tokens of fp8 index-K rows

fn formats() -> Vec<PageFormat> {
    vec![
        parse_format("kv/fp8_packed").unwrap(),
        parse_format("index_k/fp8").unwrap(),
    ]
}

/// Two tensors (KV, index-K) of 16 pages; one group of 64-token blocks with two layers each
/// referencing both tensors.
fn registration(blocks_per_chunk: u64) -> Registration {
    let tensors = vec![
        CacheTensor {
            base: 0x10_0000,
            blocks: 16,
            page_bytes: KV,
            stride: KV,
        },
        CacheTensor {
            base: 0x90_0000,
            blocks: 16,
            page_bytes: IK,
            stride: IK,
        },
    ];
    let refs = vec![
        LayerRef {
            tensor: 0,
            ref_bytes: KV,
        },
        LayerRef {
            tensor: 1,
            ref_bytes: IK,
        },
    ];
    Registration::new(
        tensors,
        vec![Group {
            tokens_per_block: 64,
            refs,
        }],
        &formats(),
        blocks_per_chunk,
        8,
    )
    .unwrap()
}

#[test]
fn each_page_goes_to_its_chunk_and_contiguous_pages_coalesce() {
    let reg = registration(2);
    // Device blocks 3, 4, 9 of a request whose first block is block 1 of its chunk (skip 1):
    // slots 1, 2, 3 of chunks [5, 6].
    let blocks = [3u64, 4, 9];
    let mut ptrs = Vec::new();
    let mut sizes = Vec::new();
    for (base, page) in [(0x10_0000u64, KV), (0x90_0000, IK)] {
        for b in blocks {
            ptrs.push(base + b * page);
            sizes.push(page);
        }
    }
    let job = Job {
        ptrs: &ptrs,
        sizes: &sizes,
        group_blocks: &[3],
        group_refs: &[2],
        block_indices: &[7],
        chunks: &[5, 6],
    };
    let plan = reg.plan(&job).unwrap();
    assert_eq!(plan.pages, 6);
    assert_eq!(plan.bytes, 3 * KV + 3 * IK);
    // Written out: chunk c's slot s of tensor t is at c * 2 * page(t) + s * page(t).
    // Slot 1 → chunk 5 slot 1; slot 2 → chunk 6 slot 0; slot 3 → chunk 6 slot 1.
    let want = vec![
        // blocks 3 → (5,1) and 4 → (6,0) are contiguous on both sides: one run.
        Run {
            tensor: 0,
            device: 0x10_0000 + 3 * KV,
            host: 5 * 2 * KV + KV,
            bytes: 2 * KV,
        },
        Run {
            tensor: 0,
            device: 0x10_0000 + 9 * KV,
            host: 6 * 2 * KV + KV,
            bytes: KV,
        },
        Run {
            tensor: 1,
            device: 0x90_0000 + 3 * IK,
            host: 5 * 2 * IK + IK,
            bytes: 2 * IK,
        },
        Run {
            tensor: 1,
            device: 0x90_0000 + 9 * IK,
            host: 6 * 2 * IK + IK,
            bytes: IK,
        },
    ];
    assert_eq!(plan.runs, want);
}

#[test]
fn pages_further_apart_than_their_bytes_are_addressed_by_stride_and_packed_on_the_host() {
    // A packed layout: each block's KV page sits in a 3-page-wide slot of the tensor.
    let tensors = vec![CacheTensor {
        base: 0x4000,
        blocks: 8,
        page_bytes: KV,
        stride: 3 * KV,
    }];
    let refs = vec![LayerRef {
        tensor: 0,
        ref_bytes: KV,
    }];
    let kv = [parse_format("kv/fp8_packed").unwrap()];
    let reg = Registration::new(
        tensors,
        vec![Group {
            tokens_per_block: 64,
            refs,
        }],
        &kv,
        1,
        4,
    )
    .unwrap();
    assert_eq!(reg.host_bytes(0), 4 * KV);
    let ptrs = [0x4000 + 2 * 3 * KV, 0x4000 + 3 * 3 * KV];
    let job = Job {
        ptrs: &ptrs,
        sizes: &[KV, KV],
        group_blocks: &[2],
        group_refs: &[1],
        block_indices: &[0],
        chunks: &[0, 1],
    };
    let plan = reg.plan(&job).unwrap();
    // Not contiguous on the device (a gap of two pages): two runs, packed side by side on the host.
    assert_eq!(
        plan.runs,
        vec![
            Run {
                tensor: 0,
                device: ptrs[0],
                host: 0,
                bytes: KV
            },
            Run {
                tensor: 0,
                device: ptrs[1],
                host: KV,
                bytes: KV
            },
        ]
    );
    let inside = [0x4000 + KV];
    let err = reg
        .plan(&Job {
            ptrs: &inside,
            sizes: &[KV],
            group_blocks: &[1],
            chunks: &[0],
            ..job
        })
        .unwrap_err();
    assert!(matches!(err, PlanError::Address { .. }), "{err}");
}

#[test]
fn a_bf16_index_k_behind_an_fp8_configuration_is_refused_naming_the_group() {
    let tensors = vec![
        CacheTensor {
            base: 0x1000,
            blocks: 4,
            page_bytes: KV,
            stride: KV,
        },
        CacheTensor {
            base: 0x100_0000,
            blocks: 4,
            page_bytes: 64 * 256,
            stride: 64 * 256,
        },
    ];
    let groups = vec![
        Group {
            tokens_per_block: 64,
            refs: vec![LayerRef {
                tensor: 0,
                ref_bytes: KV,
            }],
        },
        Group {
            tokens_per_block: 64,
            refs: vec![LayerRef {
                tensor: 1,
                ref_bytes: 64 * 256,
            }],
        },
    ];
    let err = Registration::new(tensors, groups, &formats(), 1, 4).unwrap_err();
    assert!(
        matches!(
            err,
            RegisterError::Layout {
                group: 1,
                layer: 0,
                ref_bytes: 16384,
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("group 1") && text.contains("16384") && text.contains("8448"),
        "{text}"
    );
    // The configured formats, by name, each with the bytes a block of it takes.
    let RegisterError::Layout {
        formats, expected, ..
    } = &err
    else {
        unreachable!("matched above");
    };
    assert_eq!(
        (formats.as_str(), expected.as_str()),
        ("kv/fp8_packed or index_k/fp8", "41984 or 8448")
    );
}

#[test]
fn a_configured_format_no_cache_has_is_refused() {
    let tensors = vec![CacheTensor {
        base: 0x1000,
        blocks: 4,
        page_bytes: KV,
        stride: KV,
    }];
    let groups = vec![Group {
        tokens_per_block: 64,
        refs: vec![LayerRef {
            tensor: 0,
            ref_bytes: KV,
        }],
    }];
    let err = Registration::new(tensors, groups, &formats(), 1, 4).unwrap_err();
    assert!(
        matches!(err, RegisterError::FormatUnused { ref format, .. } if format == "index_k/fp8"),
        "{err}"
    );
}

#[test]
fn bad_registrations_are_refused() {
    let t = |page_bytes| {
        vec![CacheTensor {
            base: 0x1000,
            blocks: 4,
            page_bytes,
            stride: page_bytes,
        }]
    };
    let g = |tensor, ref_bytes| {
        vec![Group {
            tokens_per_block: 64,
            refs: vec![LayerRef { tensor, ref_bytes }],
        }]
    };
    let kv = [parse_format("kv/fp8_packed").unwrap()];
    assert_eq!(
        Registration::new(t(KV), g(0, KV), &[], 1, 4).unwrap_err(),
        RegisterError::NoFormats
    );
    assert_eq!(
        Registration::new(vec![], g(0, KV), &kv, 1, 4).unwrap_err(),
        RegisterError::NoTensors
    );
    assert_eq!(
        Registration::new(t(KV), vec![], &kv, 1, 4).unwrap_err(),
        RegisterError::NoGroups
    );
    assert_eq!(
        Registration::new(t(KV), g(0, KV), &kv, 0, 4).unwrap_err(),
        RegisterError::NoBlocksPerChunk
    );
    assert!(matches!(
        Registration::new(t(0), g(0, KV), &kv, 1, 4),
        Err(RegisterError::Tensor { tensor: 0, .. })
    ));
    assert!(matches!(
        Registration::new(t(KV), g(1, KV), &kv, 1, 4),
        Err(RegisterError::Group { group: 0, .. })
    ));
    assert!(matches!(
        Registration::new(t(KV), g(0, KV + 1), &kv, 1, 4),
        Err(RegisterError::Group { group: 0, .. })
    ));
    assert!(matches!(
        Registration::new(t(KV), g(0, KV), &kv, 1 << 30, 1 << 30),
        Err(RegisterError::HostTooLarge(_))
    ));
    assert!(matches!(
        parse_format("index_k/fp4"),
        Err(RegisterError::UnknownFormat(..))
    ));
    let empty = vec![CacheTensor {
        base: 0x1000,
        blocks: 0,
        page_bytes: KV,
        stride: KV,
    }];
    assert!(matches!(
        Registration::new(empty, g(0, KV), &kv, 1, 4),
        Err(RegisterError::Tensor { tensor: 0, .. })
    ));
    let twice = [kv[0], kv[0]];
    assert!(matches!(
        Registration::new(t(KV), g(0, KV), &twice, 1, 4),
        Err(RegisterError::RepeatedFormat(_))
    ));
    let squeezed = vec![CacheTensor {
        base: 0x1000,
        blocks: 4,
        page_bytes: KV,
        stride: KV - 1,
    }];
    assert!(matches!(
        Registration::new(squeezed, g(0, KV), &kv, 1, 4),
        Err(RegisterError::Tensor { tensor: 0, .. })
    ));
    let huge = vec![CacheTensor {
        base: u64::MAX - 10,
        blocks: 4,
        page_bytes: KV,
        stride: KV,
    }];
    assert!(matches!(
        Registration::new(huge, g(0, KV), &kv, 1, 4),
        Err(RegisterError::Tensor { tensor: 0, .. })
    ));
}

#[test]
fn jobs_outside_the_registration_are_refused() {
    let reg = registration(1);
    let ok_ptrs = [0x10_0000u64, 0x90_0000];
    let sizes = [KV, IK];
    let job = |ptrs: &'static [u64], sizes: &'static [u64], chunks: &'static [u64]| Job {
        ptrs,
        sizes,
        group_blocks: &[1],
        group_refs: &[2],
        block_indices: &[0],
        chunks,
    };
    assert!(reg
        .plan(&Job {
            ptrs: &ok_ptrs,
            sizes: &sizes,
            ..job(&[], &[], &[0])
        })
        .is_ok());
    // An address inside a page, one past the last page, before the tensor.
    for bad in [0x10_0001u64, 0x10_0000 + 16 * KV, 0x1000] {
        let ptrs = [bad, 0x90_0000];
        let err = reg
            .plan(&Job {
                ptrs: &ptrs,
                sizes: &sizes,
                ..job(&[], &[], &[0])
            })
            .unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::Address {
                    group: 0,
                    layer: 0,
                    block: 0,
                    ..
                }
            ),
            "{err}"
        );
    }
    let wrong_size = [KV, KV];
    assert!(matches!(
        reg.plan(&Job {
            ptrs: &ok_ptrs,
            sizes: &wrong_size,
            ..job(&[], &[], &[0])
        }),
        Err(PlanError::Size { layer: 1, .. })
    ));
    assert!(matches!(
        reg.plan(&Job {
            ptrs: &ok_ptrs,
            sizes: &sizes,
            ..job(&[], &[], &[8])
        }),
        Err(PlanError::Chunk { chunk: 8, .. })
    ));
    assert!(matches!(
        reg.plan(&Job {
            ptrs: &ok_ptrs,
            sizes: &sizes,
            ..job(&[], &[], &[0, 1])
        }),
        Err(PlanError::Chunks { need: 1, got: 2 })
    ));
    assert!(matches!(
        reg.plan(&Job {
            ptrs: &ok_ptrs[..1],
            sizes: &sizes,
            ..job(&[], &[], &[0])
        }),
        Err(PlanError::Addresses { .. })
    ));
    assert!(matches!(
        reg.plan(&Job {
            ptrs: &ok_ptrs,
            sizes: &sizes,
            group_refs: &[1],
            ..job(&[], &[], &[0])
        }),
        Err(PlanError::Refs {
            group: 0,
            got: 1,
            want: 2
        })
    ));
    assert!(matches!(
        reg.plan(&Job {
            ptrs: &ok_ptrs,
            sizes: &sizes,
            group_blocks: &[1, 0],
            ..job(&[], &[], &[0])
        }),
        Err(PlanError::Groups { got: 2, want: 1 })
    ));
}

/// vLLM's layout for DeepSeek: one KV group per cache, each with its own keys and chunks.
fn two_groups() -> Registration {
    let tensors = vec![
        CacheTensor {
            base: 0x10_0000,
            blocks: 16,
            page_bytes: KV,
            stride: KV,
        },
        CacheTensor {
            base: 0x90_0000,
            blocks: 16,
            page_bytes: IK,
            stride: IK,
        },
    ];
    let group = |tensor, ref_bytes| Group {
        tokens_per_block: 64,
        refs: vec![LayerRef { tensor, ref_bytes }],
    };
    Registration::new(tensors, vec![group(0, KV), group(1, IK)], &formats(), 1, 8).unwrap()
}

#[test]
fn each_groups_blocks_take_their_own_chunks_in_order() {
    let reg = two_groups();
    // Block 2 of both caches: group 0's key in chunk 3, group 1's in chunk 5.
    let ptrs = [0x10_0000 + 2 * KV, 0x90_0000 + 2 * IK];
    let job = Job {
        ptrs: &ptrs,
        sizes: &[KV, IK],
        group_blocks: &[1, 1],
        group_refs: &[1, 1],
        block_indices: &[0, 0],
        chunks: &[3, 5],
    };
    let plan = reg.plan(&job).unwrap();
    let hosts: Vec<(usize, u64)> = plan.runs.iter().map(|r| (r.tensor, r.host)).collect();
    assert_eq!(hosts, vec![(0, 3 * KV), (1, 5 * IK)]);
    // Any one of the per-group arrays of the wrong length is refused.
    for (blocks, refs, indices) in [
        (&[1u64][..], &[1u64, 1][..], &[0u64, 0][..]),
        (&[1, 1], &[1], &[0, 0]),
        (&[1, 1], &[1, 1], &[0]),
    ] {
        let bad = Job {
            group_blocks: blocks,
            group_refs: refs,
            block_indices: indices,
            ..job
        };
        assert!(reg.plan(&bad).is_err(), "{blocks:?} {refs:?} {indices:?}");
    }
}

/// The formats a registration may name, each parsed back from its name.
#[test]
fn every_format_name_parses_back() {
    let names = format_names();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            "index_k/bf16",
            "index_k/fp8",
            "kv/bf16",
            "kv/fp8_packed",
            "kv/fp8_unpacked"
        ]
    );
    for n in &names {
        assert_eq!(&parse_format(n).unwrap().to_string(), n);
    }
}
