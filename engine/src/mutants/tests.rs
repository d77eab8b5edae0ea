//! The zoo's switches: what every named point answers on the clean engine (written out here, not
//! derived from the points), and, with the `mutants` feature, which points each mutant changes and
//! to what. A switch that stopped acting, acted at another point, or acted on the clean engine
//! fails here at once, without a campaign.

use super::{Mutant, Mutants};
use crate::config::WritePolicy;
use crate::device::StreamKind;
use crate::layout::{HostLayout, IndexKDtype, KvDtype, Layout, LayoutParams, PageId};

/// A device layout on which both host-layout mutants act: bf16 index-K, packed fp8 KV.
fn device_layout() -> Layout {
    Layout::new(LayoutParams {
        layers: 4,
        layer_base: 2,
        index_n_heads: 64,
        index_k_dtype: IndexKDtype::Bf16,
        kv_dtype: KvDtype::Fp8Packed,
        device_pages: 16,
        host_pages: 32,
        host_layout: HostLayout::LayerFirst,
    })
    .expect("a valid layout")
}

/// Every point's answer for fixed inputs, by point name, as text.
fn answers(m: &Mutants) -> Vec<(&'static str, String)> {
    let reserved = [PageId(10), PageId(11), PageId(12)];
    let host = m.host_layout(device_layout()).params();
    vec![
        (
            "host_layout",
            format!("{:?} {:?}", host.index_k_dtype, host.kv_dtype),
        ),
        (
            "copy_trusts_source_size",
            m.copy_trusts_source_size().to_string(),
        ),
        (
            "abort_frees_in_flight_pages",
            m.abort_frees_in_flight_pages().to_string(),
        ),
        ("staging_waits", m.staging_waits().to_string()),
        (
            "scratch_free_stream",
            format!(
                "{:?} {:?}",
                m.scratch_free_stream(StreamKind::Compute),
                m.scratch_free_stream(StreamKind::Load)
            ),
        ),
        (
            "callback_stream",
            format!("{:?}", m.callback_stream(StreamKind::Write)),
        ),
        ("pageable_is_pinned", m.pageable_is_pinned().to_string()),
        (
            "pd_received_pages",
            format!("{:?}", m.pd_received_pages(&reserved, 1)),
        ),
        (
            "sparse_read_dtype",
            format!("{:?}", m.sparse_read_dtype(KvDtype::Fp8Packed)),
        ),
        (
            "recreation_keeps_device_tier",
            m.recreation_keeps_device_tier().to_string(),
        ),
        ("load_ok_at_issue", m.load_ok_at_issue().to_string()),
        (
            "pd_gives_up_at_first_failure",
            m.pd_gives_up_at_first_failure().to_string(),
        ),
        ("host_lease_ns", format!("{:?}", m.host_lease_ns())),
        (
            "pd_notification_deadline_ns",
            format!("{:?}", m.pd_notification_deadline_ns(7)),
        ),
        (
            "pd_admits_across_recreation",
            m.pd_admits_across_recreation().to_string(),
        ),
        ("key_weights", m.key_weights(3).to_string()),
        ("index_k_read_ungated", m.index_k_read_ungated().to_string()),
        ("backup_skips_index_k", m.backup_skips_index_k().to_string()),
        (
            "store_ue8m0",
            format!("{} {}", m.store_ue8m0(false), m.store_ue8m0(true)),
        ),
        ("load_skips_index_k", m.load_skips_index_k().to_string()),
        (
            "host_eviction_ignores_pins",
            m.host_eviction_ignores_pins().to_string(),
        ),
        (
            "load_publishes_at_issue",
            m.load_publishes_at_issue().to_string(),
        ),
        ("gate_layer_index", m.gate_layer_index(1, 5).to_string()),
        (
            "page_table_entry",
            m.page_table_entry(PageId(3)).to_string(),
        ),
        ("index_topk", m.index_topk(2048).to_string()),
        (
            "store_dtype",
            format!("{:?}", m.store_dtype(IndexKDtype::Bf16)),
        ),
        (
            "slot_reused_without_wait",
            m.slot_reused_without_wait().to_string(),
        ),
        (
            "load_events_pooled_at_issue",
            m.load_events_pooled_at_issue().to_string(),
        ),
        (
            "graphs_kept",
            format!("{} {}", m.graphs_kept(false), m.graphs_kept(true)),
        ),
        (
            "acks_may_precede_copy",
            m.acks_may_precede_copy().to_string(),
        ),
        (
            "abort_frees_load_pages",
            m.abort_frees_load_pages().to_string(),
        ),
        (
            "admission_passes_blocked",
            m.admission_passes_blocked().to_string(),
        ),
        (
            "prefill_budget_left",
            m.prefill_budget_left(10, 4).to_string(),
        ),
        (
            "device_eviction_newest_first",
            m.device_eviction_newest_first().to_string(),
        ),
        (
            "host_eviction_newest_first",
            m.host_eviction_newest_first().to_string(),
        ),
        (
            "write_through_backs_up",
            m.write_through_backs_up().to_string(),
        ),
        ("selective_hits", m.selective_hits().to_string()),
        (
            "eviction_policy",
            format!(
                "{:?} {:?}",
                m.eviction_policy(WritePolicy::WriteBack),
                m.eviction_policy(WritePolicy::WriteThroughSelective)
            ),
        ),
        (
            "prefix_hits",
            format!("{:?} {:?}", m.prefix_hits(2, 3), m.prefix_hits(2, 0)),
        ),
        ("no_admission_control", m.no_admission_control().to_string()),
        ("pd_publishes_aborted", m.pd_publishes_aborted().to_string()),
        ("pd_frees_before_send", m.pd_frees_before_send().to_string()),
        (
            "pd_decode_layer",
            format!("{} {}", m.pd_decode_layer(1, 4), m.pd_decode_layer(3, 4)),
        ),
        ("pd_layers_awaited", m.pd_layers_awaited(4).to_string()),
        ("overlap_one_readback", m.overlap_one_readback().to_string()),
    ]
}

/// The clean engine's answers, written out from each point's documented clean behaviour.
const CLEAN: &[(&str, &str)] = &[
    ("host_layout", "Bf16 Fp8Packed"),
    ("copy_trusts_source_size", "false"),
    ("abort_frees_in_flight_pages", "false"),
    ("staging_waits", "true"),
    ("scratch_free_stream", "Compute Load"),
    ("callback_stream", "Write"),
    ("pageable_is_pinned", "false"),
    ("pd_received_pages", "[PageId(10)]"),
    ("sparse_read_dtype", "Fp8Packed"),
    ("recreation_keeps_device_tier", "false"),
    ("load_ok_at_issue", "false"),
    ("pd_gives_up_at_first_failure", "false"),
    ("host_lease_ns", "None"),
    ("pd_notification_deadline_ns", "Some(7)"),
    ("pd_admits_across_recreation", "false"),
    ("key_weights", "3"),
    ("index_k_read_ungated", "false"),
    ("backup_skips_index_k", "false"),
    ("store_ue8m0", "false true"),
    ("load_skips_index_k", "false"),
    ("host_eviction_ignores_pins", "false"),
    ("load_publishes_at_issue", "false"),
    ("gate_layer_index", "1"),
    ("page_table_entry", "3"),
    ("index_topk", "2048"),
    ("store_dtype", "Bf16"),
    ("slot_reused_without_wait", "false"),
    ("load_events_pooled_at_issue", "false"),
    ("graphs_kept", "false false"),
    ("acks_may_precede_copy", "false"),
    ("abort_frees_load_pages", "false"),
    ("admission_passes_blocked", "false"),
    ("prefill_budget_left", "6"),
    ("device_eviction_newest_first", "false"),
    ("host_eviction_newest_first", "false"),
    ("write_through_backs_up", "true"),
    ("selective_hits", "2"),
    ("eviction_policy", "WriteBack WriteThroughSelective"),
    ("prefix_hits", "(2, 3) (2, 0)"),
    ("no_admission_control", "false"),
    ("pd_publishes_aborted", "false"),
    ("pd_frees_before_send", "false"),
    ("pd_decode_layer", "1 3"),
    ("pd_layers_awaited", "4"),
    ("overlap_one_readback", "false"),
];

#[test]
fn every_point_is_the_identity_on_the_clean_engine() {
    let got = answers(&Mutants::none());
    let want: Vec<(&str, String)> = CLEAN.iter().map(|&(p, a)| (p, a.to_string())).collect();
    assert_eq!(got, want);
    assert_eq!(Mutants::none().active(), None);
    for m in Mutant::ALL {
        assert!(
            !Mutants::none().on(m),
            "{} on in the clean engine",
            m.name()
        );
    }
}

#[test]
fn every_mutant_is_found_by_its_name_and_names_its_own_incident() {
    for m in Mutant::ALL {
        assert_eq!(Mutant::parse(m.name()), Some(m));
        assert_eq!(Mutant::parse(&m.name().to_uppercase()), None);
    }
    assert_eq!(Mutant::parse("no-such-mutant"), None);
    let incidents: std::collections::BTreeSet<&str> =
        Mutant::ALL.iter().map(|m| m.incident()).collect();
    assert_eq!(
        incidents.len(),
        Mutant::ALL.len(),
        "two mutants share an incident"
    );
    assert!(!incidents.contains(""), "a mutant names no incident");
    let names: std::collections::BTreeSet<&str> = Mutant::ALL.iter().map(|m| m.name()).collect();
    assert_eq!(names.len(), Mutant::ALL.len(), "two mutants share a name");
}

/// The field zoo (incidents of other serving stacks: the twelve rows of docs/ZOO.md's table,
/// written out here) has a mechanism each, all distinct; the other mutants have none.
#[test]
fn the_field_mutants_have_their_mechanisms_and_the_others_none() {
    let field = [
        Mutant::HostKvRow576,
        Mutant::AbortFreesPagesInFlight,
        Mutant::LoadSkipsIndexK,
        Mutant::StoreScalesThroughUe8m0,
        Mutant::PdReceivesIntoLastPages,
        Mutant::IndexKReadInterleaved,
        Mutant::SparseReadComputeDtype,
        Mutant::LoadOkAtIssue,
        Mutant::PdRetryBeforeStaleCopies,
        Mutant::HostLeaseExpires,
        Mutant::PdNoNotificationDeadline,
        Mutant::PrefixKeysIgnoreWeights,
    ];
    let mut seen = std::collections::BTreeSet::new();
    for m in Mutant::ALL {
        match m.field_mechanism() {
            Some(how) => {
                assert!(field.contains(&m), "{} is not of the field zoo", m.name());
                assert!(how.len() > 20, "{}: {how:?}", m.name());
                assert!(seen.insert(how), "{} shares a mechanism", m.name());
            }
            None => assert!(!field.contains(&m), "{} lost its mechanism", m.name()),
        }
    }
}

/// The prefill/decode mutants (run under the `pd` profile) and the runtime's (which act only
/// on the production runtime), by name.
#[test]
fn the_pd_and_runtime_mutants_are_those_named() {
    let pd: Vec<Mutant> = Mutant::ALL.into_iter().filter(|m| m.is_pd()).collect();
    assert_eq!(
        pd,
        [
            Mutant::PdPublishesAbortedPrefill,
            Mutant::PdFreesBeforeSend,
            Mutant::PdLayerLayoutMismatch,
            Mutant::PdAdmitsBeforeEveryLayer,
            Mutant::PdReceivesIntoLastPages,
            Mutant::PdRetryBeforeStaleCopies,
            Mutant::PdNoNotificationDeadline,
            Mutant::PdAdmitsAcrossRecreation,
        ]
    );
    for m in &pd {
        assert!(m.name().starts_with("pd-"), "{}", m.name());
    }
    let runtime: Vec<Mutant> = Mutant::ALL.into_iter().filter(|m| m.is_runtime()).collect();
    assert_eq!(
        runtime,
        [
            Mutant::StagingReusedEarly,
            Mutant::ScratchFreedOnOtherStream,
            Mutant::CallbackOnComputeStream,
            Mutant::PageableBufferReused,
            Mutant::GraphsKeptOnRecovery,
        ]
    );
}

/// Only the two one-step-ahead mutants switch the overlap on.
#[test]
fn only_the_mutants_of_an_engine_ahead_need_the_overlap() {
    let need: Vec<Mutant> = Mutant::ALL
        .into_iter()
        .filter(|m| m.needs_overlap())
        .collect();
    assert_eq!(
        need,
        [Mutant::OverlapOneReadback, Mutant::AbortFreesPagesInFlight]
    );
}

/// With the `mutants` feature: each mutant changes exactly the points it is documented to, to
/// the answers written here, and every other point keeps the clean answer.
#[cfg(feature = "mutants")]
#[test]
fn each_mutant_changes_its_points_and_no_other() {
    use super::{HARDCODED_TOPK, HOST_LEASE_NS};
    use crate::layout::slot;
    let lease = format!("Some({HOST_LEASE_NS})");
    let topk = HARDCODED_TOPK.to_string();
    let slot3 = slot(PageId(3), 0).kernel().to_string();
    let changes: Vec<(Mutant, Vec<(&str, &str)>)> = vec![
        (
            Mutant::HostIndexKFromFp8Defaults,
            vec![
                ("host_layout", "Fp8 Fp8Packed"),
                ("copy_trusts_source_size", "true"),
            ],
        ),
        (
            Mutant::UngatedIndexKRead,
            vec![("index_k_read_ungated", "true")],
        ),
        (
            Mutant::IndexKNotMirrored,
            vec![("backup_skips_index_k", "true")],
        ),
        (
            Mutant::HostKvRow576,
            vec![
                ("host_layout", "Bf16 Fp8Unpacked"),
                ("copy_trusts_source_size", "true"),
            ],
        ),
        (
            Mutant::EvictionIgnoresLoadPins,
            vec![("host_eviction_ignores_pins", "true")],
        ),
        (
            Mutant::PublishBeforeCopy,
            vec![("load_publishes_at_issue", "true")],
        ),
        (
            Mutant::GlobalLayerCounter,
            vec![("gate_layer_index", "6"), ("acks_may_precede_copy", "true")],
        ),
        (
            Mutant::IndexKAddressedBySlot,
            vec![("page_table_entry", &slot3)],
        ),
        (Mutant::TopkHardcoded512, vec![("index_topk", &topk)]),
        (Mutant::StoreIgnoresPoolDtype, vec![("store_dtype", "Fp8")]),
        (
            Mutant::LoadSlotReusedEarly,
            vec![
                ("slot_reused_without_wait", "true"),
                ("acks_may_precede_copy", "true"),
            ],
        ),
        (
            Mutant::WriteOnLoadingPage,
            vec![("abort_frees_load_pages", "true")],
        ),
        (
            Mutant::NoAdmissionControl,
            vec![("no_admission_control", "true")],
        ),
        (
            Mutant::PdPublishesAbortedPrefill,
            vec![("pd_publishes_aborted", "true")],
        ),
        (
            Mutant::PdFreesBeforeSend,
            vec![("pd_frees_before_send", "true")],
        ),
        (
            Mutant::PdLayerLayoutMismatch,
            vec![("pd_decode_layer", "2 0")],
        ),
        (
            Mutant::PdAdmitsBeforeEveryLayer,
            vec![("pd_layers_awaited", "1")],
        ),
        (
            Mutant::OverlapOneReadback,
            vec![("overlap_one_readback", "true")],
        ),
        (
            Mutant::AdmissionPassesBlocked,
            vec![("admission_passes_blocked", "true")],
        ),
        (
            Mutant::PrefillBudgetPerRequest,
            vec![("prefill_budget_left", "10")],
        ),
        (
            Mutant::DeviceEvictsNewest,
            vec![("device_eviction_newest_first", "true")],
        ),
        (
            Mutant::HostEvictsNewest,
            vec![("host_eviction_newest_first", "true")],
        ),
        (
            Mutant::WriteThroughSkipsBackup,
            vec![("write_through_backs_up", "false")],
        ),
        (Mutant::SelectiveOnFirstHit, vec![("selective_hits", "1")]),
        (
            Mutant::WriteBackDropsUnbacked,
            vec![("eviction_policy", "WriteThrough WriteThroughSelective")],
        ),
        (
            Mutant::DeviceHitCountsLoads,
            vec![("prefix_hits", "(5, 3) (2, 0)")],
        ),
        (
            Mutant::HostHitPerRequest,
            vec![("prefix_hits", "(2, 1) (2, 0)")],
        ),
        (
            Mutant::AbortFreesPagesInFlight,
            vec![("abort_frees_in_flight_pages", "true")],
        ),
        (
            Mutant::LoadSkipsIndexK,
            vec![("load_skips_index_k", "true")],
        ),
        (
            Mutant::StoreScalesThroughUe8m0,
            vec![("store_ue8m0", "true true")],
        ),
        (Mutant::StagingReusedEarly, vec![("staging_waits", "false")]),
        (
            Mutant::ScratchFreedOnOtherStream,
            vec![("scratch_free_stream", "Write Compute")],
        ),
        (
            Mutant::CallbackOnComputeStream,
            vec![("callback_stream", "Compute")],
        ),
        (
            Mutant::PageableBufferReused,
            vec![("pageable_is_pinned", "true")],
        ),
        (
            Mutant::PdReceivesIntoLastPages,
            vec![("pd_received_pages", "[PageId(12)]")],
        ),
        // Its mistake is in a kernel's reference (`Mutant::kernel`), not at an engine point.
        (Mutant::IndexKReadInterleaved, vec![]),
        (
            Mutant::SparseReadComputeDtype,
            vec![("sparse_read_dtype", "Bf16")],
        ),
        (Mutant::LoadOkAtIssue, vec![("load_ok_at_issue", "true")]),
        (
            Mutant::PdRetryBeforeStaleCopies,
            vec![("pd_gives_up_at_first_failure", "true")],
        ),
        (Mutant::HostLeaseExpires, vec![("host_lease_ns", &lease)]),
        (
            Mutant::PdNoNotificationDeadline,
            vec![("pd_notification_deadline_ns", "None")],
        ),
        (Mutant::PrefixKeysIgnoreWeights, vec![("key_weights", "0")]),
        (
            Mutant::RecreationKeepsDeviceTier,
            vec![("recreation_keeps_device_tier", "true")],
        ),
        (
            Mutant::PdAdmitsAcrossRecreation,
            vec![("pd_admits_across_recreation", "true")],
        ),
        (
            Mutant::LoadEventPooledAtIssue,
            vec![("load_events_pooled_at_issue", "true")],
        ),
        (
            Mutant::GraphsKeptOnRecovery,
            vec![("graphs_kept", "false true")],
        ),
    ];
    assert_eq!(
        changes.iter().map(|c| c.0).collect::<Vec<_>>(),
        Mutant::ALL,
        "one row per mutant, in the zoo's order"
    );
    for (m, changed) in changes {
        let on = Mutants::only(m);
        assert_eq!(on.active(), Some(m));
        for other in Mutant::ALL {
            assert_eq!(
                on.on(other),
                other == m,
                "{} with {} on",
                other.name(),
                m.name()
            );
        }
        let want: Vec<(&str, String)> = CLEAN
            .iter()
            .map(|&(p, clean)| {
                let a = changed.iter().find(|c| c.0 == p).map_or(clean, |c| c.1);
                (p, a.to_string())
            })
            .collect();
        assert_eq!(answers(&on), want, "{}", m.name());
        assert_eq!(m.kernel().is_some(), m == Mutant::IndexKReadInterleaved);
    }
}
