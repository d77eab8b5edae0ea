//! The scheduler's invariant checker catches broken bookkeeping (the simulator relies on it after
//! every step).

use super::*;
use crate::config::Config;

fn with_one_queued() -> Scheduler {
    let cfg = Config::preset("sim-small").expect("preset");
    let mut s = Scheduler::new(&cfg, Mutants::none());
    let spec = RequestSpec {
        prompt: vec![7; 100],
        max_new_tokens: 4,
    };
    s.submit(spec).expect("a valid request");
    s.check_invariants();
    s
}

#[test]
#[should_panic(expected = "queued tokens = the queued prompts")]
fn a_wrong_queued_token_count_is_caught() {
    let mut s = with_one_queued();
    s.queued_tokens += 1;
    s.check_invariants();
}

#[test]
#[should_panic(expected = "every request is queued or running")]
fn a_request_in_neither_set_is_caught() {
    let mut s = with_one_queued();
    s.queue.clear();
    s.queued_tokens = 0;
    s.check_invariants();
}

/// Grants every request its pages at once: `cached` pages of its prefix cached, with a load in
/// flight for the host-only ones when `loading` (how many it covers is the test's `LoadAck`).
struct Grants {
    cached: usize,
    loading: bool,
    next_page: u32,
    next_load: u64,
}

impl Reserve for Grants {
    fn reserve(
        &mut self,
        r: &Request,
        _acks: &mut Vec<LoadAck>,
    ) -> Result<Option<Grant>, EngineError> {
        let n = r.prompt_len.div_ceil(PAGE_TOKENS as usize) + 1;
        let pages = (0..n as u32).map(|i| PageId(self.next_page + i)).collect();
        self.next_page += n as u32;
        let load = self.loading.then(|| {
            self.next_load += 1;
            LoadId(self.next_load)
        });
        Ok(Some(Grant {
            pages,
            locked: (0..self.cached as NodeId).map(|i| i + 1).collect(),
            cached: self.cached,
            load,
        }))
    }
}

fn scheduler(prefill_budget: u32, prefill_indexer: PrefillIndexer) -> Scheduler {
    let mut cfg = Config::preset("sim-small").expect("preset");
    cfg.scheduler.prefill_tokens_per_step_max = prefill_budget;
    cfg.model.prefill_indexer = prefill_indexer;
    Scheduler::new(&cfg, Mutants::none())
}

fn submit(s: &mut Scheduler, prompt_len: usize, max_new_tokens: u32) -> u64 {
    let spec = RequestSpec {
        prompt: vec![7; prompt_len],
        max_new_tokens,
    };
    s.submit(spec).expect("a valid request")
}

fn admit_all(s: &mut Scheduler, cached: usize, loading: bool) -> usize {
    let mut grants = Grants {
        cached,
        loading,
        next_page: 0,
        next_load: 0,
    };
    s.admit(&mut grants).expect("admission")
}

/// Runs the batch as the engine would after a forward that succeeded, with zero digests.
fn forward(s: &mut Scheduler, rows: &[Row]) -> Recorded {
    let queries: usize = rows.iter().map(|r| r.queries.len()).sum();
    let digests = vec![vec![0u64; 2]; queries];
    s.record_forward(rows, &digests, &[], &Synth::new(1))
}

fn probe_hits(p: Probe) -> u64 {
    probe::take().get(p.name()).copied().unwrap_or(0)
}

#[test]
fn admission_reports_how_many_requests_it_admitted() {
    let mut s = scheduler(512, PrefillIndexer::LastToken);
    for _ in 0..3 {
        submit(&mut s, 100, 2);
    }
    assert_eq!(admit_all(&mut s, 0, false), 3);
    assert_eq!((s.queue_len(), s.running_len()), (0, 3));
    assert_eq!(admit_all(&mut s, 0, false), 0, "nothing left to admit");
    s.check_invariants();
}

#[test]
fn a_failed_load_recomputes_the_tokens_of_the_pages_it_covered() {
    let mut s = scheduler(512, PrefillIndexer::LastToken);
    let id = submit(&mut s, 5 * PAGE_TOKENS as usize + 10, 2);
    // 4 pages cached, the last 3 of them only on the host: their load is in flight.
    admit_all(&mut s, 4, true);
    let load = s.requests[&id].load.expect("a load in flight");
    s.load_acked(&LoadAck {
        load,
        request: id,
        ok: false,
        nodes: 3,
        orphaned: false,
    });
    let r = &s.requests[&id];
    assert_eq!((r.load, r.owned_from, r.locked.len()), (None, 1, 1));
    assert_eq!(
        r.computed, PAGE_TOKENS as usize,
        "it resumes after the resident page"
    );
    let recompute: Vec<Output> = s.drain_outputs();
    assert_eq!(
        recompute,
        [Output::Recompute {
            request: id,
            tokens: 3 * PAGE_TOKENS,
        }]
    );
    s.check_invariants();
}

#[test]
fn prefill_tokens_count_the_prompt_tokens_computed() {
    // Budget 130: a 30-token prompt is computed whole in the first step, beside the first 100
    // tokens of a 250-token prompt; the rest of that one takes 130 and 20. Whichever prefill
    // tokens run the indexer (one query row per chunk, or one per token), the count is of tokens.
    for indexer in [PrefillIndexer::LastToken, PrefillIndexer::EveryToken] {
        let mut s = scheduler(130, indexer);
        submit(&mut s, 30, 1);
        submit(&mut s, 250, 1);
        admit_all(&mut s, 0, false);
        let mut prefill = Vec::new();
        for _ in 0..4 {
            let rows = s.build_batch(1024, None);
            prefill.push(forward(&mut s, &rows).prefill_tokens);
        }
        assert_eq!(prefill, [130, 130, 20, 0], "{indexer:?}");
    }
}

#[test]
fn the_chunked_prefill_probe_is_hit_only_by_a_chunk() {
    let mut s = scheduler(128, PrefillIndexer::LastToken);
    submit(&mut s, 100, 1);
    admit_all(&mut s, 0, false);
    probe::take();
    let rows = s.build_batch(64, None);
    assert_eq!((rows[0].from, rows[0].to), (0, 100));
    assert_eq!(probe_hits(Probe::BatchPrefillChunked), 0, "a whole prompt");
    // Resuming after a cached prefix (as admission leaves a request whose prefix hit) is not a
    // chunk either.
    let mut s = scheduler(128, PrefillIndexer::LastToken);
    let id = submit(&mut s, 100, 1);
    admit_all(&mut s, 1, false);
    assert_eq!(s.requests[&id].computed, PAGE_TOKENS as usize);
    probe::take();
    s.build_batch(64, None);
    assert_eq!(
        probe_hits(Probe::BatchPrefillChunked),
        0,
        "the rest of a prompt"
    );
    let mut s = scheduler(64, PrefillIndexer::LastToken);
    submit(&mut s, 100, 1);
    admit_all(&mut s, 0, false);
    probe::take();
    s.build_batch(64, None);
    assert_eq!(
        probe_hits(Probe::BatchPrefillChunked),
        1,
        "a chunk of 64 of 100"
    );
}

#[test]
fn the_mixed_batch_probe_is_hit_only_by_prefill_beside_decode() {
    let mut s = scheduler(512, PrefillIndexer::LastToken);
    submit(&mut s, 40, 4);
    admit_all(&mut s, 0, false);
    probe::take();
    let rows = s.build_batch(64, None);
    assert_eq!(probe_hits(Probe::BatchMixed), 0, "prefill only");
    forward(&mut s, &rows);
    probe::take();
    let rows = s.build_batch(64, None);
    assert_eq!(probe_hits(Probe::BatchMixed), 0, "decode only");
    forward(&mut s, &rows);
    submit(&mut s, 40, 4);
    admit_all(&mut s, 0, false);
    probe::take();
    s.build_batch(64, None);
    assert_eq!(
        probe_hits(Probe::BatchMixed),
        1,
        "a decode beside a prefill"
    );
}

/// One step ahead: a request continues from its row in flight (its next token pending, read on
/// the device from that row's query), one that finishes there is left out, one whose row in
/// flight reads a load waits, and a row built on one whose load then failed is stale.
#[test]
fn a_batch_built_ahead_continues_from_the_rows_in_flight() {
    let mut s = scheduler(512, PrefillIndexer::LastToken);
    let a = submit(&mut s, 100, 3);
    let b = submit(&mut s, 30, 1);
    admit_all(&mut s, 0, false);
    let first = s.build_batch(64, None);
    assert_eq!(first.len(), 2);
    probe::take();
    let ahead = s.build_batch(64, Some(&first));
    // `b` generates its one token in the step in flight: it is done.
    assert_eq!(ahead.len(), 1, "{ahead:?}");
    let row = &ahead[0];
    assert_eq!(
        (row.request, row.from, row.to, row.pending),
        (a, 100, 101, Some(0))
    );
    assert_eq!(row.tokens, [TokenAt::pending(0, 100).token]);
    assert_eq!(probe_hits(Probe::AheadPendingToken), 1);
    forward(&mut s, &first);
    let r = &s.requests[&a];
    assert_eq!(
        (r.computed, r.tokens.len()),
        (100, 101),
        "the first step recorded"
    );
    assert_eq!(s.next_finished().map(|r| r.id), Some(b), "b finished");
    forward(&mut s, &ahead);
    assert_eq!(s.requests[&a].computed, 101, "the row built ahead recorded");
    s.check_invariants();

    // A request whose row in flight reads a load waits for that step.
    let mut s = scheduler(512, PrefillIndexer::LastToken);
    let c = submit(&mut s, 5 * PAGE_TOKENS as usize + 10, 2);
    admit_all(&mut s, 4, true);
    let first = s.build_batch(64, None);
    probe::take();
    assert!(s.build_batch(64, Some(&first)).is_empty());
    assert_eq!(probe_hits(Probe::AheadWaitsForLoad), 1);
    // Its load is acknowledged failed before the next batch: the row in flight is stale, and
    // the request continues from its recorded state.
    let load = s.requests[&c].load.expect("a load in flight");
    s.load_acked(&LoadAck {
        load,
        request: c,
        ok: false,
        nodes: 3,
        orphaned: false,
    });
    probe::take();
    let next = s.build_batch(64, Some(&first));
    assert_eq!(
        (next[0].from, next[0].pending),
        (PAGE_TOKENS as usize, None)
    );
    assert_eq!(probe_hits(Probe::AheadRowStale), 1);
    forward(&mut s, &first);
    assert_eq!(
        s.requests[&c].computed, PAGE_TOKENS as usize,
        "the stale row is dropped"
    );
    forward(&mut s, &next);
    assert_eq!(s.requests[&c].computed, 5 * PAGE_TOKENS as usize + 10);
    s.check_invariants();
}

/// A requeue sends the running batch to the head of the queue in running order, holding
/// nothing; on readmission a request recomputes its generated tokens in one chunk with its
/// prompt, and the chunk's last query generates its next token.
#[test]
fn a_requeued_request_recomputes_what_it_generated_and_goes_on() {
    let mut s = scheduler(512, PrefillIndexer::LastToken);
    let a = submit(&mut s, 100, 4);
    let b = submit(&mut s, 80, 4);
    // One page of each prompt cached (and locked).
    admit_all(&mut s, 1, false);
    let c = submit(&mut s, 30, 4);
    // Two steps: the prompts, then one decode each; two tokens generated each.
    for _ in 0..2 {
        let rows = s.build_batch(1024, None);
        forward(&mut s, &rows);
    }
    assert_eq!(s.requests[&a].generated, 2);
    s.drain_outputs();
    let held = s.requeue_running();
    assert_eq!(held.len(), 2);
    assert!(held
        .iter()
        .all(|(locked, own)| locked.len() == 1 && !own.is_empty()));
    assert_eq!(s.queue.iter().copied().collect::<Vec<_>>(), [a, b, c]);
    assert_eq!(
        s.drain_outputs(),
        [
            Output::Requeued { request: a },
            Output::Requeued { request: b }
        ]
    );
    let r = &s.requests[&a];
    assert_eq!(
        (r.computed, r.owned_from, r.pages.len(), r.state),
        (0, 0, 0, RequestState::Queued)
    );
    s.check_invariants();
    // Readmitted with nothing cached: the prompt and both generated tokens in one chunk, whose
    // last query yields the third token.
    admit_all(&mut s, 0, false);
    let rows = s.build_batch(1024, None);
    let row_a = rows.iter().find(|r| r.request == a).expect("a row for a");
    assert_eq!(
        (row_a.from, row_a.to, row_a.queries.clone()),
        (0, 102, vec![101])
    );
    forward(&mut s, &rows);
    assert_eq!(s.requests[&a].generated, 3);
    s.check_invariants();
}

/// A scheduler of the `sim-small` preset with `pending_tokens_max` set to `pending`.
fn scheduler_with_pending(pending: u64) -> Scheduler {
    let mut cfg = Config::preset("sim-small").expect("preset");
    cfg.scheduler.pending_tokens_max = pending;
    Scheduler::new(&cfg, Mutants::none())
}

fn spec(prompt: usize, max_new_tokens: u32) -> RequestSpec {
    RequestSpec {
        prompt: vec![7; prompt],
        max_new_tokens,
    }
}

#[test]
fn a_request_at_each_limit_is_accepted_and_one_past_it_is_invalid() {
    let cfg = Config::preset("sim-small").expect("preset");
    let out_max = cfg.scheduler.output_tokens_max;
    let mut s = Scheduler::new(&cfg, Mutants::none());
    assert!(
        s.submit(spec(10, out_max)).is_ok(),
        "max_new_tokens at its limit"
    );
    assert!(matches!(
        s.submit(spec(10, out_max + 1)),
        Err(Rejection::Invalid { .. })
    ));
    // A prompt as long as the pending-token bound can be queued alone.
    let mut s = scheduler_with_pending(300);
    assert!(
        s.submit(spec(300, 1)).is_ok(),
        "a prompt at pending_tokens_max"
    );
    assert!(matches!(
        s.submit(spec(301, 1)),
        Err(Rejection::Invalid { .. })
    ));
    s.check_invariants();
    // A prompt and its tokens that fill the context exactly are taken; one token more is not,
    // and the refusal names the limit.
    let ctx = cfg.model.context_tokens_max as usize;
    let mut s = scheduler_with_pending(ctx as u64);
    assert!(s.submit(spec(ctx - 1, 1)).is_ok(), "the context filled");
    match s.submit(spec(ctx, 1)) {
        Err(Rejection::Invalid { reason }) => {
            assert!(reason.contains("model.context_tokens_max"), "{reason}")
        }
        r => panic!("one token past the context: {r:?}"),
    }
}

#[test]
fn a_queued_request_reports_its_prompt_and_what_the_cache_may_serve() {
    let mut s = scheduler_with_pending(65_536);
    for (prompt, cacheable) in [(129usize, 2usize), (128, 1), (64, 0), (1, 0)] {
        let id = s.submit(spec(prompt, 1)).expect("a valid request");
        let r = s.request(id).expect("the request");
        assert_eq!(r.prompt_len(), prompt);
        assert_eq!(r.tokens().len(), prompt);
        assert_eq!(r.computed(), 0, "nothing computed before admission");
        assert!(r.in_prefill(), "a queued request is in prefill");
        // The last prompt token is always computed: only the full pages before it are served.
        assert_eq!(r.cacheable_pages(), cacheable, "prompt of {prompt}");
    }
}

/// Each request reports its own id, and once its prompt is computed it is out of prefill and counts
/// the tokens it generated: one from its last prompt position, one more a decode step.
#[test]
fn a_request_reports_what_its_forward_did() {
    let mut s = scheduler(512, PrefillIndexer::LastToken);
    let first = submit(&mut s, 3, 1);
    let id = submit(&mut s, 100, 3);
    assert_ne!(first, id);
    admit_all(&mut s, 0, false);
    assert_eq!(s.request(first).expect("running").id(), first);
    assert_eq!(s.request(id).expect("running").id(), id);
    let rows = s.build_batch(64, None);
    forward(&mut s, &rows);
    let r = s.request(id).expect("still running");
    assert_eq!((r.id(), r.generated(), r.in_prefill()), (id, 1, false));
    assert_eq!(r.computed(), 100);
    let rows = s.build_batch(64, None);
    forward(&mut s, &rows);
    assert_eq!(s.request(id).expect("still running").generated(), 2);
    s.check_invariants();
}

/// A batch never holds more query rows than the scratch has: two requests' prompts (one query
/// row each, last-token indexing) fit two rows and break the engine's invariant at one, which
/// panics naming the count rather than writing past the scratch.
#[test]
fn a_batch_over_the_scratchs_rows_is_a_broken_invariant() {
    let build = |rows_max: usize| {
        let mut s = scheduler(512, PrefillIndexer::LastToken);
        submit(&mut s, 40, 4);
        submit(&mut s, 40, 4);
        admit_all(&mut s, 0, false);
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            s.build_batch(rows_max, None).len()
        }))
    };
    assert_eq!(build(2).ok(), Some(2));
    let e = build(1).expect_err("two rows over a scratch of one");
    let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains("batch of 2 query rows over the scratch's 1"),
        "{msg}"
    );
}
