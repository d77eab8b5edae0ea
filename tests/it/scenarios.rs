//! Data-driven scenarios on the in-order CPU device: request scripts run through the engine while
//! the content oracle verifies every KV and index-K read and the digest oracle recomputes every
//! output. One `check` runs a scenario; the cases are data.

use std::cell::RefCell;
use std::rc::Rc;
use tierkv_engine::config::{Config, WritePolicy};
use tierkv_engine::cpu_device::ManualClock;
use tierkv_engine::layout::{HostLayout, IndexKDtype, KvDtype};
use tierkv_engine::synth::Synth;
use tierkv_engine::{Engine, EngineOptions, Output, RequestSpec};
use tierkv_sim::checked::CheckedInOrder;
use tierkv_sim::oracles::content::{ContentOracle, Sampler};
use tierkv_sim::oracles::digest::DigestOracle;

#[derive(Clone, Copy, Debug)]
enum Step {
    /// Submit a prompt of `shared` tokens of the shared stream, then `own` of stream `id`.
    Submit {
        shared: u32,
        own: u32,
        id: u64,
        generate: u32,
    },
    RunToIdle,
    /// Evict every unlocked device page of the prefix cache.
    EvictDevice,
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Seen {
    device_hit_pages: u64,
    host_hit_pages: u64,
    loads: u64,
    load_copies: usize,
    finished: u64,
}

fn check(ik: IndexKDtype, kv: KvDtype, host: HostLayout, script: &[Step]) -> Seen {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.model.index_k_dtype = ik;
    cfg.model.kv_dtype = kv;
    cfg.model.layers = 3;
    cfg.cache.host_layout = host;
    cfg.cache.write_policy = WritePolicy::WriteThrough;
    let synth = Synth::new(11);
    // Every query row held to the specification's logits (none sampled out).
    let every = Sampler { seed: 11, every: 1 };
    let content = Rc::new(RefCell::new(ContentOracle::new(&cfg, synth, every)));
    let mut digests = DigestOracle::new(&cfg);
    let dev = CheckedInOrder::new(content.clone());
    let mut e = Engine::new(
        cfg,
        dev,
        ManualClock::default(),
        EngineOptions {
            seed: 11,
            ..Default::default()
        },
    )
    .unwrap();
    let mut seen = Seen::default();
    let mut load_copies_before = 0;
    for step in script {
        match *step {
            Step::Submit {
                shared,
                own,
                id,
                generate,
            } => {
                let mut p: Vec<u32> = (0..shared as u64).map(|i| synth.token(1, i)).collect();
                p.extend((0..own as u64).map(|i| synth.token(100 + id, i)));
                let r = e
                    .submit(RequestSpec {
                        prompt: p.clone(),
                        max_new_tokens: generate,
                    })
                    .unwrap();
                content.borrow_mut().tokens.insert(r, p);
            }
            Step::RunToIdle => loop {
                let rep = e.step().unwrap();
                e.check_invariants();
                for o in e.drain_outputs() {
                    match o {
                        Output::Digests {
                            request,
                            position,
                            digests: d,
                        } => {
                            let m = digests.check(&mut content.borrow_mut(), request, position, &d);
                            assert_eq!(m, None, "digest oracle");
                        }
                        Output::Token { request, token, .. } => content
                            .borrow_mut()
                            .tokens
                            .get_mut(&request)
                            .unwrap()
                            .push(token),
                        Output::Finished { .. } => seen.finished += 1,
                        other => panic!("unexpected output {other:?}"),
                    }
                }
                if rep.idle {
                    break;
                }
            },
            Step::EvictDevice => {
                e.evict_device(usize::MAX).unwrap();
                load_copies_before = e
                    .dev
                    .inner
                    .log
                    .iter()
                    .filter(|n| **n == "page_copy")
                    .count();
            }
        }
    }
    assert!(
        e.dev.findings.is_empty(),
        "content oracle: {:?}",
        e.dev.findings
    );
    assert!(content.borrow().rows_checked > 0);
    e.check_quiescent().unwrap();
    seen.device_hit_pages = e.metrics.prefix_pages_device_hit;
    seen.host_hit_pages = e.metrics.prefix_pages_host_hit;
    seen.loads = e.metrics.loads;
    seen.load_copies = e
        .dev
        .inner
        .log
        .iter()
        .filter(|n| **n == "page_copy")
        .count()
        - load_copies_before;
    seen
}

/// Two sessions share a 4-page prefix (a device hit); after forced device eviction a third
/// request hits the host tier and loads the prefix back layer by layer — every read verified, for
/// both index-K dtypes, both KV formats and both host layouts.
#[test]
fn shared_prefix_device_hit_then_host_hit_with_layerwise_load() {
    use Step::*;
    let script = [
        Submit {
            shared: 256,
            own: 40,
            id: 1,
            generate: 4,
        },
        RunToIdle,
        Submit {
            shared: 256,
            own: 30,
            id: 2,
            generate: 3,
        },
        RunToIdle,
        EvictDevice,
        Submit {
            shared: 256,
            own: 50,
            id: 3,
            generate: 5,
        },
        RunToIdle,
    ];
    for ik in IndexKDtype::ALL {
        for kv in KvDtype::ALL {
            for host in HostLayout::ALL {
                let s = check(ik, kv, host, &script);
                assert_eq!(s.finished, 3, "{ik:?} {kv:?} {host:?}");
                assert_eq!(
                    s.device_hit_pages, 4,
                    "the second request hits the 4 shared pages on the device"
                );
                assert_eq!(
                    s.host_hit_pages, 4,
                    "after eviction the third hits them on the host"
                );
                assert_eq!(s.loads, 1);
                // Layer-wise: for each of the 3 layers one KV and one index-K copy (the third
                // request adds no full page of its own, so it backs up nothing).
                assert_eq!(s.load_copies, 3 * 2, "{ik:?} {kv:?} {host:?}");
            }
        }
    }
}
