//! One simulated run: a scenario's engine on the simulated GPU, driven by its workload in virtual
//! time, with every oracle watching. The run stops at the first finding.

use crate::driver::{SimDevice, SimDriver};
use crate::gpu::{Mark, SimClock, SimGpu, SimSide, Slice};
use crate::link::SimLink;
use crate::oracles::content::{ContentOracle, Sampler, SAMPLE_EVERY};
use crate::oracles::digest::DigestOracle;
use crate::oracles::policy::{self, PolicyModel, Snapshot};
use crate::oracles::{bounds, conservation, liveness, metrics, reported};
use crate::probes::{self, SimProbe};
use crate::report::{Finding, OracleKind};
use crate::rng::Rng;
use crate::scenario::Scenario;
use crate::schedule::{Policy, Source};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use tierkv_engine::device::DeviceError;
use tierkv_engine::engine::EngineFaults;
use tierkv_engine::layout::{HostLayout, IndexKDtype, KvDtype};
use tierkv_engine::mutants::Mutants;
use tierkv_engine::pd::LinkError;
use tierkv_engine::runtime::driven::{CopyStrategy, DrivenDevice};
use tierkv_engine::synth::Synth;
use tierkv_engine::{
    Config, Engine, EngineError, EngineOptions, Output, PdError, PdPair, Rejection, RequestSpec,
};
use tierkv_kernels::cpu::numerics::mix64;
use tierkv_kernels::mutants::KernelMutant;

#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Record every op for a Chrome trace.
    pub trace: bool,
    /// Perform the ops on a real GPU (`--device cuda`).
    pub cuda: bool,
    /// The schedule to run under; `None`: the scenario's own (schedule 0, its policy).
    pub schedule: Option<Source>,
    /// Hold every query row to the specification's logits and top-k (`--exhaustive`), not a
    /// sampled one in `SAMPLE_EVERY`.
    pub exhaustive: bool,
    /// Print a progress line on stderr at this interval of wall time while the run lasts (a
    /// long single seed would otherwise be silent for minutes). What the run does is the same
    /// with or without it.
    pub progress: Option<std::time::Duration>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunStats {
    pub steps: u64,
    pub submitted: u64,
    pub finished: u64,
    pub rejected: u64,
    pub aborted: u64,
    pub recomputed: u64,
    /// Running requests the engine sent back to the queue after its device's context was
    /// recreated (`Output::Requeued`).
    #[serde(default)]
    pub requeued: u64,
    /// One-shot arrivals (first tries and retries) the schedule deferred past a step.
    #[serde(default)]
    pub oneshots_deferred: u64,
    /// Runs that ended with nothing left to arrive, where every one-shot was checked to have
    /// ended exactly once (the runner's ledger, `Ends`).
    #[serde(default)]
    pub arrivals_checked: u64,
    pub digests_checked: u64,
    pub rows_checked: u64,
    /// Rows whose page was compared earlier and not written since (not compared again).
    pub rows_cached: u64,
    /// Query rows whose logits and selection the specification recomputed (a sampled share).
    #[serde(default)]
    pub queries_recomputed: u64,
    /// Cache decisions the policy model judged: device and host evictions, write-policy
    /// triggers, and steps whose prefix-hit counters it recounted (`oracles::policy`).
    #[serde(default)]
    pub policy_judged: u64,
    pub ops: u64,
    pub events: u64,
    pub copy_bytes: u64,
    pub failed_copies: u64,
    /// Kernel launches that failed, and steps the engine dropped and ran again for them.
    pub failed_kernels: u64,
    pub steps_failed: u64,
    pub loads: u64,
    pub backups: u64,
    pub sim_ns: u64,
    pub wall_ns: u64,
}

impl RunStats {
    /// Adds another run's figures (a campaign's totals). A sum past `u64::MAX` is a broken
    /// invariant here (one process's runs cannot count that far): it panics.
    pub fn add(&mut self, s: &RunStats) {
        *self = self
            .checked_add(s)
            .unwrap_or_else(|what| panic!("campaign totals: {what} overflows u64"));
    }

    /// The sum of two runs' figures, or the name of the first figure whose sum overflows `u64`
    /// (shard results read from files can hold anything; `campaign merge` refuses then).
    pub fn checked_add(&self, s: &RunStats) -> Result<RunStats, &'static str> {
        let sum = |name: &'static str, a: u64, b: u64| a.checked_add(b).ok_or(name);
        Ok(RunStats {
            steps: sum("steps", self.steps, s.steps)?,
            submitted: sum("submitted", self.submitted, s.submitted)?,
            finished: sum("finished", self.finished, s.finished)?,
            rejected: sum("rejected", self.rejected, s.rejected)?,
            aborted: sum("aborted", self.aborted, s.aborted)?,
            recomputed: sum("recomputed", self.recomputed, s.recomputed)?,
            requeued: sum("requeued", self.requeued, s.requeued)?,
            oneshots_deferred: sum(
                "oneshots_deferred",
                self.oneshots_deferred,
                s.oneshots_deferred,
            )?,
            arrivals_checked: sum(
                "arrivals_checked",
                self.arrivals_checked,
                s.arrivals_checked,
            )?,
            digests_checked: sum("digests_checked", self.digests_checked, s.digests_checked)?,
            rows_checked: sum("rows_checked", self.rows_checked, s.rows_checked)?,
            rows_cached: sum("rows_cached", self.rows_cached, s.rows_cached)?,
            queries_recomputed: sum(
                "queries_recomputed",
                self.queries_recomputed,
                s.queries_recomputed,
            )?,
            policy_judged: sum("policy_judged", self.policy_judged, s.policy_judged)?,
            ops: sum("ops", self.ops, s.ops)?,
            events: sum("events", self.events, s.events)?,
            copy_bytes: sum("copy_bytes", self.copy_bytes, s.copy_bytes)?,
            failed_copies: sum("failed_copies", self.failed_copies, s.failed_copies)?,
            failed_kernels: sum("failed_kernels", self.failed_kernels, s.failed_kernels)?,
            steps_failed: sum("steps_failed", self.steps_failed, s.steps_failed)?,
            loads: sum("loads", self.loads, s.loads)?,
            backups: sum("backups", self.backups, s.backups)?,
            sim_ns: sum("sim_ns", self.sim_ns, s.sim_ns)?,
            wall_ns: sum("wall_ns", self.wall_ns, s.wall_ns)?,
        })
    }
}

#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub seed: u64,
    pub findings: Vec<Finding>,
    pub stats: RunStats,
    pub log_hash: u64,
    pub trace: Vec<Slice>,
    /// Records, waits and host calls of a traced run.
    pub marks: Vec<Mark>,
    pub racing_ops: Vec<u64>,
    /// How often the run hit each coverage probe (`probes`; absent: never).
    pub probes: BTreeMap<&'static str, u64>,
    /// How many schedule decisions the run had made when it first hit each probe it hit
    /// (`tierkv_engine::probe::first_hits`): the prefix of `decisions` that reached it.
    pub first_hits: BTreeMap<&'static str, u64>,
    /// A campaign ran it twice for the determinism oracle.
    pub rerun: bool,
    /// The schedule it ran under: every decision, in the order made (`schedule`).
    pub decisions: Vec<u8>,
    /// How many decisions of each kind it made.
    pub decision_counts: crate::schedule::Counts,
    /// Which schedule of the seed a campaign ran (0: the scenario's own; `--schedules`), and
    /// the policy that drew it (`None`: the scenario's own).
    pub schedule: u64,
    pub policy: Option<Policy>,
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

/// What a mutant's name switches on: an engine mutant (the zoo's incidents) or a bug planted in
/// a kernel reference (the simulator's self-test).
#[derive(Clone, Copy, Debug, Default)]
pub struct Planted {
    pub engine: Mutants,
    pub kernel: Option<KernelMutant>,
}

/// What the mutant named `name` plants (`None`: nothing, the clean engine); an error names an
/// unknown mutant, or a build without the zoo.
#[cfg(feature = "mutants")]
pub fn mutants_of(name: Option<&str>) -> Result<Planted, String> {
    use tierkv_engine::mutants::Mutant;
    let Some(n) = name else {
        return Ok(Planted::default());
    };
    if let Some(m) = Mutant::parse(n) {
        return Ok(Planted {
            engine: Mutants::only(m),
            kernel: m.kernel(),
        });
    }
    if let Some(k) = KernelMutant::parse(n) {
        return Ok(Planted {
            engine: Mutants::none(),
            kernel: Some(k),
        });
    }
    let names: Vec<&str> = Mutant::ALL
        .iter()
        .map(|m| m.name())
        .chain(KernelMutant::ALL.iter().map(|m| m.name()))
        .collect();
    Err(format!(
        "unknown mutant `{n}`; the mutants are: {}",
        names.join(", ")
    ))
}
/// What the mutant named `name` plants (`None`: nothing, the clean engine); an error names an
/// unknown mutant, or a build without the zoo.
#[cfg(not(feature = "mutants"))]
pub fn mutants_of(name: Option<&str>) -> Result<Planted, String> {
    match name {
        None => Ok(Planted::default()),
        Some(n) => Err(format!(
            "mutant `{n}` needs the zoo's binary: cargo run --release -p tierkv-sim --features mutants --bin tierkv-zoo -- ..."
        )),
    }
}

/// Switches a planted reference bug on for this thread while a run lasts.
struct KernelMutantGuard;

impl KernelMutantGuard {
    fn set(_m: Option<KernelMutant>) -> KernelMutantGuard {
        #[cfg(feature = "mutants")]
        tierkv_kernels::mutants::set(_m);
        KernelMutantGuard
    }
}

impl Drop for KernelMutantGuard {
    fn drop(&mut self) {
        #[cfg(feature = "mutants")]
        tierkv_kernels::mutants::set(None);
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
    /// Its next turn is due and deferred (in `Run::deferred`).
    deferred: bool,
}

/// An arrival or abort that reaches the engine a step after it was due.
#[derive(Clone, Copy, Debug)]
enum Deferred {
    /// A one-shot request (workload index) on its `tries`-th try.
    OneShot { index: usize, tries: u32 },
    /// A session's next turn.
    Turn(usize),
    /// An abort of a request.
    Abort(u64),
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

type Eng = Engine<SimDevice, SimClock>;
type PairEng = PdPair<SimDevice, SimClock, SimLink>;

/// What a run drives: one engine on side 0 of the simulated GPU, or (the `pd` profile) a
/// prefill/decode pair, prefill on side 0 and decode on side 1, joined by the simulated link.
enum Target {
    One(Box<Eng>),
    Pair(Box<PairEng>),
}

/// A pair's error as the engine error it carries (a link's layout refusal as a device one).
fn pd_error(e: PdError) -> EngineError {
    match e {
        PdError::Engine { source, .. } => source,
        PdError::Link(LinkError::Device(d)) => EngineError::Device(d),
        other => EngineError::Device(DeviceError::Backend {
            detail: other.to_string(),
        }),
    }
}

impl Target {
    /// The engine that takes submissions (the pair's prefill engine).
    fn intake(&self) -> &Eng {
        match self {
            Target::One(e) => e,
            Target::Pair(p) => p.prefill(),
        }
    }
    /// The operator's eviction, on the intake engine (whose pages `evict` counts).
    fn evict_device(&mut self, pages: usize) -> Result<usize, EngineError> {
        match self {
            Target::One(e) => e.evict_device(pages),
            Target::Pair(p) => p.evict_prefill(pages).map_err(pd_error),
        }
    }
    /// Every engine, intake first.
    fn engines(&self) -> Vec<&Eng> {
        match self {
            Target::One(e) => vec![&**e],
            Target::Pair(p) => vec![p.prefill(), p.decode()],
        }
    }
    fn submit(&mut self, spec: RequestSpec) -> Result<u64, Rejection> {
        match self {
            Target::One(e) => e.submit(spec),
            Target::Pair(p) => p.submit(spec),
        }
    }
    fn step(&mut self) -> Result<tierkv_engine::StepReport, EngineError> {
        match self {
            Target::One(e) => e.step(),
            Target::Pair(p) => p.step().map_err(pd_error),
        }
    }
    fn abort(&mut self, id: u64) -> Result<bool, EngineError> {
        match self {
            Target::One(e) => Ok(e.abort(id)),
            Target::Pair(p) => p.abort(id).map_err(pd_error),
        }
    }
    fn drain_outputs(&mut self) -> Vec<Output> {
        match self {
            Target::One(e) => e.drain_outputs(),
            Target::Pair(p) => p.drain_outputs(),
        }
    }
    fn request(&self, id: u64) -> Option<&tierkv_engine::scheduler::Request> {
        self.engines().into_iter().find_map(|e| e.request(id))
    }
    fn queue_len(&self) -> usize {
        self.intake().queue_len()
    }
    fn running_len(&self) -> usize {
        match self {
            Target::One(e) => e.running_len(),
            Target::Pair(p) => {
                p.prefill().running_len() + p.in_transfer() + p.decode().running_len()
            }
        }
    }
    fn inject(&mut self, f: EngineFaults) {
        match self {
            Target::One(e) => e.inject(f),
            Target::Pair(p) => p.inject(f),
        }
    }
    fn check_invariants(&self) {
        match self {
            Target::One(e) => e.check_invariants(),
            Target::Pair(p) => p.check_invariants(),
        }
    }
    fn check_quiescent(&self, now: u64) -> Option<Finding> {
        match self {
            Target::One(e) => conservation::check(e, now),
            Target::Pair(p) => p.check_quiescent().err().map(|message| Finding {
                oracle: OracleKind::Conservation,
                time_ns: now,
                message,
            }),
        }
    }
}

/// Why a run ends early: its findings are in `Run::findings`.
struct Stop;

/// How many times each arrival of a workload ended (taken by the engine, refused for good, or
/// given up after its last try). An arrival the schedule deferred is delivered once, later: a
/// second end is a simulator bug, and so is an arrival that never ended once nothing is left to
/// arrive. Both panic.
#[derive(Debug)]
struct Ends(Vec<u32>);

impl Ends {
    fn new(arrivals: usize) -> Ends {
        Ends(vec![0; arrivals])
    }
    fn end(&mut self, index: usize) {
        let n = &mut self.0[index];
        *n += 1;
        assert_eq!(
            *n, 1,
            "arrival {index} ended twice (delivered more than once)"
        );
    }
    fn check_all_ended(&self) {
        let never: Vec<usize> = (0..self.0.len()).filter(|&i| self.0[i] == 0).collect();
        assert!(
            never.is_empty(),
            "arrivals {never:?} never ended though nothing is left to arrive"
        );
    }
}

/// What a runner's draw decides (the key of its generator, with the iteration).
#[derive(Clone, Copy, Debug)]
enum Draw {
    /// Whether a request with a load in flight is aborted, and which.
    AbortMidLoad = 1,
    /// Whether a client aborts a request, and which.
    Abort = 2,
    /// Whether the operator asks for device pages back, and how many.
    Evict = 3,
}

/// One run in progress: the engine, the oracles, the workload's state and what was found.
struct Run<'a> {
    sc: &'a Scenario,
    cfg: Config,
    synth: Synth,
    engine: Target,
    /// The simulated GPU the engine (or both engines of a pair) runs on.
    gpu: Rc<RefCell<SimGpu>>,
    content: Rc<RefCell<ContentOracle>>,
    digest: DigestOracle,
    /// The key of the runner's own draws (aborts, the operator's evictions): each is keyed by
    /// what it decides and the iteration it decides it in ([`Run::keyed`]), so no draw moves
    /// another.
    draw_key: u64,
    /// Iterations of the run loop so far.
    iterations: u64,
    stats: RunStats,
    sessions: Vec<SessionState>,
    /// One-shot arrivals by time: (time, index into the workload).
    oneshots: Vec<(u64, usize)>,
    next_oneshot: usize,
    /// How each one-shot ended: exactly once each, whether deferred by the schedule or not.
    oneshot_ends: Ends,
    /// One-shots refused by admission control, to be sent again: (due time, index into the
    /// workload, tries so far).
    retries: BTreeSet<(u64, usize, u32)>,
    /// Arrivals and aborts the schedule deferred to after the step they were due before
    /// (`schedule::Kind::Arrival`): delivered, in order, before the next step.
    deferred: Vec<Deferred>,
    /// The scenario's weight update happened (`Scenario::weights_update_ns`).
    weights_updated: bool,
    owners: BTreeMap<u64, Owner>,
    /// Each request's prompt length and max_new_tokens.
    specs: BTreeMap<u64, (usize, u32)>,
    /// The digests of each request's latest query.
    last_digests: BTreeMap<u64, Vec<u64>>,
    out_hash: u64,
    faults_on: bool,
    findings: Vec<Finding>,
    /// What the clients saw, for the metrics oracle.
    counted: metrics::Counted,
    /// The requests the engine took and has not admitted or aborted, in the order the clients
    /// submitted them: the admission order the engine must keep.
    admission_queue: std::collections::VecDeque<u64>,
    /// The requests admitted that have not finished or been aborted (the runner's own count).
    running_model: BTreeSet<u64>,
    /// Requests the engine ever sent back to the queue (`Output::Requeued`): one in the queue
    /// returned there without intake (`oracles::bounds`).
    requeued: BTreeSet<u64>,
    /// The reference model of the cache's policies (one engine; `oracles::policy`).
    policy: Option<PolicyModel>,
}

/// What an engine call changed that the policy oracle reads: the counters of failures (a call
/// with any is recovery, not policy) and of prefix hits.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Counters {
    failures: u64,
    device_hit: u64,
    host_hit: u64,
}

/// This thread's probe counts and first hits since the run began, with the combinations of the
/// run's factors (`targets::add_combinations`) added; the table starts empty again.
fn take_probes(
    cfg: &Config,
    overlap: bool,
) -> (BTreeMap<&'static str, u64>, BTreeMap<&'static str, u64>) {
    let (mut first_hits, mut probes) = (
        tierkv_engine::probe::first_hits(),
        tierkv_engine::probe::take(),
    );
    crate::targets::add_combinations(
        &crate::targets::config_factors(cfg, overlap),
        &mut probes,
        &mut first_hits,
    );
    (first_hits, probes)
}

/// Runs one scenario.
pub fn run(sc: &Scenario, opts: &RunOptions) -> RunOutcome {
    let wall = std::time::Instant::now();
    // The probes count on this thread: start from zero.
    tierkv_engine::probe::take();
    let kernel = mutants_of(sc.mutant.as_deref()).map_or(None, |p| p.kernel);
    let _planted = KernelMutantGuard::set(kernel);
    let mut r = match Run::start(sc, opts) {
        Ok(r) => r,
        Err(f) => {
            return RunOutcome {
                seed: sc.seed,
                findings: vec![f],
                stats: RunStats::default(),
                log_hash: 0,
                trace: Vec::new(),
                marks: Vec::new(),
                racing_ops: Vec::new(),
                first_hits: tierkv_engine::probe::first_hits(),
                probes: tierkv_engine::probe::take(),
                rerun: false,
                decisions: Vec::new(),
                decision_counts: Default::default(),
                schedule: 0,
                policy: None,
            }
        }
    };
    let mut note_at = opts.progress.map(|every| (every, wall + every));
    while r.iteration().is_ok() {
        if let Some((every, at)) = &mut note_at {
            let now = std::time::Instant::now();
            if now >= *at {
                eprintln!("{}", r.progress_line(wall));
                *at = now + *every;
            }
        }
    }
    r.finish(wall)
}

/// The engine on a fresh simulated GPU. An injected host allocation failure must come back as a
/// typed error (never a panic), and the engine then starts on a device without the fault.
fn start_engine(
    sc: &Scenario,
    opts: &RunOptions,
    cfg: &Config,
    content: &Rc<RefCell<ContentOracle>>,
) -> Result<(Target, Rc<RefCell<SimGpu>>), Finding> {
    let planted = mutants_of(sc.mutant.as_deref()).map_err(|e| Finding {
        oracle: OracleKind::Engine,
        time_ns: 0,
        message: e,
    })?;
    let eopts = EngineOptions {
        seed: sc.seed,
        mutants: planted.engine,
        faults: EngineFaults {
            seed: sc.seed,
            device_pages_refused_rate: sc.device_pages_refused_rate,
            host_pages_refused_rate: sc.host_pages_refused_rate,
        },
        overlap: sc.overlap,
    };
    let failed = |oracle, message| Finding {
        oracle,
        time_ns: 0,
        message,
    };
    type Started = Result<(Target, Rc<RefCell<SimGpu>>), EngineError>;
    let start = |fault_alloc: bool| -> Result<Started, Finding> {
        let mut knobs = sc.gpu.clone();
        if !fault_alloc {
            knobs.fail_first_host_alloc = false;
            knobs.fail_alloc_nth = 0;
        }
        let mut o = knobs.options(opts.trace);
        o.cuda = opts.cuda;
        if let Some(s) = &opts.schedule {
            o.schedule = s.clone();
        }
        // PCT over an unknown op-start count: about 40 op starts (each a hold decision) per
        // request and layer.
        o.ops_guess = (sc.workload.requests() as u64 * cfg.model.layers as u64 * 40).max(1);
        let mut gpu = SimGpu::new(sc.seed, o)
            .map_err(|e| failed(OracleKind::Engine, format!("simulated GPU: {e}")))?;
        gpu.content = Some(content.clone());
        gpu.ahead = sc.overlap;
        let clock = gpu.clock();
        let gpu = Rc::new(RefCell::new(gpu));
        let side = |side| SimSide {
            gpu: gpu.clone(),
            side,
        };
        let target = if sc.profile == "pd" {
            let decode = decode_config(cfg, sc.seed);
            // First a decode configuration one handshake field off: the pair must refuse it,
            // naming that field alone (nothing is built when it does).
            if let Some((off, field)) = one_field_off(&decode, sc.seed) {
                let trial = guarded(|| {
                    PdPair::new(
                        cfg.clone(),
                        off,
                        SimDevice::Direct(side(0)),
                        SimDevice::Direct(side(1)),
                        clock.clone(),
                        clock.clone(),
                        SimLink::new(sc.seed),
                        eopts,
                    )
                    .map(|_| ())
                })
                .map_err(|p| failed(OracleKind::Invariant, p))?;
                if let Some(message) = refused_for(trial, field) {
                    return Err(failed(OracleKind::Engine, message));
                }
            }
            let link =
                SimLink::with_notifications(sc.seed, sc.notify_loss_rate, sc.notify_late_ns_max);
            let pair = PdPair::new(
                cfg.clone(),
                decode,
                SimDevice::Direct(side(0)),
                SimDevice::Direct(side(1)),
                clock.clone(),
                clock,
                link,
                eopts,
            );
            guarded(|| pair.map(|p| Target::Pair(Box::new(p))).map_err(pd_error))
        } else {
            let staging = sc.gpu.runtime_staging_bytes as usize;
            guarded(|| {
                // The production runtime over the simulated driver, unless the run performs
                // its ops on a real GPU (whose executor takes the ops themselves).
                let dev = if staging > 0 && !opts.cuda {
                    let driver = SimDriver::new(side(0));
                    let strategy = [CopyStrategy::Gather, CopyStrategy::MemcpyRuns]
                        [sc.gpu.runtime_copy_runs as usize];
                    let mut rt = DrivenDevice::with_staging(driver, strategy, staging)
                        .map_err(EngineError::Device)?;
                    rt.mutants = eopts.mutants;
                    rt.set_timing(sc.gpu.runtime_timing);
                    rt.set_graphs(sc.gpu.runtime_graphs);
                    SimDevice::Runtime(Box::new(rt))
                } else {
                    SimDevice::Direct(side(0))
                };
                Engine::new(cfg.clone(), dev, clock, eopts).map(|e| Target::One(Box::new(e)))
            })
        };
        gpu.borrow_mut().arm_driver_faults();
        target
            .map(|t| t.map(|t| (t, gpu)))
            .map_err(|p| failed(OracleKind::Invariant, p))
    };
    let alloc_fault = sc.gpu.fail_first_host_alloc || sc.gpu.fail_alloc_nth > 0;
    let first = match start(alloc_fault)? {
        Err(EngineError::Device(DeviceError::OutOfMemory { .. })) if alloc_fault => start(false)?,
        other => other,
    };
    first.map_err(|e| failed(engine_error_kind(&e), format!("engine start: {e}")))
}

/// A decode configuration that differs from `d` in exactly one field the prefill/decode
/// handshake compares, drawn from the seed, with the name the handshake gives that field; `None`
/// when the drawn change makes the configuration invalid.
fn one_field_off(d: &Config, seed: u64) -> Option<(Config, &'static str)> {
    let mut r = Rng::new(seed ^ 0x0000_0FF0);
    let mut x = d.clone();
    let m = &mut x.model;
    let field = match r.below(6) {
        0 => {
            m.layers = if m.layers > 1 { m.layers - 1 } else { 2 };
            "model.layers"
        }
        1 => {
            m.layer_base = if m.layer_base > 0 {
                m.layer_base - 1
            } else {
                1
            };
            "model.layer_base"
        }
        2 => {
            m.kv_dtype = match m.kv_dtype {
                KvDtype::Bf16 => KvDtype::Fp8Packed,
                _ => KvDtype::Bf16,
            };
            "model.kv_dtype"
        }
        3 => {
            m.index_k_dtype = match m.index_k_dtype {
                IndexKDtype::Fp8 => IndexKDtype::Bf16,
                IndexKDtype::Bf16 => IndexKDtype::Fp8,
            };
            "model.index_k_dtype"
        }
        4 => {
            x.cache.host_layout = match x.cache.host_layout {
                HostLayout::LayerFirst => HostLayout::PageFirst,
                HostLayout::PageFirst => HostLayout::LayerFirst,
            };
            "cache.host_layout"
        }
        _ => {
            m.rope_theta *= 2.0;
            "RoPE frequencies of the index keys"
        }
    };
    x.validate().is_ok().then_some((x, field))
}

/// What was wrong with a pair's answer to a decode configuration one `field` off: `None` when
/// it was the handshake's typed refusal naming that field alone.
fn refused_for(trial: Result<(), PdError>, field: &str) -> Option<String> {
    match trial {
        Err(PdError::Handshake(tierkv_engine::pd::HandshakeError::Layout {
            mismatches, ..
        })) if mismatches.len() == 1 && mismatches[0].field == field => None,
        Ok(()) => Some(format!(
            "the prefill/decode pair started with a decode configuration that differs in {field}"
        )),
        Err(e) => Some(format!(
            "a decode configuration that differs in {field} alone was refused with: {e}"
        )),
    }
}

/// The decode engine's configuration in a `pd` run: the scenario's, with its own device tier
/// and running limit drawn from the seed (the layout the handshake compares stays equal), so
/// that the two sides' back-pressure differs. The scenario's own when the draw would not fit.
fn decode_config(cfg: &Config, seed: u64) -> Config {
    let mut r = Rng::new(seed ^ 0x000D_EC0D);
    let mut d = cfg.clone();
    let request = cfg.model.context_tokens_max.div_ceil(64);
    let pages = cfg.cache.device_pages as u64;
    d.cache.device_pages = (r.range(pages / 2, pages * 3 / 2 + 1) as u32).max(request + 1);
    d.scheduler.running_requests_max = r.range(1, 8) as u32;
    if d.validate().is_ok() {
        d
    } else {
        cfg.clone()
    }
}

impl<'a> Run<'a> {
    fn start(sc: &'a Scenario, opts: &RunOptions) -> Result<Run<'a>, Finding> {
        let cfg = sc.engine_config();
        let synth = tierkv_engine::synth::Synth::new(sc.seed);
        let sampler = Sampler {
            seed: sc.seed,
            every: if opts.exhaustive { 1 } else { SAMPLE_EVERY },
        };
        let content = Rc::new(RefCell::new(ContentOracle::new(&cfg, synth, sampler)));
        let digest = DigestOracle::new(&cfg);
        let (engine, gpu) = start_engine(sc, opts, &cfg, &content)?;
        let one_engine = matches!(engine, Target::One(_));
        let cfg_policy = cfg.cache.write_policy;
        let sessions = sc
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
                deferred: false,
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
        Ok(Run {
            sc,
            cfg,
            synth,
            engine,
            gpu,
            content,
            digest,
            draw_key: mix64(sc.seed ^ 0x000A_B047),
            iterations: 0,
            stats: RunStats::default(),
            sessions,
            oneshots,
            next_oneshot: 0,
            oneshot_ends: Ends::new(sc.workload.oneshots.len()),
            retries: BTreeSet::new(),
            deferred: Vec::new(),
            weights_updated: false,
            owners: BTreeMap::new(),
            specs: BTreeMap::new(),
            last_digests: BTreeMap::new(),
            out_hash: 0,
            faults_on: true,
            findings: Vec::new(),
            counted: metrics::Counted::default(),
            admission_queue: Default::default(),
            running_model: BTreeSet::new(),
            requeued: BTreeSet::new(),
            policy: one_engine.then(|| PolicyModel::new(cfg_policy)),
        })
    }

    fn found(&mut self, oracle: OracleKind, message: String) {
        let time_ns = self.gpu.borrow().now();
        self.findings.push(Finding {
            oracle,
            time_ns,
            message,
        });
    }

    /// One iteration of the run loop: arrivals, faults, one engine step and its outputs, the
    /// per-step oracles, and idle time.
    fn iteration(&mut self) -> Result<(), Stop> {
        self.iterations += 1;
        let now = self.gpu.borrow().now();
        self.deferred_arrivals(now)?;
        self.session_arrivals(now)?;
        self.oneshot_arrivals(now)?;
        // Admission control keeps the queue bounded, bursts or not.
        self.bounds()?;
        self.faults()?;
        let idle = self.step()?;
        self.per_step_oracles()?;
        if idle {
            self.advance_idle()?;
        }
        Ok(())
    }

    /// What the schedule deferred at the previous step reaches the engine now, in the order the
    /// schedule deferred it (no decision is made for it again).
    fn deferred_arrivals(&mut self, now: u64) -> Result<(), Stop> {
        for d in std::mem::take(&mut self.deferred) {
            match d {
                Deferred::OneShot { index, tries } => self.send_oneshot(now, index, tries)?,
                Deferred::Turn(i) => {
                    let st = &self.sessions[i];
                    assert!(
                        st.deferred && st.inflight.is_none() && !st.done,
                        "session {i}'s deferred turn is its next one"
                    );
                    self.sessions[i].deferred = false;
                    self.send_turn(now, i)?;
                }
                // The request may have ended meanwhile: the abort still reaches the engine, as
                // a client's abort that crossed its last token would.
                Deferred::Abort(victim) => self.abort(victim)?,
            }
        }
        Ok(())
    }

    /// Whether the schedule has an arrival or abort due now reach the engine after the coming
    /// step; if so it is kept in `deferred`.
    fn defer(&mut self, d: Deferred) -> bool {
        let later = self.gpu.borrow_mut().arrival_deferred();
        if later {
            self.deferred.push(d);
        }
        later
    }

    /// Session turns that are due: each submits its history plus the turn's appended tokens
    /// (now or, as the schedule decides, after the coming step).
    fn session_arrivals(&mut self, now: u64) -> Result<(), Stop> {
        for i in 0..self.sessions.len() {
            let st = &self.sessions[i];
            if st.done || st.inflight.is_some() || st.deferred || st.wait_until > now {
                continue;
            }
            if self.sc.workload.sessions[i].turns.len() <= st.next_turn {
                self.sessions[i].done = true;
                continue;
            }
            if self.defer(Deferred::Turn(i)) {
                self.sessions[i].deferred = true;
                continue;
            }
            self.send_turn(now, i)?;
        }
        Ok(())
    }

    /// Session `i`'s next turn, which is due (`session_arrivals` marks a session with none left
    /// done first). A turn past the context is still sent (the engine must refuse it) and ends
    /// the session.
    fn send_turn(&mut self, now: u64, i: usize) -> Result<(), Stop> {
        let st = &mut self.sessions[i];
        assert!(
            st.inflight.is_none() && !st.done,
            "session {i}'s turn {} is sent while its previous one is in flight or it is done",
            st.next_turn
        );
        let turn = self.sc.workload.sessions[i]
            .turns
            .get(st.next_turn)
            .expect("a session with no turn left is done before its turn is due");
        let mut prompt = st.history.clone();
        let stream = 100_000 + i as u64;
        let appended = st.appended;
        prompt
            .extend((0..turn.append_tokens as u64).map(|k| self.synth.token(stream, appended + k)));
        let (generate, append) = (turn.generate, turn.append_tokens as u64);
        match self.submit(prompt.clone(), generate, Owner::Session(i))? {
            Ok(id) => {
                let st = &mut self.sessions[i];
                st.appended += append;
                st.history = prompt;
                st.inflight = Some(id);
            }
            Err(Rejection::Invalid { .. }) => {
                // Refused as the runner expected (else `submit` stopped the run).
                probes::hit(SimProbe::SessionReachedContext);
                self.sessions[i].done = true;
            }
            Err(_) => {
                probes::hit(SimProbe::ClientRetried);
                self.sessions[i].wait_until = now + 500_000;
            }
        }
        Ok(())
    }

    /// One-shot requests that are due (those over the limits too: the engine must refuse them),
    /// and refused ones whose retry is due. A client refused by admission control tries again
    /// after a backoff that doubles up to a cap, `ONESHOT_TRIES` times in all.
    fn oneshot_arrivals(&mut self, now: u64) -> Result<(), Stop> {
        while self.next_oneshot < self.oneshots.len() && self.oneshots[self.next_oneshot].0 <= now {
            let index = self.oneshots[self.next_oneshot].1;
            self.next_oneshot += 1;
            if self.defer(Deferred::OneShot { index, tries: 1 }) {
                self.stats.oneshots_deferred += 1;
            } else {
                self.send_oneshot(now, index, 1)?;
            }
        }
        while let Some(&(due, index, tries)) = self.retries.first() {
            if due > now {
                break;
            }
            self.retries.pop_first();
            probes::hit(SimProbe::ClientRetried);
            let tries = tries + 1;
            if self.defer(Deferred::OneShot { index, tries }) {
                self.stats.oneshots_deferred += 1;
            } else {
                self.send_oneshot(now, index, tries)?;
            }
        }
        Ok(())
    }

    fn send_oneshot(&mut self, now: u64, index: usize, tries: u32) -> Result<(), Stop> {
        const ONESHOT_TRIES: u32 = 8;
        const BACKOFF_NS: u64 = 4_000_000;
        const BACKOFF_MAX_NS: u64 = 64_000_000;
        // The doubling is a shift by at most `ONESHOT_TRIES - 2`: it must not wrap.
        const _: () = assert!(BACKOFF_NS.leading_zeros() > ONESHOT_TRIES);
        let o = &self.sc.workload.oneshots[index];
        let synth = self.synth;
        let prompt: Vec<u32> = o
            .segments
            .iter()
            .flat_map(|&(stream, n)| (0..n as u64).map(move |k| synth.token(stream, k)))
            .collect();
        let answer = self.submit(prompt, o.generate, Owner::OneShot)?;
        match answer {
            Err(r) if !matches!(r, Rejection::Invalid { .. }) && tries < ONESHOT_TRIES => {
                let due = now + (BACKOFF_NS << (tries - 1)).min(BACKOFF_MAX_NS);
                self.retries.insert((due, index, tries));
            }
            // Taken, refused as invalid, or refused at its last try: it ends here.
            _ => self.oneshot_ends.end(index),
        }
        Ok(())
    }

    /// Why the engine must refuse a request of `prompt_len` tokens generating `generate`, by its
    /// configuration's limits, written here apart from the engine's own check.
    fn must_refuse(&self, prompt_len: usize, generate: u32) -> Option<&'static str> {
        let (m, s) = (&self.cfg.model, &self.cfg.scheduler);
        if prompt_len == 0 {
            Some("its prompt is empty")
        } else if generate == 0 || generate > s.output_tokens_max {
            Some("it asks for more tokens than scheduler.output_tokens_max")
        } else if prompt_len as u64 + generate as u64 > m.context_tokens_max as u64 {
            Some("it is longer than model.context_tokens_max")
        } else if prompt_len as u64 > s.pending_tokens_max {
            Some("its prompt alone exceeds scheduler.pending_tokens_max")
        } else {
            None
        }
    }

    /// Submits a request; when the engine takes it, tells the oracles its prompt. The engine's
    /// answer must match the limits: a request over them refused as invalid, one within them
    /// never (it may still be refused by admission control). A wrong answer stops the run.
    fn submit(
        &mut self,
        prompt: Vec<u32>,
        generate: u32,
        owner: Owner,
    ) -> Result<Result<u64, Rejection>, Stop> {
        let refuse = self.must_refuse(prompt.len(), generate);
        let (queued, queued_tokens) = self.queued_recount();
        let spec = RequestSpec {
            prompt: prompt.clone(),
            max_new_tokens: generate,
        };
        let answer = self.engine.submit(spec);
        let wrong = match (&answer, refuse) {
            (Ok(id), Some(why)) => Some(format!(
                "request {id} accepted although {why} ({} + {generate} tokens)",
                prompt.len()
            )),
            (Err(Rejection::Invalid { reason }), None) => Some(format!(
                "a request within the limits ({} + {generate} tokens) refused as invalid: {reason}",
                prompt.len()
            )),
            (Err(r), Some(why)) if !matches!(r, Rejection::Invalid { .. }) => Some(format!(
                "a request that can never be served ({why}) refused as temporary: {r}"
            )),
            // Admission control refuses only over its bounds, counted here from the requests
            // the engine holds queued.
            (Err(r @ Rejection::QueueFull { .. }), None)
                if (queued as u64) < self.cfg.scheduler.queued_requests_max as u64 =>
            {
                Some(format!("refused with {queued} requests queued: {r}"))
            }
            (Err(r @ Rejection::PendingTokens { .. }), None)
                if queued_tokens + prompt.len() as u64 <= self.cfg.scheduler.pending_tokens_max =>
            {
                Some(format!(
                    "refused with {queued_tokens} prompt tokens queued, {} new: {r}",
                    prompt.len()
                ))
            }
            _ => None,
        };
        if let Some(message) = wrong {
            self.found(OracleKind::Engine, message);
            return Err(Stop);
        }
        let c = &mut self.counted;
        match &answer {
            Ok(_) => c.submitted += 1,
            Err(Rejection::QueueFull { .. }) => c.rejected_queue_full += 1,
            Err(Rejection::PendingTokens { .. }) => c.rejected_pending_tokens += 1,
            Err(Rejection::Invalid { .. }) => c.rejected_invalid += 1,
        }
        match &answer {
            Ok(id) => {
                self.stats.submitted += 1;
                self.admission_queue.push_back(*id);
                self.owners.insert(*id, owner);
                self.specs.insert(*id, (prompt.len(), generate));
                self.content.borrow_mut().prompt(*id, prompt);
            }
            Err(_) => self.stats.rejected += 1,
        }
        Ok(answer)
    }

    /// The generator of draw `what` in this iteration of the run loop: keyed by both, so whether
    /// one fault happened (or how many draws it took) moves no other draw.
    fn keyed(&self, what: Draw) -> Rng {
        Rng::new(mix64(mix64(self.draw_key ^ what as u64) ^ self.iterations))
    }

    /// Faults stop once the workload is in, or once half the run's step budget is spent (the
    /// liveness phase); until then, aborts mid-load and anywhere, and the operator's requests to
    /// hand back device memory. (The budget's bound: under a fault rate that recreates the
    /// context every few steps, a prompt longer than those steps can compute restarts forever,
    /// and the session behind it never sends its next turn.)
    fn faults(&mut self) -> Result<(), Stop> {
        let arrivals_left = self.next_oneshot < self.oneshots.len()
            || !self.retries.is_empty()
            || !self.deferred.is_empty()
            || self.sessions.iter().any(|s| !s.done);
        let budget_spent = self.stats.steps >= self.sc.steps_max / 2;
        if self.faults_on && (!arrivals_left || budget_spent) {
            probes::hit_if(
                SimProbe::FaultsStoppedWithWork,
                self.engine.queue_len() + self.engine.running_len() > 0,
            );
            self.faults_on = false;
            self.gpu.borrow_mut().stop_faults();
            self.engine.inject(EngineFaults::default());
        }
        if !self.faults_on {
            return Ok(());
        }
        let mut mid_load = self.keyed(Draw::AbortMidLoad);
        if self.sc.abort_mid_load_rate > 0.0 && mid_load.chance(self.sc.abort_mid_load_rate) {
            // Abort mid-load: a request whose load-back is still in flight.
            let loading: Vec<u64> = self
                .owners
                .keys()
                .copied()
                .filter(|id| self.engine.request(*id).is_some_and(|r| r.load().is_some()))
                .collect();
            // Not deferred: this fault is an abort that lands while the load is in flight (a
            // client's abort that lands after the step is `abort_rate`'s).
            if !loading.is_empty() {
                let victim = *mid_load.pick(&loading);
                self.abort(victim)?;
            }
        }
        let mut abort = self.keyed(Draw::Abort);
        if self.sc.abort_rate > 0.0 && !self.owners.is_empty() && abort.chance(self.sc.abort_rate) {
            let ids: Vec<u64> = self.owners.keys().copied().collect();
            let victim = *abort.pick(&ids);
            if !self.defer(Deferred::Abort(victim)) {
                self.abort(victim)?;
            }
        }
        let mut evict = self.keyed(Draw::Evict);
        if self.sc.evict_rate > 0.0 && evict.chance(self.sc.evict_rate) {
            let device_pages = self.engine.intake().pools().device_pages.capacity() as u64;
            // 1..=capacity + 1: one more than the tier holds is a request the engine must take.
            let pages = evict.range(1, device_pages + 1) as usize;
            self.evict(pages)?;
        }
        Ok(())
    }

    /// Calls the engine: its error is a finding of the kind the error names, a panic inside it an
    /// invariant finding. What the GPU saw during the call happened before its result, so its
    /// findings are taken first.
    fn engine_call<T>(
        &mut self,
        what: &str,
        call: impl FnOnce(&mut Target) -> Result<T, EngineError>,
    ) -> Result<T, Stop> {
        let result = guarded(|| call(&mut self.engine));
        self.findings.append(&mut self.gpu.borrow_mut().findings);
        match result {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.found(engine_error_kind(&e), format!("{what}: {e}"));
                Err(Stop)
            }
            Err(p) => {
                self.found(OracleKind::Invariant, p);
                Err(Stop)
            }
        }
    }

    /// The operator's request to hand back `pages` device pages: what the engine says it freed
    /// at once must be what left the device tier.
    fn evict(&mut self, pages: usize) -> Result<(), Stop> {
        let used = |r: &Self| r.engine.intake().pools().device_pages.used_count() as usize;
        let before = used(self);
        let policy_before = self.policy_observe_start();
        let freed =
            self.engine_call(&format!("evict_device({pages})"), |e| e.evict_device(pages))?;
        probes::hit_if(SimProbe::EvictedOnDemand, freed > 0);
        let now = self.gpu.borrow().now();
        if let Some(before) = policy_before {
            let call = policy::Call {
                admitted: &[],
                finished: &[],
                ended: &[],
                tried: &[],
                faulty: false,
                requeued: &[],
                refusals: false,
                hit_growth: None,
                now_ns: now,
                what: format!("evict_device({pages})"),
            };
            self.policy_observe_end(before, call, false);
        }
        if let Some(f) = reported::evicted(pages, freed, before, used(self), now) {
            self.findings.push(f);
        }
        if !self.findings.is_empty() {
            return Err(Stop);
        }
        Ok(())
    }

    fn abort(&mut self, victim: u64) -> Result<(), Stop> {
        match guarded(|| self.engine.abort(victim)) {
            Ok(Ok(_)) => {
                self.admission_queue.retain(|&q| q != victim);
                Ok(())
            }
            Ok(Err(e)) => {
                self.found(engine_error_kind(&e), format!("abort({victim}): {e}"));
                Err(Stop)
            }
            Err(_) => {
                let time_ns = self.gpu.borrow().now();
                self.findings.push(Finding {
                    oracle: OracleKind::Invariant,
                    time_ns,
                    message: "panic in abort".into(),
                });
                Err(Stop)
            }
        }
    }

    /// One engine step, then every output it handed back through the oracles. Returns whether
    /// the engine reported itself idle.
    fn step(&mut self) -> Result<bool, Stop> {
        let queued = tierkv_engine::scheduler::RequestState::Queued;
        let queued_before: Vec<u64> = self
            .owners
            .keys()
            .copied()
            .filter(|&id| (self.engine.intake().request(id)).is_some_and(|r| r.state() == queued))
            .collect();
        let policy_before = self.policy_observe_start();
        let report = self.engine_call("engine step", |e| e.step())?;
        self.stats.steps += 1;
        let asked = std::mem::take(&mut self.gpu.borrow_mut().asked);
        let outputs = self.engine.drain_outputs();
        // A step whose device lost its memory sends the running requests back to the head of
        // the queue, in order, before it admits (`Engine::step`).
        let requeued: Vec<u64> = outputs
            .iter()
            .filter_map(|o| match o {
                Output::Requeued { request } => Some(*request),
                _ => None,
            })
            .collect();
        for &id in requeued.iter().rev() {
            self.running_model.remove(&id);
            self.admission_queue.push_front(id);
            self.requeued.insert(id);
        }
        // Admission is the only way out of the queue within a step (`reported`), in the order
        // the clients submitted (the requeued first).
        let left: Vec<u64> = requeued
            .iter()
            .chain(&queued_before)
            .copied()
            .filter(|&id| (self.engine.intake().request(id)).is_none_or(|r| r.state() != queued))
            .collect();
        let now = self.gpu.borrow().now();
        let found = reported::admitted(report.admitted, left.len(), now)
            .or_else(|| reported::admitted_in_order(&self.admission_queue, &left, now))
            .or_else(|| self.prefill_within_budget(&asked.stored, now))
            .or_else(|| self.stores_within_ownership(&asked.stored_pages, now));
        // In admission order (the queue's, which `admitted_in_order` holds the engine to).
        // A page loaded for one request and published within the step is a device hit of the
        // requests admitted after it: each loaded page counts for the first that holds it.
        let mut unclaimed = asked.loaded;
        let admitted: Vec<policy::Admitted> = self
            .admission_queue
            .iter()
            .filter(|id| left.contains(id))
            .map(|&id| self.admitted_as_seen(id, &asked.stored, &mut unclaimed))
            .collect();
        self.admission_queue.retain(|id| !left.contains(id));
        self.running_model.extend(&left);
        // Admission looks up every full page of the prompt but the last token's.
        for id in &left {
            let page = tierkv_kernels::spec::format::PAGE_TOKENS as u64;
            self.counted.prefix_pages_queried += (self.specs[id].0 as u64 - 1) / page;
        }
        if let Some(f) = found {
            self.findings.push(f);
            return Err(Stop);
        }
        let (mut inserted, mut ended, mut recomputed) = (Vec::new(), Vec::new(), false);
        for o in outputs {
            self.out_hash = mix64(self.out_hash ^ format!("{o:?}").len() as u64 ^ output_key(&o));
            match &o {
                Output::Finished { request, generated } => {
                    inserted.push(self.inserted_as_seen(*request, generated))
                }
                Output::Aborted { request }
                | Output::TransferFailed { request, .. }
                | Output::TransferTimedOut { request, .. } => ended.push(*request),
                Output::Recompute { .. } => recomputed = true,
                _ => {}
            }
            self.output(o);
        }
        if let Some(before) = policy_before {
            let tried = match self.admission_queue.front() {
                Some(&head) => self.prompt_keys(head),
                None => Vec::new(),
            };
            let call = policy::Call {
                admitted: &admitted,
                finished: &inserted,
                ended: &ended,
                tried: &tried,
                faulty: recomputed || !requeued.is_empty(),
                requeued: &requeued,
                refusals: false,
                hit_growth: None,
                now_ns: now,
                what: format!("step {}", self.stats.steps),
            };
            self.policy_observe_end(before, call, true);
        }
        if let Some(f) = self.gauges() {
            self.findings.push(f);
        }
        self.findings.append(&mut self.gpu.borrow_mut().findings);
        if !self.findings.is_empty() {
            return Err(Stop);
        }
        Ok(report.idle)
    }

    fn policy_counters(e: &Eng) -> Counters {
        let m = &e.metrics;
        Counters {
            failures: m.load_failures
                + m.backup_failures
                + m.steps_failed
                + m.steps_discarded
                + m.context_recreations,
            device_hit: m.prefix_pages_device_hit,
            host_hit: m.prefix_pages_host_hit,
        }
    }

    /// The tree and the counters before an engine call, for the policy oracle.
    fn policy_observe_start(&mut self) -> Option<(Snapshot, Counters)> {
        let (Some(model), Target::One(e)) = (self.policy.as_mut(), &self.engine) else {
            return None;
        };
        let snap = model.snapshot(e.cache(), e.pools().host_pages.free_count() as usize);
        Some((snap, Self::policy_counters(e)))
    }

    /// Judges the call that `before` preceded; `step` says whether it was a step (the hit
    /// counters grow only in steps).
    fn policy_observe_end(
        &mut self,
        (before, counters): (Snapshot, Counters),
        mut call: policy::Call,
        step: bool,
    ) {
        let (Some(model), Target::One(e)) = (self.policy.as_mut(), &self.engine) else {
            return;
        };
        let after = model.snapshot(e.cache(), e.pools().host_pages.free_count() as usize);
        let now = Self::policy_counters(e);
        call.faulty |= now.failures != counters.failures;
        call.refusals = self.faults_on && self.sc.host_pages_refused_rate > 0.0;
        if step {
            let grew = |to: u64, from: u64| to.checked_sub(from).expect("a counter went down");
            call.hit_growth = Some((
                grew(now.device_hit, counters.device_hit),
                grew(now.host_hit, counters.host_hit),
            ));
        }
        let found = model.observe(&before, &after, &call);
        self.findings.extend(found);
    }

    /// The chained keys of a request's cacheable prompt pages (all but the last token's).
    fn prompt_keys(&self, id: u64) -> Vec<u64> {
        let page = tierkv_kernels::spec::format::PAGE_TOKENS;
        let prompt_len = self.specs[&id].0;
        let c = self.content.borrow();
        let tokens = &c
            .tokens
            .get(&id)
            .expect("the runner keeps every prompt it sent")[..prompt_len];
        policy::model_page_keys(
            tokens,
            prompt_len.saturating_sub(1) / page,
            c.weights_of(id),
        )
    }

    /// An admitted request as the device saw it: its prompt's page keys, the prompt pages it
    /// took from the cache (its first stored position this step, or where it stands when it
    /// stored none) and how many of those the load stream filled.
    fn admitted_as_seen(
        &self,
        id: u64,
        stored: &[(u64, u32)],
        loaded: &mut Vec<u32>,
    ) -> policy::Admitted {
        let page = tierkv_kernels::spec::format::PAGE_TOKENS;
        let keys = self.prompt_keys(id);
        let first = stored
            .iter()
            .filter(|s| s.0 == id)
            .map(|s| s.1 as usize)
            .min();
        let cached = self.engine.request(id).map(|r| {
            let at = first.unwrap_or(r.computed());
            let pages = at / page;
            let mut filled = 0;
            for p in &r.pages()[..pages.min(r.pages().len())] {
                let before = loaded.len();
                loaded.retain(|&l| l != p.0);
                filled += (loaded.len() < before) as usize;
            }
            (pages, filled)
        });
        policy::Admitted {
            request: id,
            keys,
            cached,
        }
    }

    /// A finished request's full pages (the cache takes every page whose KV it computed: the
    /// last generated token's KV never is).
    fn inserted_as_seen(&self, id: u64, generated: &[u32]) -> policy::Inserted {
        let page = tierkv_kernels::spec::format::PAGE_TOKENS;
        let prompt_len = self.specs[&id].0;
        let c = self.content.borrow();
        let mut tokens = c
            .tokens
            .get(&id)
            .expect("the runner keeps every prompt it sent")[..prompt_len]
            .to_vec();
        tokens.extend_from_slice(generated);
        let full = tokens.len().saturating_sub(1) / page;
        let weights = c.weights_of(id);
        policy::Inserted {
            request: id,
            keys: policy::model_page_keys(&tokens, full, weights),
        }
    }

    /// The queue and running gauges `/metrics` exports, against the runner's counts (one
    /// engine; a pair's engines export their own).
    fn gauges(&self) -> Option<Finding> {
        let Target::One(e) = &self.engine else {
            return None;
        };
        let m = &e.metrics;
        let queued_tokens: u64 = self
            .admission_queue
            .iter()
            .map(|id| self.specs[id].0 as u64)
            .sum();
        reported::gauges(
            [m.queue_depth, m.queued_tokens, m.running_requests],
            [
                self.admission_queue.len() as u64,
                queued_tokens,
                self.running_model.len() as u64,
            ],
            self.gpu.borrow().now(),
        )
    }

    /// Page ownership: every page a step's KV stores wrote belongs to the storing request's own
    /// page table, and to no other running request's (a page another request holds is either
    /// its own or a prefix page the cache shares read-only). Checked against the tables the
    /// requests hold after the step, for one engine (a pair's sides are not followed).
    fn stores_within_ownership(&self, stored: &[(u64, u32)], now: u64) -> Option<Finding> {
        let Target::One(e) = &self.engine else {
            return None;
        };
        let pages: BTreeSet<(u64, u32)> = stored.iter().copied().collect();
        let mut holders: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for &id in &self.running_model {
            if let Some(r) = e.request(id) {
                for p in r.pages() {
                    holders.entry(p.0).or_default().push(id);
                }
            }
        }
        for (request, page) in pages {
            let held = holders.get(&page).map(Vec::as_slice).unwrap_or(&[]);
            let others: Vec<u64> = held.iter().copied().filter(|&h| h != request).collect();
            let own = e
                .request(request)
                .is_none_or(|r| r.pages().iter().any(|p| p.0 == page));
            if !others.is_empty() || !own {
                return Some(Finding {
                    oracle: OracleKind::Conservation,
                    time_ns: now,
                    message: format!(
                        "request {request} stored KV into device page {page}, which {}",
                        if others.is_empty() {
                            "is not in its page table".to_string()
                        } else {
                            format!("request(s) {others:?} hold")
                        }
                    ),
                });
            }
        }
        None
    }

    /// The prompt tokens the step just taken asked the device to store, against the budget.
    fn prefill_within_budget(&self, stored: &[(u64, u32)], now: u64) -> Option<Finding> {
        let prefill: BTreeSet<(u64, u32)> = stored
            .iter()
            .copied()
            .filter(|&(request, position)| {
                self.specs
                    .get(&request)
                    .is_some_and(|&(prompt, _)| (position as usize) < prompt)
            })
            .collect();
        reported::prefill_budget(
            prefill.len() as u64,
            self.cfg.scheduler.prefill_tokens_per_step_max,
            now,
        )
    }

    fn output(&mut self, o: Output) {
        match o {
            Output::Digests {
                request,
                position,
                digests,
            } => self.digests(request, position, digests),
            Output::Token {
                request,
                token,
                index,
            } => {
                self.counted.tokens += 1;
                self.token(request, index, token)
            }
            Output::Finished { request, generated } => {
                self.running_model.remove(&request);
                self.counted.finished += 1;
                self.content.borrow_mut().forget(request);
                self.finished(request, generated)
            }
            Output::Aborted { request } => {
                self.admission_queue.retain(|&q| q != request);
                self.running_model.remove(&request);
                self.counted.aborted += 1;
                self.content.borrow_mut().forget(request);
                self.stats.aborted += 1;
                if let Some(Owner::Session(i)) = self.owners.remove(&request) {
                    self.sessions[i].inflight = None;
                    self.sessions[i].done = true; // the client gave up on the session
                }
            }
            Output::Recompute { .. } => self.stats.recomputed += 1,
            // Back in the queue model already (`step`), before the step's admissions.
            Output::Requeued { .. } => self.stats.requeued += 1,
            Output::TransferFailed { request, .. } | Output::TransferTimedOut { request, .. } => {
                // The pair gave up on moving its KV: the request ended, as an aborted one.
                self.running_model.remove(&request);
                self.counted.aborted += 1;
                self.content.borrow_mut().forget(request);
                self.stats.aborted += 1;
                if let Some(Owner::Session(i)) = self.owners.remove(&request) {
                    self.sessions[i].inflight = None;
                    self.sessions[i].done = true;
                }
            }
        }
    }

    /// A query's digests: none may come from rows that hold garbage (a failed copy's, or memory
    /// a recreated context lost), and each must
    /// equal the oracles' recomputation.
    fn digests(&mut self, request: u64, position: u32, digests: Vec<u64>) {
        let layer_base = self.cfg.model.layer_base;
        let mut c = self.content.borrow_mut();
        if position as usize >= c.confirmed(request) {
            // A query's token is emitted before its digests (an engine running ahead reads it
            // on the device meanwhile): these came from a token the engine never confirmed.
            drop(c);
            self.last_digests.insert(request, digests);
            self.found(
                OracleKind::Digest,
                format!(
                    "request {request} position {position}: digests emitted before the token at that position"
                ),
            );
            return;
        }
        let tainted = (0..digests.len() as u32).any(|l| {
            c.tainted_reads
                .get(&(request, position, layer_base + l))
                .copied()
                .unwrap_or(false)
        });
        let mismatch = self.digest.check(&mut c, request, position, &digests);
        drop(c);
        if tainted {
            self.found(
                OracleKind::Content,
                format!(
                    "request {request} position {position}: the engine emitted digests computed from rows that hold garbage (a failed copy's, or memory a recreated context lost)"
                ),
            );
        }
        self.last_digests.insert(request, digests);
        if let Some(message) = mismatch {
            self.found(OracleKind::Digest, message);
        }
    }

    /// A generated token follows from the digests of its query, and comes in order.
    fn token(&mut self, request: u64, index: u32, token: u32) {
        let (prompt_len, _) = self.specs.get(&request).copied().unwrap_or((0, 0));
        let want = self.last_digests.get(&request).map(|d| {
            let weights = self.content.borrow().weights_of(request);
            self.content.borrow().synth(weights).next_token(d)
        });
        let Some(at) = self.content.borrow_mut().confirm(request, token) else {
            return;
        };
        let have = at - prompt_len;
        if index as usize != have || want != Some(token) {
            self.found(
                OracleKind::Digest,
                format!(
                    "request {request}: token #{index} = {token} does not follow (expected #{have} = {want:?} from its digests)"
                ),
            );
        }
    }

    /// Where the run is, for a person waiting on a long one.
    fn progress_line(&self, wall: std::time::Instant) -> String {
        let s = &self.stats;
        format!(
            "seed {}: {} steps, {} of {} submitted requests finished, {:.1} ms simulated, {:.0} s",
            self.sc.seed,
            s.steps,
            s.finished,
            s.submitted,
            self.gpu.borrow().now() as f64 / 1e6,
            wall.elapsed().as_secs_f64()
        )
    }

    /// A finished request generated exactly the tokens it emitted; its session moves on.
    fn finished(&mut self, request: u64, generated: Vec<u32>) {
        self.stats.finished += 1;
        if let Some(Owner::Session(i)) = self.owners.remove(&request) {
            let now = self.gpu.borrow().now();
            let st = &mut self.sessions[i];
            st.history.extend_from_slice(&generated);
            st.inflight = None;
            st.next_turn += 1;
            st.wait_until = self.sc.workload.sessions[i]
                .turns
                .get(st.next_turn)
                .map(|t| now + t.think_ns)
                .unwrap_or(now);
        }
        let known = {
            let c = self.content.borrow();
            let mut known = c.tokens.get(&request).cloned().unwrap_or_default();
            known.truncate(c.confirmed(request));
            known
        };
        let (prompt_len, max_new) = self.specs.get(&request).copied().unwrap_or((0, 0));
        if known.len() < prompt_len
            || known[prompt_len..] != generated[..]
            || generated.len() != max_new as usize
        {
            self.found(
                OracleKind::Digest,
                format!(
                    "request {request} finished with {} tokens that differ from the {} it emitted (max_new_tokens {max_new})",
                    generated.len(),
                    known.len().saturating_sub(prompt_len)
                ),
            );
        }
    }

    /// The queue recounted: the requests the engine holds queued, and their prompt tokens by
    /// the lengths the clients sent.
    fn queued_recount(&self) -> (usize, u64) {
        let queued = tierkv_engine::scheduler::RequestState::Queued;
        let intake = self.engine.intake();
        self.owners
            .keys()
            .filter(|&&id| intake.request(id).is_some_and(|r| r.state() == queued))
            .fold((0, 0), |(n, t), id| (n + 1, t + self.specs[id].0 as u64))
    }

    /// The distinct loads that the requests the engine holds wait for: each is in flight (an
    /// aborted request's load may be in flight too, so this is a lower bound).
    fn waiting_for_loads(&self, e: &Eng) -> usize {
        let loads: BTreeSet<_> = self
            .owners
            .keys()
            .filter_map(|&id| e.request(id).and_then(|r| r.load()))
            .collect();
        loads.len()
    }

    /// Every bound the engine promises, from what it reports, and the queue's counts against a
    /// recount.
    fn bounds(&mut self) -> Result<(), Stop> {
        let now = self.gpu.borrow().now();
        for (i, e) in self.engine.engines().into_iter().enumerate() {
            // A pair's decode engine takes no intake: every request in its queue came back (the
            // pair does not pass those requeues on), so its queue bounds are the requeued one
            // alone, taken from the engine's own counts.
            let requeued = if i == 0 {
                self.admission_queue
                    .iter()
                    .filter(|id| self.requeued.contains(id))
                    .fold((0, 0), |(n, t), id| (n + 1, t + self.specs[id].0 as u64))
            } else {
                (e.queue_len(), e.queued_tokens())
            };
            let exports_max = match (&self.engine, i) {
                (Target::Pair(_), 0) => e.config().cache.device_pages as u64,
                _ => 0,
            };
            let held = bounds::Held {
                queued: e.queue_len(),
                queued_tokens: e.queued_tokens(),
                running: e.running_len(),
                loads: e.loads_in_flight(),
                requeued,
                exports_max,
            };
            if let Some(f) = bounds::check(e.config(), &held, now) {
                self.findings.push(f);
                return Err(Stop);
            }
            let mut reported =
                reported::loads_in_flight(held.loads, self.waiting_for_loads(e), now);
            if i == 0 {
                let recount = self.queued_recount();
                reported = reported
                    .or_else(|| reported::queue((held.queued, held.queued_tokens), recount, now));
            }
            if let Some(f) = reported {
                self.findings.push(f);
                return Err(Stop);
            }
        }
        Ok(())
    }

    /// The engine's invariants and bounds after every step, and the step budget.
    fn per_step_oracles(&mut self) -> Result<(), Stop> {
        self.bounds()?;
        if let Err(p) = guarded(|| self.engine.check_invariants()) {
            self.found(OracleKind::Invariant, p);
            return Err(Stop);
        }
        let unfinished = self.sessions.iter().filter(|s| !s.done).count();
        if let Some(f) = liveness::within_steps(
            self.stats.steps,
            self.sc.steps_max,
            self.engine.queue_len(),
            self.engine.running_len(),
            unfinished,
            self.gpu.borrow().now(),
        ) {
            let mut f = f;
            if let Target::Pair(p) = &self.engine {
                f.message += &format!(
                    "; the pair holds {}; decode: {} running, {} device pages free",
                    p.stages(),
                    p.decode().running_len(),
                    p.decode().pools().device_pages.free_count()
                );
            }
            self.findings.push(f);
            return Err(Stop);
        }
        Ok(())
    }

    /// The engine is idle: time moves to the next arrival, or the run ends.
    fn advance_idle(&mut self) -> Result<(), Stop> {
        let next_session = self
            .sessions
            .iter()
            .filter(|s| !s.done && s.inflight.is_none())
            .map(|s| s.wait_until)
            .min();
        let next_shot = self.oneshots.get(self.next_oneshot).map(|o| o.0);
        let next_retry = self.retries.first().map(|r| r.0);
        // What the schedule deferred is due at the next step.
        let next_deferred = (!self.deferred.is_empty()).then_some(0);
        match next_session
            .into_iter()
            .chain(next_shot)
            .chain(next_retry)
            .chain(next_deferred)
            .min()
        {
            Some(t) => {
                let at = t.max(self.gpu.borrow().now() + 1);
                // The weights change when the scenario says, if the engine is idle then (it is
                // until `at`), else at the first idle moment after.
                let update = self.sc.weights_update_ns;
                if update > 0 && !self.weights_updated && update <= at {
                    self.gpu.borrow_mut().advance_host_to(update);
                    self.update_weights()?;
                }
                self.gpu.borrow_mut().advance_host_to(at);
                Ok(())
            }
            None => {
                assert!(
                    self.deferred.is_empty(),
                    "a deferred arrival is due at the next step"
                );
                // Nothing is left to arrive: every one-shot was sent and ended.
                self.oneshot_ends.check_all_ended();
                self.stats.arrivals_checked += 1;
                Err(Stop)
            }
        }
    }

    /// The engine's weights change to version 1 (`Scenario::weights_update_ns`); requests
    /// submitted from now on are judged by the new weights' rows.
    fn update_weights(&mut self) -> Result<(), Stop> {
        self.weights_updated = true;
        let Target::One(e) = &mut self.engine else {
            unreachable!("a pair's scenario draws no weight update (validated)");
        };
        if let Err(err) = e.update_weights(1) {
            let now = self.gpu.borrow().now();
            self.findings.push(Finding {
                oracle: OracleKind::Engine,
                time_ns: now,
                message: format!("the idle engine refused a weight update: {err}"),
            });
            return Err(Stop);
        }
        self.content.borrow_mut().set_weights(1);
        Ok(())
    }

    /// The end: the device drains; everything must be returned and every request must have
    /// ended. Then the outcome, with the run's figures.
    /// The run's figures: the simulator's own, the engines' and the oracles' counts.
    fn run_stats(&self, wall: std::time::Instant) -> RunStats {
        let g = self.gpu.borrow().stats;
        let mut stats = self.stats;
        for e in self.engine.engines() {
            let m = &e.metrics;
            stats.loads += m.loads;
            stats.backups += m.backups;
            stats.steps_failed += m.steps_failed;
        }
        stats.ops = g.ops;
        stats.events = g.events;
        stats.copy_bytes = g.copy_bytes;
        stats.failed_copies = g.failed_copies;
        stats.failed_kernels = g.failed_kernels;
        stats.digests_checked = self.digest.digests_checked;
        stats.rows_checked = self.content.borrow().rows_checked;
        stats.rows_cached = self.content.borrow().rows_cached;
        stats.queries_recomputed = self.content.borrow().queries_recomputed;
        if let Some(p) = &self.policy {
            let c = p.counts;
            stats.policy_judged = c.device_evictions + c.host_evictions + c.triggers + c.hit_steps;
        }
        stats.sim_ns = self.gpu.borrow().now();
        stats.wall_ns = wall.elapsed().as_nanos() as u64;
        stats
    }

    fn finish(mut self, wall: std::time::Instant) -> RunOutcome {
        if self.findings.is_empty() {
            let drained = guarded(|| self.gpu.borrow_mut().drain());
            match drained {
                Ok(()) => self.findings.append(&mut self.gpu.borrow_mut().findings),
                Err(p) => self.found(OracleKind::Invariant, p),
            }
        }
        if self.findings.is_empty() {
            let open: Vec<u64> = self.owners.keys().copied().collect();
            let now = self.gpu.borrow().now();
            let found = liveness::all_requests_ended(&open, now)
                .or_else(|| self.engine.check_quiescent(now))
                .or_else(|| {
                    let mut c = self.content.borrow_mut();
                    let g = self.gpu.borrow();
                    self.engine
                        .engines()
                        .into_iter()
                        .enumerate()
                        .find_map(|(i, e)| conservation::audit(e, i, &g.mem, &mut c, now))
                })
                .or_else(|| match &self.engine {
                    Target::One(e) => {
                        let layers = self.cfg.model.layers;
                        let page_bytes = e.layout().transfer_bytes(1).0;
                        let g = self.gpu.borrow();
                        metrics::check(
                            &e.metrics,
                            &g.record_log,
                            &self.counted,
                            layers,
                            page_bytes,
                            now,
                        )
                    }
                    // Not for pairs: the metrics oracle counts one engine's copies and steps.
                    Target::Pair(_) => None,
                });
            if let Some(f) = found {
                self.findings.push(f);
            }
        }
        let stats = self.run_stats(wall);
        let mut gpu = self.gpu.borrow_mut();
        let (first_hits, probes) = take_probes(&self.cfg, self.sc.overlap);
        RunOutcome {
            seed: self.sc.seed,
            findings: self.findings,
            stats,
            log_hash: mix64(gpu.log_hash() ^ self.out_hash),
            trace: {
                let mut t = std::mem::take(&mut gpu.trace.slices);
                t.extend(gpu.unrun_slices());
                t
            },
            marks: std::mem::take(&mut gpu.trace.marks),
            racing_ops: gpu.trace.racing_ops.clone(),
            first_hits,
            probes,
            rerun: false,
            decision_counts: gpu.decision_counts(),
            decisions: gpu.take_schedule(),
            schedule: 0,
            policy: None,
        }
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
            .fold(request ^ ((*position as u64) << 32), |a, d| mix64(a ^ d)),
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
        Output::Requeued { request } => request ^ (1 << 62),
        Output::TransferFailed { request, tries } => request ^ ((*tries as u64) << 44) ^ 0x7D,
        Output::TransferTimedOut { request, tries } => request ^ ((*tries as u64) << 44) ^ 0x7E,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierkv_engine::pd::{handshake, PdLayout, Role};

    /// The arrivals' ledger: one end each passes; a second end, or none, panics.
    #[test]
    fn each_arrival_ends_exactly_once() {
        let mut ends = Ends::new(3);
        for i in [2, 0, 1] {
            ends.end(i);
        }
        ends.check_all_ended();
        let twice = std::panic::catch_unwind(move || {
            let mut ends = Ends::new(2);
            ends.end(1);
            ends.end(1);
        });
        let message = *twice
            .expect_err("a second end panics")
            .downcast::<String>()
            .unwrap();
        assert!(message.contains("arrival 1 ended twice"), "{message}");
        let never = std::panic::catch_unwind(|| {
            let mut ends = Ends::new(3);
            ends.end(1);
            ends.check_all_ended();
        });
        let message = *never
            .expect_err("a missing end panics")
            .downcast::<String>()
            .unwrap();
        assert!(message.contains("arrivals [0, 2] never ended"), "{message}");
    }

    /// Every drawn one-field-off decode configuration differs from its own in that field alone,
    /// as the handshake sees it; and every field is drawn.
    #[test]
    fn one_field_off_differs_in_the_field_it_names() {
        let mut drawn = BTreeSet::new();
        for preset in Config::PRESETS {
            let cfg = Config::preset(preset).expect("a valid preset");
            for seed in 0..64 {
                let Some((off, field)) = one_field_off(&cfg, seed) else {
                    continue;
                };
                drawn.insert(field);
                let refused = handshake(
                    &PdLayout::of(&cfg, Role::Prefill),
                    &PdLayout::of(&off, Role::Decode),
                )
                .map_err(PdError::Handshake);
                assert_eq!(refused_for(refused, field), None, "{preset} seed {seed}");
            }
        }
        assert_eq!(drawn.len(), 6, "{drawn:?}");
        let started = refused_for(Ok(()), "model.layers").expect("a pair that starts is wrong");
        assert!(started.contains("started"), "{started}");
    }
}
