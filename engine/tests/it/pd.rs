//! Prefill/decode pairs on the in-order CPU device (both engines share one, joined by the peer
//! link): the pair's outputs equal one engine's for the same requests, digest for digest; a pair
//! whose layouts differ is refused before anything is built; aborts anywhere leak nothing; a
//! context recreated at any step requeues what it must and changes no token.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use tierkv_engine::cpu_device::{InOrderDevice, ManualClock};
use tierkv_engine::layout::IndexKDtype;
use tierkv_engine::pd::{PeerLink, SharedDevice};
use tierkv_engine::synth::Synth;
use tierkv_engine::{Config, Engine, EngineOptions, Output, PdError, PdPair, RequestSpec};

type Pair = PdPair<SharedDevice<InOrderDevice>, ManualClock, PeerLink>;

fn pair(prefill: Config, decode: Config, seed: u64) -> Result<Pair, PdError> {
    let dev = SharedDevice(Rc::new(RefCell::new(InOrderDevice::new())));
    PdPair::new(
        prefill,
        decode,
        dev.clone(),
        dev,
        ManualClock::default(),
        ManualClock::default(),
        PeerLink,
        EngineOptions {
            seed,
            ..Default::default()
        },
    )
}

/// Eight requests sharing prefixes of 0, 1 and 3 pages, some ending on a page boundary.
fn specs(synth: &Synth) -> Vec<RequestSpec> {
    (0..8u64)
        .map(|i| {
            let shared = [0usize, 64, 192][i as usize % 3];
            let own = [1usize, 63, 64, 100][i as usize % 4];
            let mut prompt: Vec<u32> = (0..shared as u64).map(|t| synth.token(7, t)).collect();
            prompt.extend((0..own as u64).map(|t| synth.token(100 + i, t)));
            RequestSpec {
                prompt,
                max_new_tokens: 1 + (i as u32 % 5) * 3,
            }
        })
        .collect()
}

/// Per request: every emitted query position's digests, the tokens, and the finished list.
#[derive(Debug, Default, PartialEq)]
struct Seen {
    digests: BTreeMap<u32, Vec<u64>>,
    tokens: Vec<(u32, u32)>,
    finished: Option<Vec<u32>>,
    aborted: bool,
    transfer_failed: bool,
}

fn collect(out: Vec<Output>, seen: &mut BTreeMap<u64, Seen>) {
    collect_as(out, seen, false)
}

/// [`collect`]; with `requeues`, a request may be requeued by a recreated context and emit a
/// position's digests again, equal.
fn collect_as(out: Vec<Output>, seen: &mut BTreeMap<u64, Seen>, requeues: bool) {
    for o in out {
        match o {
            Output::Digests {
                request,
                position,
                digests,
            } => {
                let prev = seen
                    .entry(request)
                    .or_default()
                    .digests
                    .insert(position, digests.clone());
                assert!(
                    prev.is_none() || requeues && prev.as_ref() == Some(&digests),
                    "request {request} position {position} twice"
                );
            }
            Output::Token {
                request,
                index,
                token,
            } => seen.entry(request).or_default().tokens.push((index, token)),
            Output::Finished { request, generated } => {
                let s = seen.entry(request).or_default();
                assert!(s.finished.is_none(), "request {request} finished twice");
                s.finished = Some(generated);
            }
            Output::Aborted { request } => seen.entry(request).or_default().aborted = true,
            Output::TransferFailed { request, .. } | Output::TransferTimedOut { request, .. } => {
                seen.entry(request).or_default().transfer_failed = true
            }
            Output::Recompute { .. } => {}
            Output::Requeued { request } => assert!(
                requeues,
                "request {request} requeued: a pair's engine requeues only after a recreation"
            ),
        }
    }
}

fn run_pair(p: &mut Pair, seen: &mut BTreeMap<u64, Seen>) {
    run_pair_as(p, seen, false)
}

fn run_pair_as(p: &mut Pair, seen: &mut BTreeMap<u64, Seen>, requeues: bool) {
    for _ in 0..10_000 {
        let r = p.step().expect("pair step");
        p.check_invariants();
        collect_as(p.drain_outputs(), seen, requeues);
        if r.idle {
            p.check_quiescent().expect("quiescent");
            return;
        }
    }
    panic!("the pair did not go idle");
}

/// The requests of [`specs`] run to idle on one engine of `cfg` (seed `seed`): the requests and
/// what the engine emitted for each.
fn one_engine(cfg: &Config, seed: u64) -> (Vec<RequestSpec>, BTreeMap<u64, Seen>) {
    let mut one = Engine::new(
        cfg.clone(),
        InOrderDevice::new(),
        ManualClock::default(),
        EngineOptions {
            seed,
            ..Default::default()
        },
    )
    .unwrap();
    let specs = specs(&one.synth);
    let mut single = BTreeMap::new();
    for s in &specs {
        one.submit(s.clone()).unwrap();
    }
    for _ in 0..10_000 {
        let r = one.step().unwrap();
        collect(one.drain_outputs(), &mut single);
        if r.idle {
            return (specs, single);
        }
    }
    panic!("the engine did not go idle");
}

#[test]
fn a_pair_emits_what_one_engine_emits() {
    let cfg = Config::preset("sim-small").unwrap();
    let (specs, single) = one_engine(&cfg, 11);
    let mut p = pair(cfg.clone(), cfg, 11).unwrap();
    for s in &specs {
        p.submit(s.clone()).unwrap();
    }
    // The stage report (a stuck pair's diagnosis) names each request in prefill before a step.
    let prefill: Vec<String> = (0..specs.len()).map(|i| format!("{i}: prefill")).collect();
    assert_eq!(p.stages(), prefill.join(", "));
    let mut paired = BTreeMap::new();
    run_pair(&mut p, &mut paired);
    assert_eq!(p.stages(), "", "an idle pair holds no request");
    // A request of one output token ends on the prefill side; every other one crosses.
    let crossing = specs.iter().filter(|s| s.max_new_tokens > 1).count();
    assert!(crossing > 0 && crossing < specs.len());
    assert_eq!(p.stats.transfers_done, crossing as u64);
    // Each send's copies wait on the load stream for the prefill's work, through the one
    // device both engines share.
    let load_waits = (p.decode().dev.0.borrow().waits.iter())
        .filter(|(s, _)| *s == tierkv_engine::device::StreamKind::Load)
        .count();
    assert!(load_waits >= crossing, "{load_waits} load-stream waits");
    // Each crossing request sent once, its prompt's pages of every layer.
    let layers = p.decode().layout().layers() as u64;
    let pages: u64 = specs
        .iter()
        .filter(|s| s.max_new_tokens > 1)
        .map(|s| (s.prompt.len() as u64).div_ceil(tierkv_engine::layout::PAGE_TOKENS as u64))
        .sum();
    assert_eq!(
        (
            p.stats.transfers_started,
            p.stats.transfers_failed,
            p.stats.layer_pages_sent
        ),
        (crossing as u64, 0, pages * layers),
        "{:?}",
        p.stats
    );
    assert_eq!(single.len(), specs.len());
    for (id, s) in &single {
        let q = &paired[id];
        assert_eq!(q.tokens, s.tokens, "request {id}: tokens");
        assert_eq!(q.finished, s.finished, "request {id}: finished");
        assert!(s.finished.is_some(), "request {id} finished");
        // Every position both computed (the prefix cache decides which prompt positions each
        // recomputes) has equal digests, and every generated position is in both.
        let prompt_len = specs[*id as usize].prompt.len() as u32;
        for (pos, d) in &s.digests {
            if let Some(e) = q.digests.get(pos) {
                assert_eq!(e, d, "request {id} position {pos}");
            } else {
                assert!(pos + 1 < prompt_len, "request {id}: position {pos} missing");
            }
        }
        for pos in prompt_len - 1..prompt_len + s.tokens.len() as u32 - 1 {
            assert!(q.digests.contains_key(&pos), "request {id} position {pos}");
        }
    }
}

#[test]
fn a_bf16_prefill_index_k_and_an_fp8_decode_are_refused() {
    let mut p = Config::preset("sim-small").unwrap();
    p.model.index_k_dtype = IndexKDtype::Bf16;
    let mut d = p.clone();
    d.model.index_k_dtype = IndexKDtype::Fp8;
    let e = pair(p, d, 0).err().expect("refused");
    let text = e.to_string();
    assert!(matches!(e, PdError::Handshake(_)), "{e:?}");
    assert!(
        text.contains("model.index_k_dtype (prefill: index_k/bf16")
            && text.contains("decode: index_k/fp8"),
        "{text}"
    );
}

/// The scale format is part of the handshake where either side's index-K is fp8: a bf16 prefill
/// with ue8m0 scales and an fp8 decode with fp32 ones are refused naming both fields; two bf16
/// sides with different scale formats store the same bytes, and pair.
#[test]
fn the_scale_format_matters_where_either_index_k_is_fp8() {
    use tierkv_engine::config::ScaleFmt;
    let mut p = Config::preset("sim-small").unwrap();
    p.model.index_k_dtype = IndexKDtype::Bf16;
    p.model.scale_fmt = ScaleFmt::Ue8m0;
    let mut d = p.clone();
    d.model.index_k_dtype = IndexKDtype::Fp8;
    d.model.scale_fmt = ScaleFmt::Fp32;
    let text = pair(p.clone(), d.clone(), 0)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        text.contains("model.index_k_dtype") && text.contains("model.scale_fmt"),
        "{text}"
    );
    d.model.index_k_dtype = IndexKDtype::Bf16;
    assert!(
        pair(p, d, 0).is_ok(),
        "two bf16 sides pair whatever their scales"
    );
}

#[test]
fn aborts_in_every_stage_leak_nothing() {
    let cfg = Config::preset("sim-small").unwrap();
    let mut p = pair(cfg.clone(), cfg, 5).unwrap();
    let specs = specs(&Synth::new(5));
    let mut seen = BTreeMap::new();
    // Abort one request after each number of steps: queued, prefilling, decoding.
    let ids: Vec<u64> = specs.iter().map(|s| p.submit(s.clone()).unwrap()).collect();
    for (step, &id) in ids.iter().enumerate().step_by(2) {
        for _ in 0..step {
            p.step().unwrap();
            p.check_invariants();
            collect(p.drain_outputs(), &mut seen);
        }
        p.abort(id).unwrap();
        p.check_invariants();
        collect(p.drain_outputs(), &mut seen);
    }
    run_pair(&mut p, &mut seen);
    for id in ids {
        let s = &seen[&id];
        assert!(
            s.finished.is_some() != s.aborted,
            "request {id} ends once: {s:?}"
        );
    }
}

/// A request aborted while its prompt is part computed on the prefill side ends there: it is
/// not exported to the decode side, which would compute from KV nobody wrote (zoo mutant 14's
/// bug; here with the mutants off).
#[test]
fn a_request_aborted_mid_prefill_is_not_exported() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.scheduler.prefill_tokens_per_step_max = 64;
    let mut p = pair(cfg.clone(), cfg, 3).unwrap();
    let s = Synth::new(3);
    let id = p
        .submit(RequestSpec {
            prompt: (0..300u64).map(|i| s.token(1, i)).collect(),
            max_new_tokens: 4,
        })
        .unwrap();
    p.step().unwrap();
    assert_eq!(
        p.stages(),
        format!("{id}: prefill"),
        "its prompt part computed"
    );
    assert!(p.abort(id).unwrap(), "found");
    assert_eq!(p.stages(), "", "ended on the prefill side");
    let mut seen = BTreeMap::new();
    collect(p.drain_outputs(), &mut seen);
    run_pair(&mut p, &mut seen);
    let r = &seen[&id];
    assert!(
        r.aborted && r.finished.is_none() && r.tokens.is_empty(),
        "{r:?}"
    );
    assert_eq!(p.stats.transfers_started, 0, "{:?}", p.stats);
}

#[test]
fn intake_checks_the_decode_side_limits() {
    let p_cfg = Config::preset("sim-small").unwrap();
    let mut d_cfg = p_cfg.clone();
    d_cfg.scheduler.output_tokens_max = 4;
    let mut p = pair(p_cfg, d_cfg, 0).unwrap();
    let e = p
        .submit(RequestSpec {
            prompt: vec![1, 2, 3],
            max_new_tokens: 5,
        })
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("the decode engine's scheduler.output_tokens_max"),
        "{e}"
    );
    // A request that fills the decode engine's context to the token is taken; one token more
    // is refused, naming that limit.
    let ctx = p.decode().config().model.context_tokens_max as usize;
    let fill = |extra: usize| RequestSpec {
        prompt: vec![1; ctx - 4 + extra],
        max_new_tokens: 4,
    };
    p.submit(fill(0))
        .expect("prompt + max_new_tokens = the context");
    let e = p.submit(fill(1)).unwrap_err();
    assert!(
        e.to_string()
            .contains("exceeds the decode engine's model.context_tokens_max"),
        "{e}"
    );
}

/// A clock the test and its link share.
#[derive(Clone, Default)]
struct SharedClock(Rc<std::cell::Cell<u64>>);

impl tierkv_engine::device::Clock for SharedClock {
    fn now_ns(&self) -> u64 {
        self.0.get()
    }
}

/// The peer link, with every notification lost: a wait for one sleeps to its deadline.
struct Mute {
    clock: SharedClock,
    waits: u32,
}

impl tierkv_engine::pd::KvLink<SharedDevice<InOrderDevice>> for Mute {
    fn send(
        &mut self,
        prefill: &mut SharedDevice<InOrderDevice>,
        decode: &mut SharedDevice<InOrderDevice>,
        after: tierkv_engine::device::EventId,
        pairs: &[(tierkv_engine::layout::PageId, tierkv_engine::layout::PageId)],
        layers: &[tierkv_engine::pd::LayerSend],
        sent: tierkv_engine::device::EventId,
    ) -> Result<(), tierkv_engine::pd::LinkError> {
        PeerLink.send(prefill, decode, after, pairs, layers, sent)
    }
    fn notified(
        &mut self,
        _decode: &mut SharedDevice<InOrderDevice>,
        _sent: tierkv_engine::device::EventId,
    ) -> bool {
        false
    }
    fn wait_notified(
        &mut self,
        _decode: &mut SharedDevice<InOrderDevice>,
        _sent: tierkv_engine::device::EventId,
        until_ns: u64,
    ) -> bool {
        self.waits += 1;
        self.clock.0.set(self.clock.0.get().max(until_ns));
        false
    }
}

/// Every notification lost: each send's layers arrive, the decode side waits for the message
/// until its deadline, gives the transfer up and sends it again; after the last try the request
/// ends with `TransferTimedOut`, and nothing is left on either side.
#[test]
fn a_transfer_whose_notification_never_comes_times_out() {
    let cfg = Config::preset("sim-small").unwrap();
    let dev = SharedDevice(Rc::new(RefCell::new(InOrderDevice::new())));
    let clock = SharedClock::default();
    let link = Mute {
        clock: clock.clone(),
        waits: 0,
    };
    let mut p = PdPair::new(
        cfg.clone(),
        cfg,
        dev.clone(),
        dev,
        clock.clone(),
        clock.clone(),
        link,
        EngineOptions::default(),
    )
    .unwrap();
    let s = Synth::new(0);
    let id = p
        .submit(RequestSpec {
            prompt: (0..100).map(|i| s.token(1, i)).collect(),
            max_new_tokens: 4,
        })
        .unwrap();
    let mut ended = None;
    for _ in 0..1_000 {
        let r = p.step().expect("pair step");
        p.check_invariants();
        for o in p.drain_outputs() {
            if let Output::TransferTimedOut { request, tries } = o {
                ended = Some((request, tries));
            }
        }
        if r.idle {
            break;
        }
    }
    let tries = tierkv_engine::engine::pair::TRANSFER_TRIES_MAX;
    assert_eq!(ended, Some((id, tries)));
    assert_eq!(p.stats.transfers_timed_out, tries as u64);
    // Each try sent the prompt's two pages of every layer, and failed; the request failed once.
    let layers = p.decode().layout().layers() as u64;
    assert_eq!(
        (
            p.stats.transfers_started,
            p.stats.transfers_failed,
            p.stats.requests_failed,
            p.stats.layer_pages_sent
        ),
        (tries as u64, tries as u64, 1, tries as u64 * 2 * layers),
        "{:?}",
        p.stats
    );
    p.check_quiescent().expect("quiescent");
    let deadline = tierkv_engine::pd::NOTIFICATION_DEADLINE_NS;
    assert!(
        clock.0.get() >= tries as u64 * deadline,
        "{} ns",
        clock.0.get()
    );
}

/// The two engines of a pair share one device: a recovery through either handle recreates the
/// one context, and both handles see its new generation.
#[test]
fn a_shared_device_has_one_context_generation() {
    use tierkv_engine::device::Device;
    let mut inner = InOrderDevice::new();
    inner.recover_recreates = true;
    let mut a = SharedDevice(Rc::new(RefCell::new(inner)));
    let b = a.clone();
    assert_eq!((a.context_generation(), b.context_generation()), (0, 0));
    a.recover().expect("a recovery");
    a.recover().expect("a recovery");
    assert_eq!((a.context_generation(), b.context_generation()), (2, 2));
    assert_eq!(b.0.borrow().recoveries, 2);
}

/// A kernel fails and its recovery recreates the shared device's context, at each of the
/// pair's first steps in turn: exports waiting for their transfers go back to the prefill
/// queue (at some of those points), every request still gets the tokens one engine gives it,
/// and the pair ends quiescent (no lock or page of a requeued export left behind).
#[test]
fn a_recreation_at_any_step_requeues_exports_and_the_tokens_stay() {
    let cfg = Config::preset("sim-small").unwrap();
    let (specs, single) = one_engine(&cfg, 11);
    // The decode engine runs one request at a time: the others' exports wait for it.
    let mut d_cfg = cfg.clone();
    d_cfg.scheduler.running_requests_max = 1;
    let mut requeued = 0;
    for at in 0..12 {
        let mut p = pair(cfg.clone(), d_cfg.clone(), 11).unwrap();
        for s in &specs {
            p.submit(s.clone()).unwrap();
        }
        let mut paired = BTreeMap::new();
        tierkv_engine::probe::take();
        for _ in 0..at {
            p.step().expect("pair step");
            collect_as(p.drain_outputs(), &mut paired, true);
        }
        {
            // Both engines' handles name the one shared device.
            let mut d = p.prefill().dev.0.borrow_mut();
            d.fail_next_kernels = 1;
            d.recover_recreates = true;
        }
        run_pair_as(&mut p, &mut paired, true);
        let probes = tierkv_engine::probe::take();
        requeued += probes.contains_key("pd.export_requeued") as u32;
        for (id, s) in &single {
            let q = &paired[id];
            assert_eq!(
                (&q.tokens, &q.finished),
                (&s.tokens, &s.finished),
                "failure at step {at}: request {id}"
            );
        }
    }
    assert!(requeued > 0, "no export was requeued at any of the steps");
}
