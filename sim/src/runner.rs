//! One simulated run: a scenario's engine on the simulated GPU, driven by its workload in virtual
//! time, with every oracle watching. The run stops at the first finding.

use crate::gpu::{SimGpu, Slice};
use crate::oracles::content::ContentOracle;
use crate::oracles::digest::{DigestOracle, Mismatch};
use crate::oracles::{conservation, liveness};
use crate::report::{Finding, OracleKind};
use crate::rng::Rng;
use crate::scenario::Scenario;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use tierkv_engine::device::DeviceError;
use tierkv_engine::mutants::Mutants;
use tierkv_engine::{Engine, EngineError, EngineOptions, Output, Rejection, RequestSpec};

#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions {
    /// Record every op for a Chrome trace.
    pub trace: bool,
    /// Perform the ops on a real GPU (`--device cuda`).
    pub cuda: bool,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct RunStats {
    pub steps: u64,
    pub submitted: u64,
    pub finished: u64,
    pub rejected: u64,
    pub aborted: u64,
    pub recomputed: u64,
    pub digests_checked: u64,
    pub rows_checked: u64,
    /// Rows whose page was compared earlier and not written since (not compared again).
    pub rows_cached: u64,
    pub ops: u64,
    pub events: u64,
    pub copy_bytes: u64,
    pub failed_copies: u64,
    pub loads: u64,
    pub backups: u64,
    pub sim_ns: u64,
    pub wall_ns: u64,
}

#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub seed: u64,
    pub findings: Vec<Finding>,
    pub stats: RunStats,
    pub log_hash: u64,
    pub trace: Vec<Slice>,
    pub racing_ops: Vec<u64>,
}

impl RunOutcome {
    pub fn failed(&self) -> bool {
        !self.findings.is_empty()
    }
}

thread_local! {
    static CAPTURE: RefCell<Option<String>> = const { RefCell::new(None) };
    static CAPTURING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Panics inside a run become findings; while a run is capturing, the panic hook records the
/// message instead of printing it (other panics print as usual).
fn install_quiet_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CAPTURING.with(|c| c.get()) {
                let msg = match info.payload().downcast_ref::<&str>() {
                    Some(s) => s.to_string(),
                    None => info
                        .payload()
                        .downcast_ref::<String>()
                        .cloned()
                        .unwrap_or_else(|| "panic".into()),
                };
                let loc = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                if std::env::var_os("TIERKV_BACKTRACE").is_some() {
                    eprintln!(
                        "panic: {msg}{loc}\n{}",
                        std::backtrace::Backtrace::force_capture()
                    );
                }
                CAPTURE.with(|c| *c.borrow_mut() = Some(format!("{msg}{loc}")));
            } else {
                default(info);
            }
        }));
    });
}

fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    install_quiet_hook();
    CAPTURING.with(|c| c.set(true));
    let r = catch_unwind(AssertUnwindSafe(f));
    CAPTURING.with(|c| c.set(false));
    r.map_err(|_| {
        CAPTURE
            .with(|c| c.borrow_mut().take())
            .unwrap_or_else(|| "panic".into())
    })
}

#[cfg(feature = "mutants")]
fn mutants_of(name: Option<&str>) -> Result<Mutants, String> {
    match name {
        None => Ok(Mutants::none()),
        Some(n) => tierkv_engine::mutants::Mutant::parse(n)
            .map(Mutants::only)
            .ok_or_else(|| format!("unknown mutant `{n}`")),
    }
}
#[cfg(not(feature = "mutants"))]
fn mutants_of(name: Option<&str>) -> Result<Mutants, String> {
    match name {
        None => Ok(Mutants::none()),
        Some(n) => Err(format!(
            "mutant `{n}` needs a build with `--features mutants`"
        )),
    }
}

/// Who submitted a request.
#[derive(Clone, Copy, Debug)]
enum Owner {
    Session(usize),
    OneShot,
}

struct SessionState {
    history: Vec<u32>,
    next_turn: usize,
    wait_until: u64,
    inflight: Option<u64>,
    done: bool,
    appended: u64,
}

fn engine_error_kind(e: &EngineError) -> OracleKind {
    match e {
        EngineError::Device(DeviceError::LayoutMismatch { .. })
        | EngineError::Device(DeviceError::OutOfBounds { .. })
        | EngineError::Device(DeviceError::Kernel { .. })
        | EngineError::Transfer(_) => OracleKind::Layout,
        _ => OracleKind::Engine,
    }
}

type Eng = Engine<SimGpu, crate::gpu::SimClock>;

/// Runs one scenario.
pub fn run(sc: &Scenario, opts: &RunOptions) -> RunOutcome {
    let wall = std::time::Instant::now();
    let mut findings = Vec::new();
    let cfg = sc.engine_config();
    let fail = |findings: Vec<Finding>, stats: RunStats| RunOutcome {
        seed: sc.seed,
        findings,
        stats,
        log_hash: 0,
        trace: Vec::new(),
        racing_ops: Vec::new(),
    };
    let mutants = match mutants_of(sc.mutant.as_deref()) {
        Ok(m) => m,
        Err(e) => {
            return fail(
                vec![Finding {
                    oracle: OracleKind::Engine,
                    time_ns: 0,
                    message: e,
                }],
                RunStats::default(),
            )
        }
    };
    let synth = tierkv_engine::synth::Synth::new(sc.seed);
    let content = Rc::new(RefCell::new(ContentOracle::new(&cfg, synth)));
    let mut digest = DigestOracle::new(&cfg);
    let make_gpu = |fault_alloc: bool| {
        let mut knobs = sc.gpu.clone();
        knobs.fail_first_host_alloc = fault_alloc;
        let mut o = knobs.options(opts.trace);
        o.cuda = opts.cuda;
        let mut g = SimGpu::new(sc.seed, o);
        g.content = Some(content.clone());
        g
    };
    let eopts = EngineOptions {
        seed: sc.seed,
        mutants,
    };
    // Start the engine; an injected host allocation failure must come back as a typed error
    // (never a panic), and the engine then starts on a device without the fault.
    enum Start {
        Ok(Box<Eng>),
        HostOutOfMemory,
        Failed(Finding),
    }
    let start = |fault_alloc: bool| {
        let gpu = make_gpu(fault_alloc);
        let clock = gpu.clock();
        match guarded(|| Engine::new(cfg.clone(), gpu, clock, eopts)) {
            Ok(Ok(e)) => Start::Ok(Box::new(e)),
            Ok(Err(EngineError::Device(DeviceError::OutOfMemory { .. }))) if fault_alloc => {
                Start::HostOutOfMemory
            }
            Ok(Err(e)) => Start::Failed(Finding {
                oracle: engine_error_kind(&e),
                time_ns: 0,
                message: format!("engine start: {e}"),
            }),
            Err(p) => Start::Failed(Finding {
                oracle: OracleKind::Invariant,
                time_ns: 0,
                message: p,
            }),
        }
    };
    let first = match start(sc.gpu.fail_first_host_alloc) {
        Start::HostOutOfMemory => start(false),
        other => other,
    };
    let mut engine: Eng = match first {
        Start::Ok(e) => *e,
        Start::Failed(f) => return fail(vec![f], RunStats::default()),
        Start::HostOutOfMemory => unreachable!("the retry runs without the fault"),
    };

    let ctx_max = cfg.model.context_tokens_max as usize;
    let queue_limit = cfg.scheduler.queued_requests_max as usize;
    let mut rng = Rng::new(sc.seed ^ 0xAB0_47);
    let mut stats = RunStats::default();
    let mut sessions: Vec<SessionState> = sc
        .workload
        .sessions
        .iter()
        .map(|s| SessionState {
            history: (0..s.system_tokens as u64)
                .map(|i| synth.token(s.system_id, i))
                .collect(),
            next_turn: 0,
            wait_until: s.start_ns,
            inflight: None,
            done: s.turns.is_empty(),
            appended: 0,
        })
        .collect();
    let mut oneshots: Vec<(u64, usize)> = sc
        .workload
        .oneshots
        .iter()
        .enumerate()
        .map(|(i, o)| (o.at_ns, i))
        .collect();
    oneshots.sort();
    let mut next_oneshot = 0usize;
    let mut owners: BTreeMap<u64, Owner> = BTreeMap::new();
    // Each request's prompt length and max_new_tokens, and the digests of its latest query.
    let mut specs: BTreeMap<u64, (usize, u32)> = BTreeMap::new();
    let mut last_digests: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut out_hash = 0u64;
    let mut faults_on = true;

    'run: loop {
        let now = engine.dev.now();
        // Arrivals that are due.
        for (i, st) in sessions.iter_mut().enumerate() {
            if st.done || st.inflight.is_some() || st.wait_until > now {
                continue;
            }
            let spec = &sc.workload.sessions[i];
            let Some(turn) = spec.turns.get(st.next_turn) else {
                st.done = true;
                continue;
            };
            let mut prompt = st.history.clone();
            let stream = 100_000 + i as u64;
            prompt.extend(
                (0..turn.append_tokens as u64).map(|k| synth.token(stream, st.appended + k)),
            );
            if prompt.len() + turn.generate as usize > ctx_max {
                st.done = true;
                continue;
            }
            match engine.submit(RequestSpec {
                prompt: prompt.clone(),
                max_new_tokens: turn.generate,
            }) {
                Ok(id) => {
                    stats.submitted += 1;
                    st.appended += turn.append_tokens as u64;
                    st.history = prompt.clone();
                    st.inflight = Some(id);
                    owners.insert(id, Owner::Session(i));
                    specs.insert(id, (prompt.len(), turn.generate));
                    content.borrow_mut().tokens.insert(id, prompt);
                }
                Err(Rejection::Invalid { reason }) => {
                    findings.push(Finding {
                        oracle: OracleKind::Engine,
                        time_ns: now,
                        message: format!("valid request rejected as invalid: {reason}"),
                    });
                    break 'run;
                }
                Err(_) => {
                    stats.rejected += 1;
                    st.wait_until = now + 500_000;
                }
            }
        }
        while next_oneshot < oneshots.len() && oneshots[next_oneshot].0 <= now {
            let o = &sc.workload.oneshots[oneshots[next_oneshot].1];
            next_oneshot += 1;
            let prompt: Vec<u32> = o
                .segments
                .iter()
                .flat_map(|&(stream, n)| (0..n as u64).map(move |k| (stream, k)))
                .map(|(s, k)| synth.token(s, k))
                .collect();
            if prompt.is_empty() || prompt.len() + o.generate as usize > ctx_max {
                continue;
            }
            match engine.submit(RequestSpec {
                prompt: prompt.clone(),
                max_new_tokens: o.generate,
            }) {
                Ok(id) => {
                    stats.submitted += 1;
                    owners.insert(id, Owner::OneShot);
                    specs.insert(id, (prompt.len(), o.generate));
                    content.borrow_mut().tokens.insert(id, prompt);
                }
                Err(_) => stats.rejected += 1,
            }
        }
        // Admission control keeps the queue bounded, bursts or not.
        if let Some(f) = liveness::queue_bounded(engine.queue_len(), queue_limit, now) {
            findings.push(f);
            break;
        }
        let arrivals_left = next_oneshot < oneshots.len() || sessions.iter().any(|s| !s.done);
        if faults_on && !arrivals_left {
            // The workload is in: faults stop, the liveness phase begins.
            faults_on = false;
            engine.dev.stop_faults();
        }
        if faults_on && sc.abort_mid_load_rate > 0.0 && rng.chance(sc.abort_mid_load_rate) {
            // Abort mid-load: a request whose load-back is still in flight.
            let loading: Vec<u64> = owners
                .keys()
                .copied()
                .filter(|id| engine.request(*id).is_some_and(|r| r.load.is_some()))
                .collect();
            if !loading.is_empty() {
                let victim = *rng.pick(&loading);
                if guarded(|| engine.abort(victim)).is_err() {
                    findings.push(Finding {
                        oracle: OracleKind::Invariant,
                        time_ns: now,
                        message: "panic in abort".into(),
                    });
                    break;
                }
            }
        }
        if faults_on && sc.abort_rate > 0.0 && !owners.is_empty() && rng.chance(sc.abort_rate) {
            let ids: Vec<u64> = owners.keys().copied().collect();
            let victim = *rng.pick(&ids);
            if guarded(|| engine.abort(victim)).is_err() {
                findings.push(Finding {
                    oracle: OracleKind::Invariant,
                    time_ns: now,
                    message: "panic in abort".into(),
                });
                break;
            }
        }
        let stepped = guarded(|| engine.step());
        // What the GPU saw during the step happened before the step's result.
        findings.append(&mut engine.dev.findings);
        let report = match stepped {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                findings.push(Finding {
                    oracle: engine_error_kind(&e),
                    time_ns: engine.dev.now(),
                    message: format!("engine step: {e}"),
                });
                break;
            }
            Err(p) => {
                findings.push(Finding {
                    oracle: OracleKind::Invariant,
                    time_ns: engine.dev.now(),
                    message: p,
                });
                break;
            }
        };
        stats.steps += 1;
        for o in engine.drain_outputs() {
            out_hash = tierkv_kernels::cpu::numerics::mix64(
                out_hash ^ format!("{o:?}").len() as u64 ^ output_key(&o),
            );
            match o {
                Output::Digests {
                    request,
                    position,
                    digests,
                } => {
                    let mut c = content.borrow_mut();
                    let tainted = (0..digests.len() as u32).any(|l| {
                        c.tainted_reads
                            .get(&(request, position, cfg.model.layer_base + l))
                            .copied()
                            .unwrap_or(false)
                    });
                    if tainted {
                        findings.push(Finding {
                            oracle: OracleKind::Content,
                            time_ns: engine.dev.now(),
                            message: format!(
                                "request {request} position {position}: the engine emitted digests computed from rows a failed copy left garbage in"
                            ),
                        });
                    }
                    last_digests.insert(request, digests.clone());
                    if let Some(m) = digest.check(&mut c, request, position, &digests) {
                        let (oracle, message) = match m {
                            Mismatch::TopK(s) => (OracleKind::TopK, s),
                            Mismatch::Digest(s) => (OracleKind::Digest, s),
                        };
                        findings.push(Finding {
                            oracle,
                            time_ns: engine.dev.now(),
                            message,
                        });
                    }
                }
                Output::Token {
                    request,
                    token,
                    index,
                } => {
                    // The token follows from the digests of its query, and comes in order.
                    let (prompt_len, _) = specs.get(&request).copied().unwrap_or((0, 0));
                    let mut c = content.borrow_mut();
                    let Some(t) = c.tokens.get_mut(&request) else {
                        continue;
                    };
                    let want = last_digests.get(&request).map(|d| synth.next_token(d));
                    if index as usize != t.len() - prompt_len || want != Some(token) {
                        findings.push(Finding {
                            oracle: OracleKind::Digest,
                            time_ns: engine.dev.now(),
                            message: format!(
                                "request {request}: token #{index} = {token} does not follow (expected #{} = {want:?} from its digests)",
                                t.len() - prompt_len
                            ),
                        });
                    }
                    t.push(token);
                }
                Output::Finished { request, generated } => {
                    stats.finished += 1;
                    if let Some(Owner::Session(i)) = owners.remove(&request) {
                        let st = &mut sessions[i];
                        st.history.extend_from_slice(&generated);
                        st.inflight = None;
                        st.next_turn += 1;
                        let now = engine.dev.now();
                        st.wait_until = sc.workload.sessions[i]
                            .turns
                            .get(st.next_turn)
                            .map(|t| now + t.think_ns)
                            .unwrap_or(now);
                    }
                    let known = content
                        .borrow()
                        .tokens
                        .get(&request)
                        .cloned()
                        .unwrap_or_default();
                    let (prompt_len, max_new) = specs.get(&request).copied().unwrap_or((0, 0));
                    if known.len() < prompt_len
                        || known[prompt_len..] != generated[..]
                        || generated.len() != max_new as usize
                    {
                        findings.push(Finding {
                            oracle: OracleKind::Digest,
                            time_ns: engine.dev.now(),
                            message: format!(
                                "request {request} finished with {} tokens that differ from the {} it emitted (max_new_tokens {max_new})",
                                generated.len(),
                                known.len().saturating_sub(prompt_len)
                            ),
                        });
                    }
                }
                Output::Aborted { request } => {
                    stats.aborted += 1;
                    if let Some(Owner::Session(i)) = owners.remove(&request) {
                        sessions[i].inflight = None;
                        sessions[i].done = true; // the client gave up on the session
                    }
                }
                Output::Recompute { .. } => stats.recomputed += 1,
            }
        }
        findings.append(&mut engine.dev.findings);
        if !findings.is_empty() {
            break;
        }
        if let Err(p) = guarded(|| engine.check_invariants()) {
            findings.push(Finding {
                oracle: OracleKind::Invariant,
                time_ns: engine.dev.now(),
                message: p,
            });
            break;
        }
        let unfinished = sessions.iter().filter(|s| !s.done).count();
        if let Some(f) = liveness::within_steps(
            stats.steps,
            sc.steps_max,
            engine.queue_len(),
            engine.running_len(),
            unfinished,
            engine.dev.now(),
        ) {
            findings.push(f);
            break;
        }
        if report.idle {
            let next_session = sessions
                .iter()
                .filter(|s| !s.done && s.inflight.is_none())
                .map(|s| s.wait_until)
                .min();
            let next_shot = oneshots.get(next_oneshot).map(|o| o.0);
            match next_session.into_iter().chain(next_shot).min() {
                Some(t) => engine.dev.advance_host_to(t.max(engine.dev.now() + 1)),
                None => break,
            }
        }
    }

    // The end: the device drains; everything must be returned and every request must have ended.
    if findings.is_empty() {
        match guarded(|| engine.dev.drain()) {
            Ok(()) => findings.append(&mut engine.dev.findings),
            Err(p) => findings.push(Finding {
                oracle: OracleKind::Invariant,
                time_ns: engine.dev.now(),
                message: p,
            }),
        }
    }
    if findings.is_empty() {
        let open: Vec<u64> = owners.keys().copied().collect();
        let now = engine.dev.now();
        if let Some(f) =
            liveness::all_requests_ended(&open, now).or_else(|| conservation::check(&engine, now))
        {
            findings.push(f);
        }
    }
    let m = &engine.metrics;
    stats.loads = m.loads;
    stats.backups = m.backups;
    let g = engine.dev.stats;
    stats.ops = g.ops;
    stats.events = g.events;
    stats.copy_bytes = g.copy_bytes;
    stats.failed_copies = g.failed_copies;
    stats.digests_checked = digest.digests_checked;
    stats.rows_checked = content.borrow().rows_checked;
    stats.rows_cached = content.borrow().rows_cached;
    stats.sim_ns = engine.dev.now();
    stats.wall_ns = wall.elapsed().as_nanos() as u64;
    RunOutcome {
        seed: sc.seed,
        findings,
        stats,
        log_hash: tierkv_kernels::cpu::numerics::mix64(engine.dev.log_hash() ^ out_hash),
        trace: std::mem::take(&mut engine.dev.trace),
        racing_ops: engine.dev.racing_ops.clone(),
    }
}

fn output_key(o: &Output) -> u64 {
    match o {
        Output::Digests {
            request,
            position,
            digests,
        } => digests
            .iter()
            .fold(request ^ ((*position as u64) << 32), |a, d| {
                tierkv_kernels::cpu::numerics::mix64(a ^ d)
            }),
        Output::Token {
            request,
            token,
            index,
        } => request ^ ((*token as u64) << 20) ^ ((*index as u64) << 50),
        Output::Finished { request, generated } => generated
            .iter()
            .fold(*request, |a, t| a.wrapping_mul(31) ^ *t as u64),
        Output::Aborted { request } => request.wrapping_mul(7),
        Output::Recompute { request, tokens } => request ^ ((*tokens as u64) << 40),
    }
}
