use tierkv_engine::cpu_device::{InOrderDevice, ManualClock};
use tierkv_engine::device::DeviceError;
use tierkv_engine::layout::BufferKind;
use tierkv_engine::synth::Synth;
use tierkv_engine::EngineError;
use tierkv_engine::{Config, Engine, EngineOptions, Output, Rejection, RequestSpec};

fn prompt(synth: &Synth, shared: usize, own: usize, stream: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..shared as u64).map(|i| synth.token(7, i)).collect();
    p.extend((0..own as u64).map(|i| synth.token(stream, i)));
    p
}

/// An engine of `cfg` on the in-order CPU device.
fn engine(cfg: Config, options: EngineOptions) -> Engine<InOrderDevice, ManualClock> {
    Engine::new(cfg, InOrderDevice::new(), ManualClock::default(), options).unwrap()
}

/// The tokens generated in `out`, in order.
fn tokens_of(out: &[Output]) -> Vec<u32> {
    out.iter()
        .filter_map(|o| match o {
            Output::Token { token, .. } => Some(*token),
            _ => None,
        })
        .collect()
}

fn run_to_idle(e: &mut Engine<InOrderDevice, ManualClock>) -> Vec<Output> {
    let mut out = Vec::new();
    for _ in 0..10_000 {
        let r = e.step().expect("step");
        e.check_invariants();
        out.extend(e.drain_outputs());
        if r.idle {
            return out;
        }
    }
    panic!("engine did not go idle");
}

/// The coverage probes `spec`'s request hits, submitted alone and run to idle.
fn probes_of(
    e: &mut Engine<InOrderDevice, ManualClock>,
    spec: RequestSpec,
) -> std::collections::BTreeMap<&'static str, u64> {
    tierkv_engine::probe::take();
    e.submit(spec).unwrap();
    run_to_idle(e);
    tierkv_engine::probe::take()
}

#[test]
fn requests_finish_and_share_their_prefix() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let a = e
        .submit(RequestSpec {
            prompt: prompt(&s, 256, 40, 1),
            max_new_tokens: 5,
        })
        .unwrap();
    let out = run_to_idle(&mut e);
    // It finished with exactly the 5 tokens it emitted, in order, each the one its digests name.
    let tokens: Vec<u32> = out
        .iter()
        .filter_map(|o| match o {
            Output::Token { request, token, .. } if *request == a => Some(*token),
            _ => None,
        })
        .collect();
    assert_eq!(tokens.len(), 5, "{out:?}");
    let finished: Vec<&Vec<u32>> = out
        .iter()
        .filter_map(|o| match o {
            Output::Finished { request, generated } if *request == a => Some(generated),
            _ => None,
        })
        .collect();
    assert_eq!(
        finished,
        [&tokens],
        "finished once, with the emitted tokens"
    );
    let last_digests = out
        .iter()
        .rev()
        .find_map(|o| match o {
            Output::Digests {
                request, digests, ..
            } if *request == a => Some(digests),
            _ => None,
        })
        .expect("digests");
    assert_eq!(e.synth.next_token(last_digests), tokens[4]);
    let hits_before = e.metrics.prefix_pages_device_hit;
    let b = e
        .submit(RequestSpec {
            prompt: prompt(&s, 256, 30, 2),
            max_new_tokens: 3,
        })
        .unwrap();
    let out = run_to_idle(&mut e);
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Finished { request, .. } if *request == b)));
    assert_eq!(
        e.metrics.prefix_pages_device_hit - hits_before,
        4,
        "the 4 shared pages hit on the device"
    );
    e.check_quiescent().unwrap();
}

#[test]
fn same_inputs_same_outputs() {
    let run = || {
        let cfg = Config::preset("sim-small").unwrap();
        let mut e = Engine::new(
            cfg,
            InOrderDevice::new(),
            ManualClock::default(),
            EngineOptions {
                seed: 3,
                ..Default::default()
            },
        )
        .unwrap();
        let s = e.synth;
        for i in 0..6 {
            e.submit(RequestSpec {
                prompt: prompt(&s, 128, 20 + i, i as u64),
                max_new_tokens: 4,
            })
            .unwrap();
        }
        run_to_idle(&mut e)
    };
    assert_eq!(run(), run());
}

#[test]
fn over_limit_intake_is_rejected_and_the_queue_stays_bounded() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.scheduler.queued_requests_max = 3;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    for i in 0..3 {
        e.submit(RequestSpec {
            prompt: prompt(&s, 0, 10, i),
            max_new_tokens: 2,
        })
        .unwrap();
    }
    for i in 3..50 {
        let err = e
            .submit(RequestSpec {
                prompt: prompt(&s, 0, 10, i),
                max_new_tokens: 2,
            })
            .unwrap_err();
        assert!(
            matches!(
                err,
                Rejection::QueueFull {
                    queued: 3,
                    limit: 3
                }
            ),
            "{err}"
        );
        assert_eq!(e.queue_len(), 3);
    }
    assert_eq!(e.metrics.rejected_queue_full, 47);
    let err = e
        .submit(RequestSpec {
            prompt: vec![],
            max_new_tokens: 2,
        })
        .unwrap_err();
    assert!(matches!(err, Rejection::Invalid { .. }));
    let err = e
        .submit(RequestSpec {
            prompt: vec![u32::MAX],
            max_new_tokens: 2,
        })
        .unwrap_err();
    assert!(matches!(err, Rejection::Invalid { .. }), "{err}");
    assert_eq!(
        (e.metrics.rejected_invalid, e.metrics.requests_submitted),
        (2, 3),
        "each invalid request counted once"
    );
    run_to_idle(&mut e);
    e.check_quiescent().unwrap();
}

/// A finished request whose full pages the tree already holds (the same prompt computed beside
/// it) hits `finish.duplicate_pages`; one whose pages are new to the tree does not.
#[test]
fn only_a_finish_over_pages_the_tree_holds_hits_the_duplicate_probe() {
    use tierkv_engine::probe;
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = |stream| RequestSpec {
        prompt: prompt(&s, 0, 200, stream),
        max_new_tokens: 2,
    };
    probe::take();
    e.submit(spec(1)).unwrap();
    run_to_idle(&mut e);
    assert!(
        !probe::take().contains_key("finish.duplicate_pages"),
        "a prompt alone"
    );
    // Two of another prompt side by side: neither finds the other's pages at admission.
    e.submit(spec(2)).unwrap();
    e.submit(spec(2)).unwrap();
    run_to_idle(&mut e);
    assert!(
        probe::take().contains_key("finish.duplicate_pages"),
        "two of one prompt"
    );
}

/// A backup whose host-page allocation is refused by an injected fault, on an empty host tier
/// (nothing to evict, every page free), allocates once more rather than giving up as if the
/// host were full: on a fresh write-through engine, one request's backup is issued exactly
/// when fewer than two of its allocations were refused.
#[test]
fn a_refused_host_allocation_on_an_empty_host_is_tried_again() {
    use tierkv_engine::pools::EngineFaults;
    use tierkv_engine::probe;
    let mut refused_once = 0;
    for seed in 0..24 {
        let cfg = Config::preset("sim-small").unwrap();
        let mut e = engine(cfg, EngineOptions::default());
        e.inject(EngineFaults {
            seed,
            device_pages_refused_rate: 0.0,
            host_pages_refused_rate: 0.5,
        });
        let s = e.synth;
        probe::take();
        e.submit(RequestSpec {
            prompt: prompt(&s, 0, 200, 1),
            max_new_tokens: 2,
        })
        .unwrap();
        run_to_idle(&mut e);
        let hits = probe::take();
        let refused = hits.get("fault.host_pages_refused").copied().unwrap_or(0);
        assert_eq!(
            e.metrics.backups,
            u64::from(refused < 2),
            "seed {seed}: {refused} refusals, {:?}",
            e.metrics
        );
        refused_once += u32::from(refused == 1);
    }
    assert!(refused_once > 0, "no seed refused exactly once");
}

/// Under write-through, two prompts that share a prefix and finish in one step: the second's
/// backup waits for the first's (which covers the shared pages) and goes once that one ends,
/// so both are whole on the host; a prompt finished again, its pages on the host already,
/// defers nothing.
#[test]
fn a_backup_deferred_behind_an_ancestors_goes_once_that_one_ends() {
    use tierkv_engine::probe;
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = |stream| RequestSpec {
        prompt: prompt(&s, 128, 128, stream),
        max_new_tokens: 2,
    };
    probe::take();
    e.submit(spec(1)).unwrap();
    e.submit(spec(2)).unwrap();
    run_to_idle(&mut e);
    let hits = probe::take();
    assert!(
        hits.contains_key("backup.deferred") && hits.contains_key("backup.retried"),
        "{hits:?}"
    );
    // Two shared pages and two of each prompt's own: six, all on the host.
    assert_eq!(e.metrics.host_tokens_used, 6 * 64, "{:?}", e.metrics);
    e.submit(spec(1)).unwrap();
    run_to_idle(&mut e);
    let hits = probe::take();
    assert!(
        !hits.contains_key("backup.deferred") && !hits.contains_key("backup.retried"),
        "{hits:?}"
    );
    assert_eq!(e.metrics.host_tokens_used, 6 * 64, "{:?}", e.metrics);
}

/// A transfer that refuses its first copy with `error`, then copies.
struct RefusesFirst(Option<DeviceError>);

impl tierkv_engine::transfer::Transfer for RefusesFirst {
    fn copy_pages<D: tierkv_engine::device::Device>(
        &mut self,
        dev: &mut D,
        stream: tierkv_engine::device::StreamKind,
        src: tierkv_engine::pools::PoolSide,
        dst: tierkv_engine::pools::PoolSide,
        pairs: &[(tierkv_engine::layout::PageId, tierkv_engine::layout::PageId)],
    ) -> Result<(), tierkv_engine::transfer::TransferError> {
        match self.0.take() {
            Some(e) => Err(e.into()),
            None => tierkv_engine::transfer::PageRuns.copy_pages(dev, stream, src, dst, pairs),
        }
    }
}

/// A write-through engine (`sim-small`) whose first copy, a backup's, is refused with `error`,
/// given one 200-token prompt.
fn first_backup_refused(error: DeviceError) -> Engine<InOrderDevice, ManualClock, RefusesFirst> {
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = Engine::with_transfer(
        cfg,
        InOrderDevice::new(),
        ManualClock::default(),
        RefusesFirst(Some(error)),
        EngineOptions::default(),
    )
    .unwrap();
    let s = e.synth;
    e.submit(RequestSpec {
        prompt: prompt(&s, 0, 200, 1),
        max_new_tokens: 2,
    })
    .unwrap();
    e
}

/// A copy the transfer refuses for a reason that is not transient (a refusal of its arguments,
/// as a layout check gives one) is a bug, not a failed transfer: the engine stops with it
/// rather than unwinding the backup and going on.
#[test]
fn a_copy_refused_for_its_arguments_stops_the_engine() {
    let mut e = first_backup_refused(DeviceError::Kernel {
        op: "page_copy",
        detail: "refused by the test".into(),
    });
    for _ in 0..1_000 {
        match e.step() {
            Ok(r) => assert!(!r.idle, "the engine went idle past the refused copy"),
            Err(err) => {
                assert!(err.to_string().contains("refused by the test"), "{err}");
                return;
            }
        }
    }
    panic!("the engine never stopped");
}

/// A backup whose copy could not be enqueued for a transient reason fails alone: the engine
/// goes on, and recovers no device whose event reports no failure.
#[test]
fn a_backup_not_enqueued_fails_without_recovering_a_healthy_device() {
    use tierkv_engine::probe;
    let mut e = first_backup_refused(DeviceError::Backend {
        detail: "busy (the test)".into(),
    });
    probe::take();
    let mut steps = 0;
    while !e.step().expect("the engine goes on").idle {
        steps += 1;
        assert!(steps < 1_000, "the engine did not go idle");
    }
    let hits = probe::take();
    assert!(hits.contains_key("backup.enqueue_failed"), "{hits:?}");
    assert!(!hits.contains_key("device.recovered"), "{hits:?}");
    assert_eq!(e.metrics.backup_failures, 1, "{:?}", e.metrics);
}

/// `intake.request_fills_context` is hit by a request whose prompt and new tokens together
/// take exactly the longest context, and not by one a token shorter.
#[test]
fn only_a_request_that_fills_the_context_hits_its_probe() {
    let cfg = Config::preset("sim-small").unwrap();
    let max = cfg.model.context_tokens_max;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    for (new, fills) in [(4, true), (3, false)] {
        let hits = probes_of(
            &mut e,
            RequestSpec {
                prompt: prompt(&s, 0, max as usize - 4, u64::from(new)),
                max_new_tokens: new,
            },
        );
        assert_eq!(
            hits.contains_key("intake.request_fills_context"),
            fills,
            "{new} new tokens: {hits:?}"
        );
    }
}

/// A prompt that would take the queued tokens past `pending_tokens_max` is refused and counted
/// as that refusal alone; the queue's first request is served as before.
#[test]
fn a_refusal_for_pending_tokens_is_counted_as_one() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.scheduler.pending_tokens_max = 300;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = |stream| RequestSpec {
        prompt: prompt(&s, 0, 200, stream),
        max_new_tokens: 2,
    };
    e.submit(spec(1)).unwrap();
    for stream in 2..5 {
        let err = e.submit(spec(stream)).unwrap_err();
        assert!(
            matches!(
                err,
                Rejection::PendingTokens {
                    pending: 200,
                    prompt: 200,
                    limit: 300
                }
            ),
            "{err}"
        );
    }
    let m = &e.metrics;
    assert_eq!(
        (
            m.rejected_pending_tokens,
            m.rejected_queue_full,
            m.rejected_invalid,
            m.requests_submitted
        ),
        (3, 0, 0, 1)
    );
    assert_eq!(tokens_of(&run_to_idle(&mut e)).len(), 2);
}

/// Each request's digests (by position) and generated tokens.
type PerRequest = std::collections::BTreeMap<u64, (Vec<(u32, Vec<u64>)>, Vec<u32>)>;

fn per_request(out: &[Output]) -> PerRequest {
    let mut m = PerRequest::new();
    for o in out {
        match o {
            Output::Digests {
                request,
                position,
                digests,
            } => m
                .entry(*request)
                .or_default()
                .0
                .push((*position, digests.clone())),
            Output::Finished { request, generated } => {
                m.entry(*request).or_default().1 = generated.clone()
            }
            _ => {}
        }
    }
    m
}

/// An engine that runs one step ahead (the tokens of the step in flight read on the device)
/// computes, request by request, exactly what the in-order engine computes: the same digests at
/// every position and the same tokens. Its steps overlapped (some row had a pending token), and
/// a request aborted with a row in flight gave all its memory back.
#[test]
fn running_ahead_computes_what_the_in_order_engine_does() {
    let run = |overlap: bool, abort: Option<usize>| {
        let mut cfg = Config::preset("sim-small").unwrap();
        cfg.scheduler.prefill_tokens_per_step_max = 96;
        let mut e = Engine::new(
            cfg,
            InOrderDevice::new(),
            ManualClock::default(),
            EngineOptions {
                seed: 5,
                overlap,
                ..Default::default()
            },
        )
        .unwrap();
        let s = e.synth;
        tierkv_engine::probe::take();
        let mut ids = Vec::new();
        for i in 0..5 {
            ids.push(
                e.submit(RequestSpec {
                    prompt: prompt(&s, 128, 30 + 7 * i, i as u64),
                    max_new_tokens: 6 + i as u32,
                })
                .unwrap(),
            );
        }
        let mut out = Vec::new();
        for step in 0..10_000 {
            let r = e.step().expect("step");
            e.check_invariants();
            out.extend(e.drain_outputs());
            if abort == Some(step) {
                assert!(e.abort(ids[4]), "request still running at step {step}");
            }
            if r.idle {
                e.check_quiescent().unwrap();
                let hits = tierkv_engine::probe::take();
                return (per_request(&out), hits);
            }
        }
        panic!("engine did not go idle");
    };
    let (in_order, _) = run(false, None);
    let (ahead, hits) = run(true, None);
    assert_eq!(in_order.len(), 5);
    assert_eq!(ahead, in_order);
    assert!(
        hits.get("ahead.pending_token").copied().unwrap_or(0) > 0,
        "{hits:?}"
    );
    assert!(hits.get("ahead.step").copied().unwrap_or(0) > 0, "{hits:?}");
    // Aborts at steps 2..12: some land with the request's row in flight.
    let mut deferred = 0;
    for step in 2..12 {
        let (aborted, hits) = run(true, Some(step));
        deferred += hits.get("ahead.row_of_aborted").copied().unwrap_or(0);
        for id in in_order.keys().take(4) {
            assert_eq!(
                aborted[id], in_order[id],
                "request {id}, abort at step {step}"
            );
        }
    }
    assert!(deferred > 0, "no abort landed with a row in flight");
}

/// Under write-back, handing device pages back backs the evicted prefix up first: once the
/// backups land the pages are free and the prefix is still cached, on the host, where the same
/// prompt finds it again (host prefix hits, none on the device).
#[test]
fn write_back_eviction_keeps_the_prefix_on_the_host() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteBack;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    // 4 full pages and a part: all 4 can be matched again.
    let spec = || RequestSpec {
        prompt: prompt(&s, 256, 32, 1),
        max_new_tokens: 4,
    };
    e.submit(spec()).unwrap();
    let computed = tokens_of(&run_to_idle(&mut e));
    assert_eq!(e.metrics.backups, 0, "write-back backs up only on eviction");
    // Hand every page back; a leaf goes once its backup landed, then its parent is a leaf.
    let evict_all = |e: &mut Engine<InOrderDevice, ManualClock>| {
        for _ in 0..16 {
            if e.metrics.device_pages_used == 0 {
                break;
            }
            e.evict_device(4).unwrap();
            run_to_idle(e);
        }
        assert_eq!(e.metrics.device_pages_used, 0, "{:?}", e.metrics);
    };
    evict_all(&mut e);
    assert!(e.metrics.backups > 0);
    assert_eq!(
        e.metrics.host_tokens_used,
        4 * 64,
        "the 4 pages, on the host"
    );
    // Another prompt of the same length takes the freed device pages (the most recently freed
    // first) and writes its own rows into them, so that a load must bring the prefix's back.
    e.submit(RequestSpec {
        prompt: prompt(&s, 0, 288, 2),
        max_new_tokens: 1,
    })
    .unwrap();
    run_to_idle(&mut e);
    evict_all(&mut e);
    let (device_hits, host_hits) = (
        e.metrics.prefix_pages_device_hit,
        e.metrics.prefix_pages_host_hit,
    );
    e.submit(spec()).unwrap();
    let loaded = tokens_of(&run_to_idle(&mut e));
    assert_eq!(
        (
            e.metrics.prefix_pages_device_hit - device_hits,
            e.metrics.prefix_pages_host_hit - host_hits
        ),
        (0, 4),
        "the prefix was kept on the host: {:?}",
        e.metrics
    );
    // Both caches of every layer came back: what the loaded prefix's KV and index-K give is
    // what computing them gave.
    assert_eq!(loaded, computed, "the tokens after a load from the host");
    // What moved, every layer's KV and index-K page of each page: the four pages loaded, and
    // the two prompts' four pages each backed up at their eviction.
    let layout = e.layout();
    let page: u64 = (0..layout.layers())
        .map(|_| layout.page_bytes(BufferKind::Kv).0 + layout.page_bytes(BufferKind::IndexK).0)
        .sum();
    assert_eq!(e.metrics.load_bytes, 4 * page, "{:?}", e.metrics);
    assert_eq!(e.metrics.backups, 2, "{:?}", e.metrics);
    assert_eq!(e.metrics.backup_bytes, 2 * 4 * page, "{:?}", e.metrics);
}

/// Under write-back, a page whose backup cannot be issued (here the host tier refuses every
/// allocation) is dropped instead: handing pages back frees them, whatever the host can take.
#[test]
fn write_back_eviction_drops_what_it_cannot_back_up() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteBack;
    let options = EngineOptions {
        faults: tierkv_engine::pools::EngineFaults {
            seed: 1,
            device_pages_refused_rate: 0.0,
            host_pages_refused_rate: 1.0,
        },
        ..EngineOptions::default()
    };
    let mut e = engine(cfg, options);
    let s = e.synth;
    e.submit(backed_up_prompt(&s)).unwrap();
    run_to_idle(&mut e);
    let used = e.metrics.device_pages_used;
    assert!(used >= 4, "{:?}", e.metrics);
    let mut freed = 0;
    for _ in 0..16 {
        freed += e.evict_device(8).unwrap();
        run_to_idle(&mut e);
    }
    assert_eq!((freed as u64, e.metrics.device_pages_used), (used, 0));
    assert_eq!(e.metrics.backups, 0, "no backup could be issued");
}

/// A weight update: refused while a request is queued; then a prompt whose prefix the cache
/// holds under the old weights matches none of it, and its tokens are the new model's.
#[test]
fn a_weight_update_leaves_the_old_weights_kv_unmatched() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = || RequestSpec {
        prompt: prompt(&s, 256, 40, 1),
        max_new_tokens: 4,
    };
    e.submit(spec()).unwrap();
    assert_eq!(
        e.queued_tokens(),
        spec().prompt.len() as u64,
        "the queued prompt's tokens"
    );
    let err = e.update_weights(1).expect_err("a queued request");
    assert!(
        matches!(
            err,
            tierkv_engine::EngineError::NotIdle {
                step_in_flight: 0,
                requests: 1,
                loads: 0,
                exports: 0,
                imports: 0
            }
        ),
        "{err}"
    );
    let before = tokens_of(&run_to_idle(&mut e));
    // The same prompt again, same weights: its full prompt pages are device hits.
    e.submit(spec()).unwrap();
    let again = tokens_of(&run_to_idle(&mut e));
    assert_eq!(again, before, "the same model gives the same tokens");
    let hits = e.metrics.prefix_pages_device_hit;
    assert!(hits >= 4, "the second run matched {hits} pages");
    e.update_weights(1).expect("idle");
    assert_eq!(e.weights(), 1);
    e.submit(spec()).unwrap();
    let after = tokens_of(&run_to_idle(&mut e));
    assert_eq!(
        e.metrics.prefix_pages_device_hit, hits,
        "the old weights' pages were matched after the update"
    );
    assert_ne!(after, before, "the new weights give other tokens");
    let max = tierkv_engine::cache::WEIGHTS_VERSION_MAX;
    assert!(matches!(
        e.update_weights(max + 1),
        Err(tierkv_engine::EngineError::WeightsVersion(v)) if v == max + 1
    ));
    e.update_weights(max).expect("the largest version");
    assert_eq!(e.weights(), max);
    // A prefix key's first word holds the version in its top 16 bits, above the token id: 2^16
    // would wrap to version 0's keys, so it is refused however the limit is computed.
    assert!(e.update_weights(65_536).is_err(), "a version past 16 bits");
    assert_eq!(max, 65_535);
}

/// The pool sizes the metrics export from the first step on are the configured ones: the
/// device pool's pages and the host tier's tokens (a capacity in whole pages).
#[test]
fn the_metrics_start_with_the_configured_pool_sizes() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.device_pages = 40;
    cfg.cache.host = tierkv_engine::config::HostCapacity::Tokens(100 * 64);
    let e = engine(cfg, EngineOptions::default());
    assert_eq!(e.metrics.device_pages_total, 40);
    assert_eq!(e.metrics.host_tokens_capacity, 6_400);
    assert_eq!(e.metrics.device_pages_used, 0);
    assert_eq!(e.metrics.host_tokens_used, 0);
}

/// A weight update is refused while any work is left, and the refusal counts each kind: here a
/// step in flight (running one step ahead), one request running and one queued. The
/// quiescence audit refuses the engine then, and passes it once idle.
#[test]
fn a_weight_update_counts_the_work_left() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.scheduler.running_requests_max = 1;
    let options = EngineOptions {
        overlap: true,
        ..EngineOptions::default()
    };
    let mut e = engine(cfg, options);
    let s = e.synth;
    let spec = |stream| RequestSpec {
        prompt: prompt(&s, 0, 100, stream),
        max_new_tokens: 8,
    };
    e.submit(spec(1)).unwrap();
    e.step().expect("step");
    e.submit(spec(2)).unwrap();
    let err = e.update_weights(1).expect_err("work is left");
    assert!(
        matches!(
            err,
            tierkv_engine::EngineError::NotIdle {
                step_in_flight: 1,
                requests: 2,
                loads: 0,
                exports: 0,
                imports: 0
            }
        ),
        "{err}"
    );
    // The quiescence audit refuses it too, and names the work left.
    let left = e.check_quiescent().expect_err("work is left");
    assert!(left.starts_with("not idle: 1 queued, 1 running,"), "{left}");
    run_to_idle(&mut e);
    e.check_quiescent().expect("idle, nothing leaked");
    e.update_weights(1).expect("idle");
}

/// Selective write-through backs a prefix up once it is matched for the second time, and not
/// before: the first run stores it, the second matches it once, the third twice.
#[test]
fn selective_write_through_backs_up_on_the_second_hit() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteThroughSelective;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = || RequestSpec {
        prompt: prompt(&s, 256, 32, 1),
        max_new_tokens: 1,
    };
    let mut backups = Vec::new();
    for _ in 0..3 {
        e.submit(spec()).unwrap();
        run_to_idle(&mut e);
        backups.push(e.metrics.backups);
    }
    assert_eq!(backups[..2], [0, 0], "backups after each run: {backups:?}");
    assert!(backups[2] > 0, "backups after each run: {backups:?}");
}

/// Under write-through, a prefix's pages and an extension of it, stored by two requests
/// submitted together, all end up on the host.
#[test]
fn write_through_backs_up_a_prefix_and_its_extension() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteThrough;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    for own in [0, 256] {
        e.submit(RequestSpec {
            prompt: prompt(&s, 256, own + 32, 1),
            max_new_tokens: 1,
        })
        .unwrap();
    }
    run_to_idle(&mut e);
    assert_eq!(
        e.metrics.host_tokens_used,
        8 * 64,
        "every full page on the host: {:?}",
        e.metrics
    );
}

/// Indexing every prompt token changes no generated token: the synthetic model draws each
/// position's query from its token and position alone, so the last prompt token's selection is
/// the same either way. Under every-token indexing each 150-token prompt's query rows take more
/// than two launches (`QUERY_ROWS_PER_LAUNCH` = 64), so the later launches' rows must land
/// where the first launch's do not.
#[test]
fn indexing_every_prompt_token_generates_the_same_tokens() {
    let run = |indexer| {
        let mut cfg = Config::preset("sim-small").unwrap();
        cfg.model.prefill_indexer = indexer;
        let mut e = engine(cfg, EngineOptions::default());
        let s = e.synth;
        for stream in [1, 2] {
            e.submit(RequestSpec {
                prompt: prompt(&s, 20, 130, stream),
                max_new_tokens: 6,
            })
            .unwrap();
        }
        let out = run_to_idle(&mut e);
        assert_eq!(e.metrics.requests_finished, 2);
        tokens_of(&out)
    };
    use tierkv_engine::config::PrefillIndexer;
    const { assert!(tierkv_engine::engine::QUERY_ROWS_PER_LAUNCH < 150 / 2) };
    let every = run(PrefillIndexer::EveryToken);
    assert_eq!(every.len(), 12);
    assert_eq!(every, run(PrefillIndexer::LastToken));
}

/// A request's tokens come out numbered from 0, one each, in order, and the metrics count them.
#[test]
fn a_requests_tokens_are_numbered_in_order() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let id = e
        .submit(RequestSpec {
            prompt: prompt(&s, 0, 70, 3),
            max_new_tokens: 5,
        })
        .unwrap();
    let indices: Vec<u32> = run_to_idle(&mut e)
        .iter()
        .filter_map(|o| match o {
            Output::Token { request, index, .. } if *request == id => Some(*index),
            _ => None,
        })
        .collect();
    assert_eq!(indices, [0, 1, 2, 3, 4]);
    // The engine's cache holds the prompt's one full page, on the device (`Engine::cache`).
    assert_eq!(e.cache().device_pages().len(), 1);
    // Counted: the 70 prompt tokens computed once, the 5 generated.
    assert_eq!(
        (e.metrics.prefill_tokens, e.metrics.generated_tokens),
        (70, 5)
    );
}

/// The coverage probes of admission and eviction count only what happened: a prefix found on
/// the device or on the host, pages a device eviction freed or queued for a write-back (the
/// simulator's coverage reads
/// them, so a probe counted for nothing would claim coverage no seed reached).
#[test]
fn the_prefix_and_eviction_probes_count_only_what_happened() {
    use tierkv_engine::probe;
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteBack;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = || RequestSpec {
        prompt: prompt(&s, 256, 32, 1),
        max_new_tokens: 1,
    };
    let (device, host) = ("admit.device_prefix", "admit.host_prefix");
    let (evicted, pending) = ("device.evicted", "device.write_back_pending");
    let h = probes_of(&mut e, spec());
    assert!(!h.contains_key(device) && !h.contains_key(host), "{h:?}");
    let h = probes_of(&mut e, spec());
    assert!(h.contains_key(device) && !h.contains_key(host), "{h:?}");
    for _ in 0..16 {
        if e.metrics.device_pages_used == 0 {
            break;
        }
        e.evict_device(4).unwrap();
        run_to_idle(&mut e);
    }
    assert_eq!(e.metrics.device_pages_used, 0, "{:?}", e.metrics);
    let h = probe::take();
    assert!(h.contains_key(evicted) && h.contains_key(pending), "{h:?}");
    assert_eq!(e.evict_device(4).unwrap(), 0, "nothing left to evict");
    let h = probe::take();
    assert!(
        !h.contains_key(evicted) && !h.contains_key(pending),
        "{h:?}"
    );
    let h = probes_of(&mut e, spec());
    assert!(!h.contains_key(device) && h.contains_key(host), "{h:?}");
}

/// The scheduler's coverage probes count only what happened: a prompt cached whole (on a page
/// boundary or not) when it ran before, and never a request that fills the context or a batch
/// that recomputes generated tokens here (a prompt prefilled in chunks recomputes none).
#[test]
fn the_scheduler_probes_count_only_what_happened() {
    let mut cfg = Config::preset("sim-small").unwrap();
    // Prompts longer than a step's budget are prefilled in chunks.
    cfg.scheduler.prefill_tokens_per_step_max = 64;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let (fills, whole, boundary, recomputes) = (
        "intake.request_fills_context",
        "admit.whole_prompt_cached",
        "admit.cached_prompt_on_page_boundary",
        "batch.recomputes_generated",
    );
    let mut run = |len: usize, stream: u64| {
        let spec = RequestSpec {
            prompt: prompt(&s, 0, len, stream),
            max_new_tokens: 3,
        };
        let h = probes_of(&mut e, spec);
        assert!(
            !h.contains_key(fills)
                && !h.contains_key(recomputes)
                && !h.contains_key("admit.page_table_full"),
            "{h:?}"
        );
        (h.contains_key(whole), h.contains_key(boundary))
    };
    assert_eq!(run(100, 1), (false, false), "nothing cached yet");
    assert_eq!(run(100, 1), (true, false), "cached whole, 100 tokens");
    assert_eq!(run(128, 2), (false, false), "nothing cached yet");
    assert_eq!(run(128, 2), (true, true), "cached whole, two pages");
    assert_eq!(run(200, 3), (false, false), "chunked, nothing cached yet");
    assert_eq!(run(200, 2), (false, false), "two of three pages cached");
    assert_eq!(run(64, 4), (false, false), "one page, none of it cacheable");
    // Run again: still nothing cached to match, so neither probe (with `>=` for `>` the
    // boundary probe would take the empty match for a whole one).
    assert_eq!(
        run(64, 4),
        (false, false),
        "one page again, nothing cacheable"
    );
}

/// The probe of a request that stops at `scheduler.output_tokens_max` counts only that: not a
/// request that asked for fewer tokens, whatever it generated.
#[test]
fn the_output_limit_probe_counts_only_a_request_stopped_there() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.scheduler.output_tokens_max = 4;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let mut run = |max_new_tokens| {
        let spec = RequestSpec {
            prompt: prompt(&s, 0, 40, max_new_tokens as u64),
            max_new_tokens,
        };
        probes_of(&mut e, spec).contains_key("finish.at_output_max")
    };
    assert!(!run(3), "stopped below the limit");
    assert!(run(4), "stopped at the limit");
}

/// An abort while a backup is in flight (under write-through, one request's prompt backed up
/// once it finished, acknowledged at the next step; another request aborted) hits its probe.
#[test]
fn an_abort_with_a_backup_in_flight_hits_its_probe() {
    use tierkv_engine::probe;
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteThrough;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    e.submit(RequestSpec {
        prompt: prompt(&s, 0, 288, 1),
        max_new_tokens: 1,
    })
    .unwrap();
    let id = e
        .submit(RequestSpec {
            prompt: prompt(&s, 0, 40, 2),
            max_new_tokens: 32,
        })
        .unwrap();
    for _ in 0..100 {
        e.step().expect("step");
        if e.metrics.backups > 0 {
            break;
        }
    }
    assert_eq!(e.metrics.backups, 1, "{:?}", e.metrics);
    probe::take();
    assert!(e.abort(id));
    assert!(probe::take().contains_key("abort.mid_backup"));
    run_to_idle(&mut e);
    e.check_quiescent().unwrap();
}

/// The top-k probes count a query row as covering its context exactly when its position is
/// below `index_topk` (every earlier key selected), and as selecting from position
/// `index_topk` on.
#[test]
fn the_topk_probes_split_rows_at_index_topk() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.model.index_topk = 64;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let mut run = |len: usize, new: u32| {
        let spec = RequestSpec {
            prompt: prompt(&s, 0, len, len as u64),
            max_new_tokens: new,
        };
        let h = probes_of(&mut e, spec);
        (
            h.contains_key("indexer.topk_covers_context"),
            h.contains_key("indexer.topk_selects"),
        )
    };
    assert_eq!(run(10, 3), (true, false), "positions 9 to 11");
    // The prompt's last row (63) covers its context; the first generated (64) selects.
    assert_eq!(run(64, 2), (true, true), "positions 63 and 64");
}

/// The abort probes name the request's state: a queued one, a running one, and no backup in
/// flight when there is none; the metrics count both submissions and both aborts.
#[test]
fn the_abort_probes_name_the_requests_state() {
    use tierkv_engine::probe;
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.scheduler.running_requests_max = 1;
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = |stream| RequestSpec {
        prompt: prompt(&s, 0, 100, stream),
        max_new_tokens: 8,
    };
    let running = e.submit(spec(1)).unwrap();
    e.step().expect("step");
    let queued = e.submit(spec(2)).unwrap();
    let state = |h: &std::collections::BTreeMap<&str, u64>| {
        ["abort.queued", "abort.running", "abort.mid_backup"].map(|p| h.contains_key(p))
    };
    probe::take();
    assert!(e.abort(queued));
    assert_eq!(
        state(&probe::take()),
        [true, false, false],
        "the queued one"
    );
    assert!(e.abort(running));
    assert_eq!(
        state(&probe::take()),
        [false, true, false],
        "the running one"
    );
    run_to_idle(&mut e);
    assert_eq!(
        (e.metrics.requests_submitted, e.metrics.requests_aborted),
        (2, 2)
    );
}

/// One request whose prompt's full pages are backed up when it finishes (write-through): its
/// first page copy is that backup's (the prompt's stores are kernels, not copies).
fn backed_up_prompt(s: &Synth) -> RequestSpec {
    RequestSpec {
        prompt: prompt(s, 256, 32, 1),
        max_new_tokens: 1,
    }
}

/// A backup whose copy fails is counted as failed, and the prefix it was backing up stays
/// cached on the device: a second run finds it there, not on the host.
#[test]
fn a_failed_backup_is_counted_and_its_prefix_stays_on_the_device() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = || backed_up_prompt(&s);
    // The first page copy is the backup's (the prompt's stores are kernels, not copies).
    e.dev.fail_next_copies = 1;
    e.submit(spec()).unwrap();
    run_to_idle(&mut e);
    assert_eq!(
        (e.metrics.backups, e.metrics.backup_failures),
        (1, 1),
        "{:?}",
        e.metrics
    );
    assert_eq!(e.metrics.host_tokens_used, 0, "nothing kept on the host");
    e.submit(spec()).unwrap();
    run_to_idle(&mut e);
    assert_eq!(e.metrics.prefix_pages_host_hit, 0, "{:?}", e.metrics);
    assert!(e.metrics.prefix_pages_device_hit >= 4, "{:?}", e.metrics);
}

/// A backup whose copy fails on a device that then cannot recover stops the engine with the
/// recovery's error, at the next step, even though the device answers every later call (the
/// failure was the copy's alone, nothing stays in error).
#[test]
fn a_failed_backup_on_a_device_that_cannot_recover_stops_the_engine() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    // The first page copy is the backup's (the prompt's stores are kernels, not copies).
    e.dev.fail_next_copies = 1;
    e.dev.recover_fails = true;
    e.submit(backed_up_prompt(&s)).unwrap();
    for _ in 0..1_000 {
        match e.step() {
            Ok(r) if r.idle => panic!("went idle with the device lost: {:?}", e.metrics),
            Ok(_) => {}
            Err(EngineError::Device(DeviceError::Backend { detail })) => {
                assert_eq!(detail, "injected: the device is lost");
                assert_eq!(e.dev.recoveries, 1, "one recovery tried");
                return;
            }
            Err(other) => panic!("expected the recovery's error, got {other:?}"),
        }
    }
    panic!("the engine never stopped");
}

/// A backup whose own copy fails is counted as failed even when the recovery recreates the
/// context (lost is for a backup whose copy did not fail, its memory lost under it), and the
/// recreation drops the device tier: nothing of the prompt stays cached.
#[test]
fn a_backup_that_failed_is_failed_even_when_its_recovery_recreates_the_context() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    e.dev.fail_next_copies = 1;
    e.dev.recover_recreates = true;
    e.submit(backed_up_prompt(&s)).unwrap();
    run_to_idle(&mut e);
    let m = &e.metrics;
    assert_eq!(
        (m.backup_failures, m.backups_lost, m.context_recreations),
        (1, 0, 1),
        "{m:?}"
    );
    assert_eq!((m.device_pages_used, m.host_tokens_used), (0, 0), "{m:?}");
}

/// The copy probes name the host layout a backup copied with, and the page-first one only with
/// a bf16 index-K (the case of the field's incident).
#[test]
fn the_copy_probes_name_the_host_layout_and_the_index_k_dtype() {
    use tierkv_engine::layout::{HostLayout, IndexKDtype};
    for (host, ik, want) in [
        (HostLayout::PageFirst, IndexKDtype::Bf16, [false, true]),
        (HostLayout::PageFirst, IndexKDtype::Fp8, [false, false]),
        (HostLayout::LayerFirst, IndexKDtype::Bf16, [true, false]),
    ] {
        let mut cfg = Config::preset("sim-small").unwrap();
        cfg.cache.host_layout = host;
        cfg.model.index_k_dtype = ik;
        let mut e = engine(cfg, EngineOptions::default());
        let s = e.synth;
        let spec = RequestSpec {
            prompt: prompt(&s, 256, 32, 1),
            max_new_tokens: 1,
        };
        let h = probes_of(&mut e, spec);
        assert_eq!(e.metrics.backups, 1);
        let got = ["copy.layer_first", "copy.page_first_bf16_index_k"].map(|p| h.contains_key(p));
        assert_eq!(got, want, "{host:?} {ik:?}");
    }
}

/// The page count holds while a load is in flight and after its request is aborted: a prefix
/// kept on the host alone is loaded back for a new request (the engine one step ahead), the
/// request is aborted with the load in flight, and the invariants (the device pages in use are
/// the tree's, the requests', the loads' and the rest) hold at each point, the orphaned load's
/// pages counted until it lands.
#[test]
fn the_page_count_holds_with_a_load_in_flight_and_its_request_aborted() {
    for fails in [false, true] {
        for overlap in [false, true] {
            page_count_with_an_orphaned_load(fails, overlap);
        }
    }
}

/// [`the_page_count_holds_with_a_load_in_flight_and_its_request_aborted`], the load's copy
/// failing or not, the engine one step ahead or in order (its step failed, which leaves the load
/// unacknowledged): either way the orphaned load's pages go back once it is acknowledged.
fn page_count_with_an_orphaned_load(fails: bool, overlap: bool) {
    let options = EngineOptions {
        overlap,
        ..EngineOptions::default()
    };
    let (mut e, _) = host_only_prefixes(options, &prefix_spec);
    let s = e.synth;
    let id = e.submit(prefix_spec(&s).remove(0)).unwrap();
    e.dev.fail_next_copies = fails as u32;
    // In order, a step acknowledges its loads unless it failed: one kernel fails, so that the
    // load is still in flight after it (and its request in no step in flight).
    e.dev.fail_next_kernels = !overlap as u32;
    e.step().expect("step");
    assert_eq!(e.loads_in_flight(), 1, "{:?}", e.metrics);
    e.check_invariants();
    assert!(e.abort(id));
    assert_eq!(e.loads_in_flight(), 1, "the load outlives its request");
    e.check_invariants();
    if !overlap {
        // Nothing is left but the orphaned load: a weight update waits for it too.
        let err = e.update_weights(1).expect_err("a load in flight");
        assert!(
            matches!(
                err,
                tierkv_engine::EngineError::NotIdle {
                    step_in_flight: 0,
                    requests: 0,
                    loads: 1,
                    exports: 0,
                    imports: 0
                }
            ),
            "{err}"
        );
    }
    run_to_idle(&mut e);
    assert_eq!(e.loads_in_flight(), 0);
    assert_eq!(e.metrics.load_failures, fails as u64, "{:?}", e.metrics);
    e.check_quiescent().unwrap();
}

/// Prefixes on the host alone, under write-back: each prompt of `specs` run once and the pages
/// handed back until none is on the device. Returns the engine and each prompt's tokens.
fn host_only_prefixes(
    options: EngineOptions,
    specs: &dyn Fn(&Synth) -> Vec<RequestSpec>,
) -> (Engine<InOrderDevice, ManualClock>, Vec<Vec<u32>>) {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteBack;
    host_only_prefixes_of(cfg, options, specs)
}

/// [`host_only_prefixes`] under `cfg` (a write-back one).
fn host_only_prefixes_of(
    cfg: Config,
    options: EngineOptions,
    specs: &dyn Fn(&Synth) -> Vec<RequestSpec>,
) -> (Engine<InOrderDevice, ManualClock>, Vec<Vec<u32>>) {
    let mut e = engine(cfg, options);
    let s = e.synth;
    let mut computed = Vec::new();
    for spec in specs(&s) {
        e.submit(spec).unwrap();
        computed.push(tokens_of(&run_to_idle(&mut e)));
    }
    for _ in 0..16 {
        if e.metrics.device_pages_used == 0 {
            break;
        }
        e.evict_device(4).unwrap();
        run_to_idle(&mut e);
    }
    assert_eq!(e.metrics.device_pages_used, 0, "{:?}", e.metrics);
    (e, computed)
}

fn prefix_spec(s: &Synth) -> Vec<RequestSpec> {
    vec![RequestSpec {
        prompt: prompt(s, 256, 32, 1),
        max_new_tokens: 4,
    }]
}

/// A load from the host succeeds: no failure counted, and the loaded pages are published on
/// the device, where the next run of the prompt finds them.
#[test]
fn a_load_from_the_host_lands_and_publishes_its_pages() {
    let (mut e, computed) = host_only_prefixes(EngineOptions::default(), &prefix_spec);
    let s = e.synth;
    e.submit(prefix_spec(&s).remove(0)).unwrap();
    assert_eq!(tokens_of(&run_to_idle(&mut e)), computed[0]);
    let m = &e.metrics;
    assert_eq!(
        (m.prefix_pages_host_hit, m.load_failures, m.loads_lost),
        (4, 0, 0),
        "{m:?}"
    );
    let device_hits = m.prefix_pages_device_hit;
    e.submit(prefix_spec(&s).remove(0)).unwrap();
    assert_eq!(tokens_of(&run_to_idle(&mut e)), computed[0]);
    assert_eq!(
        e.metrics.prefix_pages_device_hit - device_hits,
        4,
        "{:?}",
        e.metrics
    );
}

/// A load whose own copy fails, under a recovery that recreates the context, is a failure (not
/// a loss: its copy did not complete), the request recomputes the prefix and gets the same
/// tokens, and the engine ends quiescent.
#[test]
fn a_load_whose_copy_fails_as_the_context_is_recreated_is_a_failure() {
    let (mut e, computed) = host_only_prefixes(EngineOptions::default(), &prefix_spec);
    let s = e.synth;
    e.dev.fail_next_copies = 1;
    e.dev.recover_recreates = true;
    e.submit(prefix_spec(&s).remove(0)).unwrap();
    assert_eq!(tokens_of(&run_to_idle(&mut e)), computed[0]);
    let m = &e.metrics;
    assert_eq!(
        (m.load_failures, m.loads_lost, m.context_recreations),
        (1, 0, 1),
        "{m:?}"
    );
    e.check_quiescent().unwrap();
}

/// A load in flight when its step's failed kernel is recovered by recreating the context: the
/// load's copy completed, into memory the recreation lost, so it is lost (not failed); the
/// request recomputes, gets the same tokens, and the engine ends quiescent.
#[test]
fn a_load_in_flight_when_a_kernel_recreates_the_context_is_lost() {
    let (mut e, computed) = host_only_prefixes(EngineOptions::default(), &prefix_spec);
    let s = e.synth;
    e.submit(prefix_spec(&s).remove(0)).unwrap();
    e.dev.fail_next_kernels = 1;
    e.dev.recover_recreates = true;
    e.step().expect("step");
    assert_eq!(
        e.loads_in_flight(),
        1,
        "the failed step leaves its load unacknowledged"
    );
    assert_eq!(tokens_of(&run_to_idle(&mut e)), computed[0]);
    let m = &e.metrics;
    assert_eq!(
        (
            m.load_failures,
            m.loads_lost,
            m.context_recreations,
            m.steps_failed
        ),
        (0, 1, 1, 1),
        "{m:?}"
    );
    e.check_quiescent().unwrap();
}

/// One step ahead, the first step's kernel fails and its recovery recreates the context: the
/// failed step and the step built on it are counted (one failed, one discarded), the device
/// tier is dropped once, and the request still gets its tokens.
#[test]
fn running_ahead_a_failed_step_and_the_one_built_on_it_are_counted() {
    let options = EngineOptions {
        overlap: true,
        ..EngineOptions::default()
    };
    let (mut e, computed) = host_only_prefixes(options, &prefix_spec);
    let s = e.synth;
    e.submit(prefix_spec(&s).remove(0)).unwrap();
    e.dev.fail_next_kernels = 1;
    e.dev.recover_recreates = true;
    assert_eq!(tokens_of(&run_to_idle(&mut e)), computed[0]);
    let m = &e.metrics;
    assert_eq!(
        (m.steps_failed, m.steps_discarded, m.context_recreations),
        (1, 1, 1),
        "{m:?}"
    );
    e.check_quiescent().unwrap();
}

/// A device that fails every step stops the engine with a typed error after
/// `STEP_FAILURES_MAX` failed steps in a row, each counted.
#[test]
fn a_device_that_fails_every_step_stops_the_engine() {
    use tierkv_engine::EngineError;
    let mut e = engine(
        Config::preset("sim-small").unwrap(),
        EngineOptions::default(),
    );
    let s = e.synth;
    e.submit(prefix_spec(&s).remove(0)).unwrap();
    e.dev.fail_next_kernels = u32::MAX;
    let mut steps = 0;
    let err = loop {
        steps += 1;
        assert!(steps <= 100, "the engine never gave up");
        match e.step() {
            Ok(_) => {}
            Err(err) => break err,
        }
    };
    assert!(
        matches!(&err, EngineError::Device(_)) && err.to_string().contains("steps in a row"),
        "{err}"
    );
    assert_eq!(steps, tierkv_engine::engine::STEP_FAILURES_MAX as u64);
    assert_eq!(e.metrics.steps_failed, steps, "{:?}", e.metrics);
}

/// One step ahead, a load's copy fails and its recovery recreates the context while a step is
/// in flight: the load is a failure, and the step in flight is discarded (it may have read
/// what the device lost), or counted failed when its own kernel failed too.
#[test]
fn running_ahead_a_recreation_discards_or_fails_the_step_in_flight() {
    for (kernel_fails, want) in [(false, (1, 0, 1, 1)), (true, (1, 1, 0, 1))] {
        let options = EngineOptions {
            overlap: true,
            ..EngineOptions::default()
        };
        let (mut e, computed) = host_only_prefixes(options, &prefix_spec);
        let s = e.synth;
        e.submit(prefix_spec(&s).remove(0)).unwrap();
        e.dev.fail_next_copies = 1;
        e.dev.fail_next_kernels = kernel_fails as u32;
        e.dev.recover_recreates = true;
        assert_eq!(tokens_of(&run_to_idle(&mut e)), computed[0]);
        let m = &e.metrics;
        assert_eq!(
            (
                m.load_failures,
                m.steps_failed,
                m.steps_discarded,
                m.context_recreations
            ),
            want,
            "kernel fails: {kernel_fails}; {m:?}"
        );
        e.check_quiescent().unwrap();
    }
}

/// Under write-through with a host tier just larger than the device tier, distinct prompts fill
/// the host; each later backup makes room by evicting host pages instead of being skipped: the
/// host-eviction probe is hit, every prompt's full pages are backed up (none failed), the host
/// stays full, and every prompt's pages were queried.
#[test]
fn write_through_evicts_from_a_full_host_tier_to_back_up() {
    use tierkv_engine::probe;
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteThrough;
    let device_pages = cfg.cache.device_pages as u64;
    cfg.cache.host = tierkv_engine::config::HostCapacity::Tokens((device_pages + 1) * 64);
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = |stream| RequestSpec {
        prompt: prompt(&s, 0, 288, stream),
        max_new_tokens: 1,
    };
    probe::take();
    let prompts = device_pages / 4 + 2;
    for stream in 0..prompts {
        e.submit(spec(stream)).unwrap();
        run_to_idle(&mut e);
    }
    assert!(probe::take().contains_key("host.evicted"));
    let m = &e.metrics;
    assert_eq!((m.backups, m.backup_failures), (prompts, 0), "{m:?}");
    assert_eq!(m.host_tokens_used, (device_pages + 1) * 64, "full: {m:?}");
    assert_eq!(m.prefix_pages_queried, prompts * 4, "{m:?}");
}

/// A request whose prompt is cached on the device is given pages only for what the cache does
/// not hold: the device pages in use after its admission are the cached prompt's and its own.
#[test]
fn a_cached_prompt_is_given_pages_only_beyond_its_cached_prefix() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = || RequestSpec {
        prompt: prompt(&s, 256, 32, 1),
        max_new_tokens: 8,
    };
    e.submit(spec()).unwrap();
    run_to_idle(&mut e);
    let cached = e.metrics.device_pages_used;
    e.submit(spec()).unwrap();
    let report = e.step().expect("the step that admits it");
    assert_eq!(report.admitted, 1, "{report:?}");
    assert_eq!(e.metrics.device_pages_used, cached + 1, "{:?}", e.metrics);
    run_to_idle(&mut e);
    assert_eq!(e.metrics.device_pages_used, cached);
}

/// Two 288-token prompts of different streams, four tokens each.
fn two(s: &Synth) -> Vec<RequestSpec> {
    (1..=2)
        .map(|stream| RequestSpec {
            prompt: prompt(s, 0, 288, stream),
            max_new_tokens: 4,
        })
        .collect()
}

/// The `sim-small` preset under write-back with a load ring of `slots` slots.
fn write_back_with_load_slots(slots: u32) -> Config {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteBack;
    cfg.cache.load_slots = slots;
    cfg
}

/// Two prefixes on the host, both asked for at once through a load ring of two slots: the step
/// that admits both issues both loads, each its own (no slot waited for), and both requests get
/// the tokens their prompts computed.
#[test]
fn two_loads_issued_in_one_step_each_land() {
    use tierkv_engine::probe;
    let (mut e, computed) = host_only_prefixes_of(
        write_back_with_load_slots(2),
        EngineOptions::default(),
        &two,
    );
    let s = e.synth;
    probe::take();
    for spec in two(&s) {
        e.submit(spec).unwrap();
    }
    let report = e.step().expect("the step that admits both");
    assert_eq!(report.admitted, 2, "{report:?}");
    let out = run_to_idle(&mut e);
    assert!(!probe::take().contains_key("load.ring_full"));
    assert_eq!((e.metrics.loads, e.metrics.load_failures), (2, 0));
    let got: Vec<Vec<u32>> = per_request(&out).into_values().map(|r| r.1).collect();
    assert_eq!(got, computed);
    e.check_quiescent().unwrap();
}

/// A running request shows its page table, a page for each 64 positions its prompt holds, and
/// while the prefix it loads from the host is in flight (an engine one step ahead returns before
/// the step that waits for it ends), that load.
#[test]
fn a_running_request_shows_its_pages_and_its_load() {
    let options = EngineOptions {
        overlap: true,
        ..EngineOptions::default()
    };
    let (mut e, _) = host_only_prefixes(options, &prefix_spec);
    let s = e.synth;
    let spec = prefix_spec(&s).remove(0);
    let pages = spec.prompt.len().div_ceil(64);
    let id = e.submit(spec).unwrap();
    let mut loads = Vec::new();
    for _ in 0..1_000 {
        if let Some(r) = e.request(id) {
            if r.state() == tierkv_engine::scheduler::RequestState::Running {
                assert!(r.pages().len() >= pages, "{} pages", r.pages().len());
            }
            loads.push(r.load());
        }
        if e.step().expect("step").idle {
            break;
        }
    }
    assert!(loads.iter().any(|l| l.is_some()), "{loads:?}");
    assert!(loads.last().is_some_and(|l| l.is_none()), "{loads:?}");
}

/// A write-back engine (`sim-small`, one load slot) holding two 256-token prompts of streams 1
/// and 2 on the device, computed in that order.
fn two_prompts_on_the_device() -> Engine<InOrderDevice, ManualClock> {
    let mut e = engine(write_back_with_load_slots(1), EngineOptions::default());
    let s = e.synth;
    for stream in [1, 2] {
        e.submit(RequestSpec {
            prompt: prompt(&s, 0, 256, stream),
            max_new_tokens: 2,
        })
        .unwrap();
        run_to_idle(&mut e);
    }
    assert_eq!(e.metrics.device_pages_used, 8, "{:?}", e.metrics);
    e
}

/// Under write-back, an eviction whose backup goes frees nothing at once and drops nothing
/// else: the prompt it did not pick stays whole on the device (asked for again, every page of
/// it is a device hit), and the picked page comes free when its backup ends.
#[test]
fn a_write_back_eviction_drops_nothing_while_its_backup_runs() {
    use tierkv_engine::probe;
    let mut e = two_prompts_on_the_device();
    probe::take();
    // One page: the older prompt's leaf, which must be backed up first.
    assert_eq!(e.evict_device(1).unwrap(), 0, "its page is not free yet");
    assert_eq!(e.metrics.device_pages_used, 8, "nothing dropped");
    run_to_idle(&mut e);
    assert!(e.metrics.device_pages_used < 8, "{:?}", e.metrics);
    let hits = probe::take();
    assert!(!hits.contains_key("device.write_back_dropped"), "{hits:?}");
    let (queried, hit) = (
        e.metrics.prefix_pages_queried,
        e.metrics.prefix_pages_device_hit,
    );
    let s = e.synth;
    e.submit(RequestSpec {
        prompt: prompt(&s, 0, 256, 2),
        max_new_tokens: 2,
    })
    .unwrap();
    run_to_idle(&mut e);
    let m = &e.metrics;
    assert!(m.prefix_pages_queried > queried);
    assert_eq!(
        m.prefix_pages_device_hit - hit,
        m.prefix_pages_queried - queried,
        "{m:?}"
    );
}

/// Under write-back, an eviction that frees pages with a host copy and cannot back the rest up
/// (every host allocation refused) drops only what it still lacks, leaf first.
#[test]
fn a_write_back_eviction_that_cannot_back_up_drops_only_what_it_lacks() {
    use tierkv_engine::pools::EngineFaults;
    use tierkv_engine::probe;
    let mut e = engine(write_back_with_load_slots(1), EngineOptions::default());
    let s = e.synth;
    let spec = |stream| RequestSpec {
        prompt: prompt(&s, 0, 256, stream),
        max_new_tokens: 2,
    };
    // Stream 1's prompt: a page evicted, so its path is backed up; the rest stays on the device,
    // each page with a host copy.
    e.submit(spec(1)).unwrap();
    run_to_idle(&mut e);
    e.evict_device(1).unwrap();
    run_to_idle(&mut e);
    let with_copies = e.metrics.device_pages_used;
    // Stream 2's, on the device alone.
    e.submit(spec(2)).unwrap();
    run_to_idle(&mut e);
    let used = e.metrics.device_pages_used;
    assert!(used - with_copies >= 3, "{:?}", e.metrics);
    e.inject(EngineFaults {
        seed: 0,
        device_pages_refused_rate: 0.0,
        host_pages_refused_rate: 1.0,
    });
    probe::take();
    let want = with_copies as usize + 2;
    assert_eq!(e.evict_device(want).unwrap(), want);
    assert_eq!(
        e.metrics.device_pages_used,
        used - want as u64,
        "{:?}",
        e.metrics
    );
    let hits = probe::take();
    assert!(
        hits.contains_key("device.write_back_cancelled")
            && hits.contains_key("device.write_back_dropped"),
        "{hits:?}"
    );
}

/// Two prefixes on the host, both asked for at once through a load ring of one slot: the second
/// load takes the slot once the first is waited for and acknowledged (the ring-full probe), and
/// both requests get the tokens their prompts computed.
#[test]
fn a_load_ring_of_one_slot_serves_two_loads_in_turn() {
    use tierkv_engine::probe;
    for overlap in [false, true] {
        let options = EngineOptions {
            overlap,
            ..EngineOptions::default()
        };
        let (mut e, computed) = host_only_prefixes_of(write_back_with_load_slots(1), options, &two);
        let s = e.synth;
        probe::take();
        for spec in two(&s) {
            e.submit(spec).unwrap();
        }
        let out = run_to_idle(&mut e);
        let hits = probe::take();
        assert!(
            hits.contains_key("load.ring_full"),
            "overlap {overlap}: {hits:?}"
        );
        let m = &e.metrics;
        assert_eq!(
            (m.loads, m.load_failures),
            (2, 0),
            "overlap {overlap}: {m:?}"
        );
        let got: Vec<Vec<u32>> = per_request(&out).into_values().map(|r| r.1).collect();
        assert_eq!(got, computed, "overlap {overlap}");
        e.check_quiescent().unwrap();
    }
}

/// The device refuses a load's event record as a device in error while a request is admitted,
/// and the recovery recreates the context: the step stops after admission (nothing it would compute
/// can read what the device lost), reporting the request it admitted; the next steps drop the
/// device tier, requeue the request and give it its tokens.
#[test]
fn a_recreation_within_admission_stops_the_step_and_reports_the_admission() {
    let (mut e, computed) = host_only_prefixes(EngineOptions::default(), &prefix_spec);
    let s = e.synth;
    e.submit(prefix_spec(&s).remove(0)).unwrap();
    e.dev.in_error_next_records = 1;
    e.dev.recover_recreates = true;
    let steps = e.metrics.steps;
    let report = e.step().expect("step");
    assert_eq!(
        (report.admitted, report.rows, e.metrics.steps - steps),
        (1, 0, 0),
        "{report:?}"
    );
    let out = run_to_idle(&mut e);
    assert_eq!(tokens_of(&out), computed[0]);
    let m = &e.metrics;
    assert_eq!(
        (m.context_recreations, m.requests_requeued),
        (1, 1),
        "{m:?}"
    );
    e.check_quiescent().unwrap();
}

/// Under write-back, a full device tier makes admission evict with a backup while another
/// request decodes; that request's kernel fails in the same step and its recovery recreates
/// the context, with the backup in flight: the backup is lost (its copy may have read pages the
/// recreation took), not failed, and the engine ends quiescent.
#[test]
fn a_backup_in_flight_when_the_context_is_recreated_is_lost() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.cache.write_policy = tierkv_engine::config::WritePolicy::WriteBack;
    assert_eq!(cfg.cache.device_pages, 48);
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    let spec = |stream, len, max_new_tokens| RequestSpec {
        prompt: prompt(&s, 0, len, stream),
        max_new_tokens,
    };
    // Ten prompts leave 4 full pages each in the tree: 40 of 48 pages.
    for stream in 0..10 {
        e.submit(spec(stream, 288, 1)).unwrap();
        run_to_idle(&mut e);
    }
    // A decoding request holds 3 more (100 + 32 tokens); the next prompt, 350 tokens and one
    // generated, needs 6 pages of the 5 free: admission evicts one, behind its backup.
    e.submit(spec(500, 100, 32)).unwrap();
    e.step().expect("step");
    e.submit(spec(501, 350, 1)).unwrap();
    assert_eq!(e.metrics.backups, 0, "{:?}", e.metrics);
    e.dev.fail_next_kernels = 1;
    e.dev.recover_recreates = true;
    e.step().expect("step");
    assert_eq!(
        e.metrics.backups, 1,
        "admission evicted with a backup: {:?}",
        e.metrics
    );
    assert_eq!(e.metrics.steps_failed, 1, "{:?}", e.metrics);
    run_to_idle(&mut e);
    let m = &e.metrics;
    assert_eq!(
        (m.backups_lost, m.backup_failures, m.context_recreations),
        (1, 0, 1),
        "{m:?}"
    );
    e.check_quiescent().unwrap();
}

/// A step whose event record the device refuses as a device in error, and whose recovery
/// recreates the context, computes its rows but is discarded unrecorded (what it read is not
/// known to be what was stored); the request recomputes and gets its tokens.
#[test]
fn a_step_recreated_while_it_ran_is_discarded() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut clean = engine(cfg.clone(), EngineOptions::default());
    let s = clean.synth;
    let spec = || RequestSpec {
        prompt: prompt(&s, 0, 100, 3),
        max_new_tokens: 4,
    };
    clean.submit(spec()).unwrap();
    let want = tokens_of(&run_to_idle(&mut clean));
    let mut e = engine(cfg, EngineOptions::default());
    e.submit(spec()).unwrap();
    e.step().expect("step");
    e.dev.in_error_next_records = 1;
    e.dev.recover_recreates = true;
    let mut out = e.drain_outputs();
    out.extend(run_to_idle(&mut e));
    assert_eq!(tokens_of(&out), want);
    let m = &e.metrics;
    assert_eq!(
        (m.steps_discarded, m.steps_failed, m.context_recreations),
        (1, 0, 1),
        "{m:?}"
    );
    e.check_quiescent().unwrap();
}

/// A device that does not time its work (the CPU device) gives no step a device timing: a
/// report says so with `None`, not with a timing of zeros that would read as an idle GPU.
#[test]
fn a_device_that_does_not_time_its_work_reports_no_timing() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut e = engine(cfg, EngineOptions::default());
    let s = e.synth;
    for spec in two(&s) {
        e.submit(spec).unwrap();
    }
    let mut steps = 0;
    loop {
        let r = e.step().expect("step");
        assert!(r.device.is_none(), "step {steps}: {:?}", r.device);
        steps += 1;
        if r.idle {
            break;
        }
        assert!(steps < 10_000, "the engine did not go idle");
    }
    assert!(steps > 2, "{steps} steps");
}
