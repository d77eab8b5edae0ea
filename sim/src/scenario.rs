//! A scenario is everything one simulated run needs, as data: the engine configuration, the GPU's
//! timing and fault model, the fault injector's rates, the workload and the limits. A seed draws a
//! scenario (swarm testing: each seed picks its own dtypes, layouts, pool sizes, policies, rates
//! and workload); the shrinker edits scenarios; a scenario file replays exactly.

use crate::gpu::GpuOptions;
use crate::rng::Rng;
use crate::schedule::{Policy, Source};
use serde::{Deserialize, Serialize};
use tierkv_engine::config::{
    CacheConfig, Config, HostCapacity, PrefillIndexer, ScaleFmt, WritePolicy, YarnRule,
};
use tierkv_engine::layout::{HostLayout, IndexKDtype, KvDtype};
use tierkv_engine::mutants::HARDCODED_TOPK;

/// One multi-turn session: a shared system prompt, then turns of user/tool tokens and generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Session {
    pub start_ns: u64,
    /// Which shared system prompt (sessions with the same id share it).
    pub system_id: u64,
    pub system_tokens: u32,
    pub turns: Vec<Turn>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    /// Tool output / user tokens appended before this turn's generation.
    pub append_tokens: u32,
    pub generate: u32,
    /// Client think time before the turn is submitted.
    pub think_ns: u64,
}

/// A one-shot request with its prompt given as token-stream segments.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OneShot {
    pub at_ns: u64,
    /// (stream id, tokens) segments; equal stream ids give equal tokens (shared prefixes).
    pub segments: Vec<(u64, u32)>,
    pub generate: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub sessions: Vec<Session>,
    pub oneshots: Vec<OneShot>,
}

impl Workload {
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum::<usize>() + self.oneshots.len()
    }

    /// Keeps `n` requests: sessions and one-shots in the order they start (a session at its
    /// start time, a one-shot at its arrival; ties to sessions, then to the earlier in each
    /// list), a session with all its turns, or its first turns when fewer remain; drops the
    /// rest. Not the first `n` requests to arrive: a session's later turns arrive as its earlier
    /// ones end, which only a run decides. The kept sessions and one-shots keep their order.
    pub fn keep_first(&mut self, n: usize) {
        /// What starts: a session or a one-shot, by its index in its list.
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
        enum Start {
            Session(usize),
            OneShot(usize),
        }
        let before = self.requests();
        let mut starts: Vec<(u64, Start)> = (self.sessions.iter().enumerate())
            .map(|(i, s)| (s.start_ns, Start::Session(i)))
            .chain((self.oneshots.iter().enumerate()).map(|(i, o)| (o.at_ns, Start::OneShot(i))))
            .collect();
        starts.sort_unstable();
        let mut turns = vec![0usize; self.sessions.len()];
        let mut oneshot = vec![false; self.oneshots.len()];
        let mut left = n;
        for (_, start) in starts {
            if left == 0 {
                break;
            }
            match start {
                Start::Session(i) => {
                    turns[i] = self.sessions[i].turns.len().min(left);
                    left -= turns[i];
                }
                Start::OneShot(i) => {
                    oneshot[i] = true;
                    left -= 1;
                }
            }
        }
        let mut kept = turns.iter();
        self.sessions.retain_mut(|s| {
            let t = *kept.next().expect("one count a session");
            s.turns.truncate(t);
            t > 0
        });
        let mut kept = oneshot.iter();
        self.oneshots
            .retain(|_| *kept.next().expect("one flag a one-shot"));
        debug_assert_eq!(self.requests(), n.min(before));
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuKnobs {
    /// "random_walk" or "pct".
    pub policy: String,
    pub pct_depth: u32,
    pub jitter_ns: u64,
    pub copy_bytes_per_ns: f64,
    pub slow_copy_rate: f64,
    pub failed_copy_rate: f64,
    /// Probability that a page copy is refused at enqueue.
    #[serde(default)]
    pub failed_enqueue_rate: f64,
    /// Probability that a kernel launch fails (the step's work is lost; see `GpuOptions`).
    #[serde(default)]
    pub failed_kernel_rate: f64,
    pub fail_first_host_alloc: bool,
    /// Failed launches and copies leave their stream in error until the engine recovers the
    /// device (`GpuOptions::sticky_faults`).
    #[serde(default)]
    pub sticky_faults: bool,
    /// Probability that a page copy becomes visible in two chunks.
    #[serde(default)]
    pub torn_copy_rate: f64,
    /// A failed op leaves the whole device in error and every call fails until the engine
    /// recovers it (`GpuOptions::context_faults`).
    #[serde(default)]
    pub context_faults: bool,
    /// Probability that a kernel's enqueue is refused with out-of-memory
    /// (`GpuOptions::refused_launch_rate`).
    #[serde(default)]
    pub refused_launch_rate: f64,
    /// Probability that an op hangs until the watchdog gives up on it (`GpuOptions::hang_rate`).
    #[serde(default)]
    pub hang_rate: f64,
    /// Longest delay before the host learns of a completion, ns (0: none).
    #[serde(default)]
    pub completion_delay_ns: u64,
    /// The buffer allocation at the engine's construction that fails, from 1 (0: none).
    #[serde(default, alias = "fail_alloc")]
    pub fail_alloc_nth: u32,
    /// The engine runs on the production runtime over the simulated driver (`driver.rs`), with
    /// staging rings of this many bytes (a multiple of 256, at least 1024); 0: on the simulated
    /// GPU directly. A prefill/decode pair, and a run with `--device cuda`, always run directly.
    #[serde(default)]
    pub runtime_staging_bytes: u64,
    /// The runtime moves pages by one pitched copy per run (`CopyStrategy::MemcpyRuns`)
    /// instead of its gather kernel.
    #[serde(default)]
    pub runtime_copy_runs: bool,
    /// Probability that a call of the simulated driver fails by a fault of its own
    /// (`GpuOptions::driver_fault_rate`); with the runtime only.
    #[serde(default)]
    pub driver_fault_rate: f64,
    /// The runtime times every op and wait of the compute stream with a pair of timing events
    /// (`DrivenDevice::set_timing`, as `tierkv replay --device cuda` does).
    #[serde(default)]
    pub runtime_timing: bool,
    /// The runtime launches the compute stream's kernel ops from CUDA graphs
    /// (`DrivenDevice::set_graphs`, on in production).
    #[serde(default)]
    pub runtime_graphs: bool,
}

impl GpuKnobs {
    /// The policy that draws the scenario's own schedule (PCT's op count unknown: estimated).
    pub fn schedule_policy(&self) -> Policy {
        if self.policy == "pct" {
            Policy::Pct {
                depth: self.pct_depth,
                ops: 0,
            }
        } else {
            Policy::RandomWalk
        }
    }

    pub fn options(&self, trace: bool) -> GpuOptions {
        GpuOptions {
            schedule: Source::Draw {
                index: 0,
                policy: self.schedule_policy(),
            },
            jitter_ns: self.jitter_ns,
            copy_bytes_per_ns: self.copy_bytes_per_ns,
            slow_copy_rate: self.slow_copy_rate,
            failed_copy_rate: self.failed_copy_rate,
            failed_enqueue_rate: self.failed_enqueue_rate,
            failed_kernel_rate: self.failed_kernel_rate,
            fail_first_host_alloc: self.fail_first_host_alloc,
            sticky_faults: self.sticky_faults,
            context_faults: self.context_faults,
            refused_launch_rate: self.refused_launch_rate,
            hang_rate: self.hang_rate,
            torn_copy_rate: self.torn_copy_rate,
            completion_delay_ns: self.completion_delay_ns,
            fail_alloc_nth: self.fail_alloc_nth,
            driver_fault_rate: self.driver_fault_rate,
            trace,
            ..GpuOptions::default()
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub seed: u64,
    pub profile: String,
    /// The engine configuration, as TOML (`Config::from_toml` reads it back).
    pub config: String,
    pub gpu: GpuKnobs,
    /// Probability per engine step that the client aborts one of its in-flight requests.
    pub abort_rate: f64,
    /// Probability per engine step of aborting a request whose load is still in flight.
    #[serde(default)]
    pub abort_mid_load_rate: f64,
    /// Probability that the engine's allocation of device pages is refused as if the tier were
    /// full (`EngineFaults`).
    #[serde(default, alias = "device_pages_refused")]
    pub device_pages_refused_rate: f64,
    /// The same for host pages.
    #[serde(default, alias = "host_pages_refused")]
    pub host_pages_refused_rate: f64,
    /// Probability per engine step that the operator asks the engine to hand back device memory
    /// (`Engine::evict_device` of a random number of pages).
    /// (Left out of the JSON when 0, so that scenarios and schedule files from before it keep
    /// their fingerprints.)
    #[serde(default, skip_serializing_if = "is_zero")]
    pub evict_rate: f64,
    pub workload: Workload,
    /// The engine runs one step ahead (`EngineOptions::overlap`). Not with the `pd` profile.
    /// (Left out of the JSON when false, so that scenarios from before it keep their
    /// fingerprints.)
    #[serde(default, skip_serializing_if = "is_false")]
    pub overlap: bool,
    /// Prefill/decode: the link tells the decode side that a send is over by a message of its
    /// own (`KvLink::notified`), lost with this probability per send. (Left out of the JSON
    /// when 0, so that scenarios from before it keep their fingerprints.)
    #[serde(default, skip_serializing_if = "is_zero")]
    pub notify_loss_rate: f64,
    /// Prefill/decode: the message comes a uniform delay of at most this many ns after the
    /// send's last layer arrived on the decode side. With `notify_loss_rate`, 0 and 0 mean the
    /// link sends no message (the decode side acts on the receive events alone, as before).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub notify_late_ns_max: u64,
    /// The model's weights change (`Engine::update_weights`, to version 1) at this virtual time,
    /// or at the first moment after it that the engine is idle; 0: never. Not under `pd`. (Left
    /// out of the JSON when 0, so that scenarios from before it keep their fingerprints.)
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub weights_update_ns: u64,
    /// Engine steps before the run is declared stuck.
    pub steps_max: u64,
    /// The mutant to switch on (bug zoo), by name.
    pub mutant: Option<String>,
    /// The drawn workload was cut to at most this many requests (`tierkv sim --requests-max`
    /// or `--cut-share`; [`Scenario::keep_requests`]); 0: not cut. Left out of the JSON when 0.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub requests_max: u32,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// Serde's test for a count left out of the JSON when zero (`shard::ShardResult` too).
pub(crate) fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

fn is_false(v: &bool) -> bool {
    !*v
}

/// Why a scenario (a saved file, or any scenario handed to the runner) was refused: the field,
/// its value and the rule it broke.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("`{field}` = {value}: {rule}")]
pub struct ScenarioError {
    pub field: String,
    pub value: String,
    pub rule: String,
}

/// Bounds of a scenario beyond its configuration's: what one simulated run can hold in memory
/// and time (the simulator runs every op on real bytes).
pub mod limits {
    /// Device pools, step scratch and host mirror together, in bytes: 4 GiB, which the
    /// scenarios `drawn_scenarios_are_valid_and_read_back_exactly` (`sim/tests/it/main.rs`)
    /// draws all fit (the production profile's go over 1 GiB, the limit before).
    pub const SIM_MEMORY_BYTES_MAX: u64 = 4 << 30;
    pub const PCT_DEPTH_MAX: u32 = 64;
    pub const JITTER_NS_MAX: u64 = 1_000_000_000;
    pub const COMPLETION_DELAY_NS_MAX: u64 = 1_000_000_000;
    /// The highest `gpu.driver_fault_rate`: the engine repeats a refused call a few times, and
    /// at higher rates all its repeats fail too often (at 0.05, in swarm seed 4).
    pub const DRIVER_FAULT_RATE_MAX: f64 = 0.02;
    /// A simulated staging ring (its bytes are the simulator's memory).
    pub const RUNTIME_STAGING_BYTES_MAX: u64 = 64 << 20;
    pub const COPY_BYTES_PER_NS_MAX: f64 = 1e6;
    /// Arrival times, think times and the like, in virtual ns (about 17 minutes).
    pub const TIME_NS_MAX: u64 = 1 << 40;
    pub const SESSIONS_MAX: usize = 10_000;
    pub const TURNS_MAX: usize = 1_000;
    pub const ONESHOTS_MAX: usize = 100_000;
    pub const SEGMENTS_MAX: usize = 1_000;
    pub const STEPS_MAX: u64 = 10_000_000;
}

fn bad(
    field: impl Into<String>,
    value: impl std::fmt::Display,
    rule: impl Into<String>,
) -> ScenarioError {
    ScenarioError {
        field: field.into(),
        value: value.to_string(),
        rule: rule.into(),
    }
}

fn rate(field: &str, v: f64) -> Result<(), ScenarioError> {
    if v.is_finite() && (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(bad(field, v, "must be a probability in 0..=1"))
    }
}

fn at_most<T: PartialOrd + std::fmt::Display>(
    field: &str,
    v: T,
    max: T,
) -> Result<(), ScenarioError> {
    if v <= max {
        Ok(())
    } else {
        Err(bad(field, &v, format!("must be at most {max}")))
    }
}

/// Engine steps a drawn run of `requests` requests may take before it is declared stuck.
fn steps_max(requests: u64) -> u64 {
    2_000 + 200 * requests
}

impl Scenario {
    /// Cuts the workload to `n` requests in the order its sessions and one-shots start
    /// ([`Workload::keep_first`]; a workload of fewer is kept whole), with the step limit of a
    /// drawn run of that many, and records `n`. Every other draw of the seed (configuration,
    /// faults, schedule policy) is kept. `n` is at least 1 (0 records "not cut").
    pub fn keep_requests(&mut self, n: u32) {
        assert!(n >= 1, "a workload cut to no request");
        self.workload.keep_first(n as usize);
        self.steps_max = steps_max(self.workload.requests() as u64);
        self.requests_max = n;
    }

    /// A rough measure of the work a run of this scenario does, in arbitrary units, for ordering
    /// a campaign's seeds longest first: per layer, every token stored (weighted as about 150
    /// keys scored by one head) and every key each query scores — a query per prompt token under
    /// every-token indexing, one per prompt otherwise, one per generated token. Prefix caching
    /// and faults are not counted; only the order the estimates give matters.
    pub fn work_estimate(&self) -> u64 {
        const STORE: u64 = 150;
        let cfg = self.engine_config();
        let m = &cfg.model;
        let every_token = m.prefill_indexer == PrefillIndexer::EveryToken;
        let query = |ctx: u64| ctx * m.index_n_heads as u64 + m.index_topk as u64;
        let request = |prompt: u64, generate: u64| {
            let prefill = if every_token {
                prompt * query(prompt / 2)
            } else {
                query(prompt)
            };
            STORE * (prompt + generate) + prefill + generate * query(prompt + generate / 2)
        };
        let mut work = 0u64;
        for s in &self.workload.sessions {
            let mut ctx = s.system_tokens as u64;
            for t in &s.turns {
                ctx += t.append_tokens as u64;
                work = work.saturating_add(request(ctx, t.generate as u64));
                ctx += t.generate as u64;
            }
        }
        for o in &self.workload.oneshots {
            let prompt = o.segments.iter().map(|s| s.1 as u64).sum();
            work = work.saturating_add(request(prompt, o.generate as u64));
        }
        work.saturating_mul(m.layers as u64)
    }

    /// A scenario saved before `model.rope_yarn` existed meant DeepSeek's reference rule (YaRN
    /// only above the original length), which the configuration's default no longer is: its
    /// configuration gets that rule written in, so it replays as it ran.
    pub fn keep_yarn_rule_of_its_time(&mut self) {
        let has_key = self
            .config
            .lines()
            .any(|l| l.trim_start().starts_with("rope_yarn"));
        if !has_key {
            self.config = self.config.replacen(
                "[model]\n",
                "[model]\nrope_yarn = \"context_above_original\"\n",
                1,
            );
        }
    }

    pub fn engine_config(&self) -> Config {
        Config::from_toml(&self.config).expect("a scenario carries a valid configuration")
    }

    /// Checks every field: the configuration (and that the run fits the simulator's memory),
    /// the GPU model, the fault rates, the workload against the configuration's limits, the
    /// profile and the mutant's name. The first broken rule is the error.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        if !PROFILES.contains(&self.profile.as_str()) {
            return Err(bad(
                "profile",
                &self.profile,
                format!("is not one of {}", PROFILES.join(", ")),
            ));
        }
        let cfg =
            Config::from_toml(&self.config).map_err(|e| bad("config", "(TOML)", e.to_string()))?;
        // The scratch as the zoo's top-k mutant sizes it, if that is larger: a saved scenario
        // may switch it on.
        let topk = cfg.model.index_topk.max(HARDCODED_TOPK);
        let bytes = cfg
            .footprint(topk)
            .map_err(|e| bad("config", "(TOML)", e.to_string()))?
            .total()
            .0;
        if bytes > limits::SIM_MEMORY_BYTES_MAX {
            return Err(bad(
                "config",
                format!("{bytes} B of pools and scratch"),
                format!(
                    "must fit the simulator's {} B of memory",
                    limits::SIM_MEMORY_BYTES_MAX
                ),
            ));
        }
        self.validate_gpu()?;
        rate("abort_rate", self.abort_rate)?;
        rate("abort_mid_load_rate", self.abort_mid_load_rate)?;
        rate("device_pages_refused_rate", self.device_pages_refused_rate)?;
        rate("host_pages_refused_rate", self.host_pages_refused_rate)?;
        rate("evict_rate", self.evict_rate)?;
        rate("notify_loss_rate", self.notify_loss_rate)?;
        at_most(
            "notify_late_ns_max",
            self.notify_late_ns_max,
            limits::TIME_NS_MAX,
        )?;
        at_most(
            "weights_update_ns",
            self.weights_update_ns,
            limits::TIME_NS_MAX,
        )?;
        if self.weights_update_ns > 0 && self.profile == "pd" {
            return Err(bad(
                "weights_update_ns",
                self.weights_update_ns,
                "a prefill/decode pair's weights are not updated (both engines would have to agree)",
            ));
        }
        if self.profile != "pd" {
            let only_pd = "a link's notifications exist only in a prefill/decode pair (`pd`)";
            if self.notify_loss_rate > 0.0 {
                return Err(bad("notify_loss_rate", self.notify_loss_rate, only_pd));
            }
            if self.notify_late_ns_max > 0 {
                return Err(bad("notify_late_ns_max", self.notify_late_ns_max, only_pd));
            }
        }
        if self.steps_max == 0 {
            return Err(bad("steps_max", 0, "must be at least 1"));
        }
        at_most("steps_max", self.steps_max, limits::STEPS_MAX)?;
        if self.overlap && self.profile == "pd" {
            return Err(bad(
                "overlap",
                true,
                "a prefill/decode pair's engines do not run ahead",
            ));
        }
        let needs_overlap = self
            .mutant
            .as_deref()
            .and_then(tierkv_engine::mutants::Mutant::parse)
            .is_some_and(|m| m.needs_overlap());
        if needs_overlap && !self.overlap {
            return Err(bad(
                "mutant",
                self.mutant.as_deref().unwrap_or_default(),
                "plants a bug of the engine running one step ahead: needs `overlap = true` (not under `pd`)",
            ));
        }
        self.validate_workload(&cfg)?;
        if let Some(m) = &self.mutant {
            let known = tierkv_engine::mutants::Mutant::parse(m).is_some()
                || tierkv_kernels::mutants::KernelMutant::parse(m).is_some();
            if !known {
                return Err(bad("mutant", m, "is not a mutant of the bug zoo"));
            }
        }
        Ok(())
    }

    fn validate_gpu(&self) -> Result<(), ScenarioError> {
        let g = &self.gpu;
        if !["random_walk", "pct"].contains(&g.policy.as_str()) {
            return Err(bad(
                "gpu.policy",
                &g.policy,
                "is not one of random_walk, pct",
            ));
        }
        at_most("gpu.pct_depth", g.pct_depth, limits::PCT_DEPTH_MAX)?;
        at_most("gpu.jitter_ns", g.jitter_ns, limits::JITTER_NS_MAX)?;
        let bw = g.copy_bytes_per_ns;
        if !(bw.is_finite() && bw > 0.0 && bw <= limits::COPY_BYTES_PER_NS_MAX) {
            return Err(bad(
                "gpu.copy_bytes_per_ns",
                bw,
                format!("must be a number in (0, {}]", limits::COPY_BYTES_PER_NS_MAX),
            ));
        }
        rate("gpu.slow_copy_rate", g.slow_copy_rate)?;
        rate("gpu.failed_enqueue_rate", g.failed_enqueue_rate)?;
        rate("gpu.failed_kernel_rate", g.failed_kernel_rate)?;
        rate("gpu.torn_copy_rate", g.torn_copy_rate)?;
        rate("gpu.refused_launch_rate", g.refused_launch_rate)?;
        rate("gpu.hang_rate", g.hang_rate)?;
        at_most(
            "gpu.completion_delay_ns",
            g.completion_delay_ns,
            limits::COMPLETION_DELAY_NS_MAX,
        )?;
        let staging = g.runtime_staging_bytes;
        if staging != 0 && (staging < 1024 || staging % 256 != 0) {
            return Err(bad(
                "gpu.runtime_staging_bytes",
                staging,
                "must be 0 or a multiple of 256 of at least 1024",
            ));
        }
        at_most(
            "gpu.runtime_staging_bytes",
            staging,
            limits::RUNTIME_STAGING_BYTES_MAX,
        )?;
        rate("gpu.driver_fault_rate", g.driver_fault_rate)?;
        if g.driver_fault_rate > limits::DRIVER_FAULT_RATE_MAX {
            return Err(bad(
                "gpu.driver_fault_rate",
                g.driver_fault_rate,
                format!(
                    "must be at most {}: the engine repeats a refused call a few times, and \
                     at higher rates all its repeats fail too often",
                    limits::DRIVER_FAULT_RATE_MAX
                ),
            ));
        }
        // The driver's faults and copy strategy are the runtime's: without it they would do
        // nothing, silently.
        let runtime = [g.runtime_copy_runs, g.runtime_timing, g.runtime_graphs];
        if staging == 0 && (g.driver_fault_rate > 0.0 || runtime.contains(&true)) {
            return Err(bad(
                "gpu.runtime_staging_bytes",
                staging,
                "must not be 0 with gpu.driver_fault_rate > 0, gpu.runtime_copy_runs, \
                 gpu.runtime_timing or gpu.runtime_graphs: they act in the runtime, which a \
                 scenario with 0 does not run",
            ));
        }
        rate("gpu.failed_copy_rate", g.failed_copy_rate)
    }

    /// Sessions and one-shots: counts, times, and token counts a request of this configuration
    /// can have.
    fn validate_workload(&self, cfg: &Config) -> Result<(), ScenarioError> {
        if self.requests_max > 0 && self.workload.requests() > self.requests_max as usize {
            return Err(bad(
                "requests_max",
                self.requests_max,
                format!(
                    "the workload holds {} requests, more than it was cut to",
                    self.workload.requests()
                ),
            ));
        }
        let w = &self.workload;
        let ctx = cfg.model.context_tokens_max;
        // A request may ask for more than the engine serves (the engine must refuse it), but
        // never for more than the context holds.
        let generate = |field: String, g: u32| {
            if (1..=ctx).contains(&g) {
                Ok(())
            } else {
                Err(bad(
                    field,
                    g,
                    format!("must be in 1..={ctx} (model.context_tokens_max)"),
                ))
            }
        };
        at_most("workload.sessions", w.sessions.len(), limits::SESSIONS_MAX)?;
        at_most("workload.oneshots", w.oneshots.len(), limits::ONESHOTS_MAX)?;
        for (i, s) in w.sessions.iter().enumerate() {
            let f = |name: &str| format!("workload.sessions[{i}].{name}");
            at_most(&f("start_ns"), s.start_ns, limits::TIME_NS_MAX)?;
            at_most(&f("system_tokens"), s.system_tokens, ctx)?;
            at_most(&f("turns"), s.turns.len(), limits::TURNS_MAX)?;
            for (j, t) in s.turns.iter().enumerate() {
                let f = |name: &str| format!("workload.sessions[{i}].turns[{j}].{name}");
                at_most(&f("append_tokens"), t.append_tokens, ctx)?;
                at_most(&f("think_ns"), t.think_ns, limits::TIME_NS_MAX)?;
                generate(f("generate"), t.generate)?;
            }
        }
        for (i, o) in w.oneshots.iter().enumerate() {
            let f = |name: &str| format!("workload.oneshots[{i}].{name}");
            at_most(&f("at_ns"), o.at_ns, limits::TIME_NS_MAX)?;
            at_most(&f("segments"), o.segments.len(), limits::SEGMENTS_MAX)?;
            let tokens: u64 = o.segments.iter().map(|s| s.1 as u64).sum();
            at_most(&f("segments (tokens)"), tokens, ctx as u64)?;
            generate(f("generate"), o.generate)?;
        }
        Ok(())
    }

    /// The scenario's fingerprint, which a schedule file carries: a hash of its JSON with the
    /// mutant left out (the mutant changes the engine under test, not the scenario, and
    /// `--mutant` may replace it on a replay).
    pub fn fingerprint(&self) -> u64 {
        let mut plain = self.clone();
        plain.mutant = None;
        let json = serde_json::to_string(&plain).expect("a scenario serialises");
        json.bytes().fold(0x7363_6865_6475_6C65, |h, b| {
            tierkv_kernels::cpu::numerics::mix64(h ^ b as u64)
        })
    }

    /// What the summary adds to a cut workload's request count.
    fn cut_note(&self) -> String {
        match self.requests_max {
            0 => String::new(),
            n => format!(" (cut to at most {n})"),
        }
    }

    /// One line describing the drawn configuration.
    pub fn summary(&self) -> String {
        let c = self.engine_config();
        let m = &c.model;
        format!(
            "profile {} | layers {} (base {}) heads {} topk {} | index-K {} KV {}{} | device {} pages, host {} pages {} | {} | load slots {} | running {} prefill {} {} | gpu {}{} slow {:.2} fail {:.3} enqueue-fail {:.3} kernel-fail {:.3} sticky {} context-wide {} launch-refused {:.3} hang {:.4} torn {:.2} callback-delay ≤{} ns fail-alloc #{} | {} | page-refusals device {:.2} host {:.2} | aborts {:.3} mid-load {:.2} | evictions {:.3} | {}{}{} | {} sessions, {} one-shots, {} requests{}",
            self.profile,
            m.layers,
            m.layer_base,
            m.index_n_heads,
            m.index_topk,
            m.index_k_dtype.name(),
            m.kv_dtype.name(),
            if m.scale_fmt.ue8m0() { " ue8m0" } else { "" },
            c.cache.device_pages,
            c.host_pages(),
            c.cache.host_layout.name(),
            c.cache.write_policy.name(),
            c.cache.load_slots,
            c.scheduler.running_requests_max,
            c.scheduler.prefill_tokens_per_step_max,
            m.prefill_indexer.name(),
            self.gpu.policy,
            if self.gpu.policy == "pct" { format!(" d={}", self.gpu.pct_depth) } else { String::new() },
            self.gpu.slow_copy_rate,
            self.gpu.failed_copy_rate,
            self.gpu.failed_enqueue_rate,
            self.gpu.failed_kernel_rate,
            if self.gpu.sticky_faults { "on" } else { "off" },
            if self.gpu.context_faults { "on" } else { "off" },
            self.gpu.refused_launch_rate,
            self.gpu.hang_rate,
            self.gpu.torn_copy_rate,
            self.gpu.completion_delay_ns,
            self.gpu.fail_alloc_nth,
            match self.gpu.runtime_staging_bytes {
                0 => "device direct".to_string(),
                b => format!(
                    "runtime staging {b} B, {}, driver-fail {}{}{}",
                    if self.gpu.runtime_copy_runs { "copy per run" } else { "gather" },
                    self.gpu.driver_fault_rate,
                    if self.gpu.runtime_timing { ", timed" } else { "" },
                    if self.gpu.runtime_graphs { ", graphs" } else { "" }
                ),
            },
            self.device_pages_refused_rate,
            self.host_pages_refused_rate,
            self.abort_rate,
            self.abort_mid_load_rate,
            self.evict_rate,
            if self.overlap { "one step ahead" } else { "in order" },
            match self.weights_update_ns {
                0 => String::new(),
                t => format!(" | weights update at {:.3} ms if idle then, or later", t as f64 / 1e6),
            },
            if self.notify_loss_rate > 0.0 || self.notify_late_ns_max > 0 {
                format!(
                    " | notifications lost {:.2}, late ≤{} ns",
                    self.notify_loss_rate, self.notify_late_ns_max
                )
            } else {
                String::new()
            },
            self.workload.sessions.len(),
            self.workload.oneshots.len(),
            self.workload.requests(),
            self.cut_note(),
        )
    }
}

/// The profiles `tierkv sim --profile` accepts.
pub const PROFILES: &[&str] = &[
    "swarm",
    "sessions",
    "needle",
    "trace",
    "quick",
    "production",
    "pd",
];

/// Whether the scenario of `seed` under `profile` runs the engine one step ahead, as [`draw`]
/// draws it (without drawing the rest).
pub fn draws_overlap(seed: u64, profile: &str) -> bool {
    let mut rng = Rng::new(seed);
    for purpose in 1..=4 {
        rng.fork(purpose);
    }
    profile != "pd" && rng.fork(5).chance(0.5)
}

/// The most requests a seed cut by `--cut-share` keeps.
pub const CUT_REQUESTS_MAX: u32 = 8;

/// What `--cut-share share` cuts seed `seed`'s workload to: for a share `share` of the seeds,
/// drawn from a stream of the seed's own apart from every draw of its scenario, 1 to
/// [`CUT_REQUESTS_MAX`] requests ([`Scenario::keep_requests`]); `None`: the seed runs whole.
pub fn drawn_cut(seed: u64, share: f64) -> Option<u32> {
    let mut r = Rng::new(seed).fork(9);
    r.chance(share)
        .then(|| r.range(1, CUT_REQUESTS_MAX as u64) as u32)
}

/// 0 with probability `zero`, else uniform in `[lo, lo + span)`.
fn rate_or_zero(r: &mut Rng, zero: f64, lo: f64, span: f64) -> f64 {
    if r.chance(zero) {
        0.0
    } else {
        lo + r.unit() * span
    }
}

/// Draws the scenario of `seed` under `profile`. `trace` is a Mooncake trace for the trace
/// profile, which must have passed [`check_trace`] (a trace that did not panics here: its
/// arrival times would wrap).
pub fn draw(
    seed: u64,
    profile: &str,
    trace: Option<&[tierkv_engine::trace::TraceRecord]>,
) -> Scenario {
    let mut rng = Rng::new(seed);
    let mut cr = rng.fork(1);
    let mut gr = rng.fork(2);
    let mut wr = rng.fork(3);
    let cfg = draw_config(&mut cr, seed, profile);
    let mut gpu = draw_gpu(&mut gr);
    let abort_rate = rate_or_zero(&mut gr, 0.6, 0.01, 0.05);
    let abort_mid_load_rate = rate_or_zero(&mut gr, 0.35, 0.3, 0.6);
    let device_pages_refused_rate = rate_or_zero(&mut gr, 0.75, 0.01, 0.09);
    let host_pages_refused_rate = rate_or_zero(&mut gr, 0.75, 0.02, 0.3);
    // Drawn from a stream of its own, so that adding it left every other draw as it was.
    let mut er = rng.fork(4);
    let evict_rate = rate_or_zero(&mut er, 0.8, 0.02, 0.1);
    // Its own stream too: every seed drew the same scenario as before, but for this.
    let overlap = profile != "pd" && rng.fork(5).chance(0.5);
    debug_assert_eq!(overlap, draws_overlap(seed, profile));
    draw_runtime(&mut rng.fork(6), &mut gpu);
    // The pair's link notifications: a stream of their own, forked last (every other draw is
    // as it was); half the pd seeds model them, some lost and some later than the decode
    // side's deadline (`pd::NOTIFICATION_DEADLINE_NS`, 10 ms).
    let mut nr = rng.fork(7);
    let (notify_loss_rate, notify_late_ns_max) = if profile == "pd" && nr.chance(0.5) {
        (
            *nr.pick(&[0.0, 0.02, 0.1]),
            *nr.pick(&[0, 20_000, 2_000_000, 15_000_000]),
        )
    } else {
        (0.0, 0)
    };
    let workload = draw_workload(&mut wr, profile, &cfg, trace);
    let requests = workload.requests() as u64;
    // A weight update mid-run: a stream of its own, forked last; three seeds in ten but pairs,
    // at a time among the arrivals' (the last session's start or one-shot's arrival).
    let mut ur = rng.fork(8);
    let last_arrival = workload
        .sessions
        .iter()
        .map(|s| s.start_ns)
        .chain(workload.oneshots.iter().map(|o| o.at_ns))
        .max()
        .unwrap_or(0);
    let weights_update_ns = if profile != "pd" && ur.chance(0.3) {
        1 + ur.below(last_arrival.max(1))
    } else {
        0
    };
    let sc = Scenario {
        seed,
        profile: profile.to_string(),
        config: cfg.to_toml(),
        gpu,
        abort_rate,
        abort_mid_load_rate,
        device_pages_refused_rate,
        host_pages_refused_rate,
        evict_rate,
        workload,
        overlap,
        notify_loss_rate,
        notify_late_ns_max,
        weights_update_ns,
        steps_max: steps_max(requests),
        mutant: None,
        requests_max: 0,
    };
    // Every draw is a scenario a file could hold.
    debug_assert_eq!(
        sc.validate(),
        Ok(()),
        "seed {seed} drew an invalid scenario"
    );
    sc
}

/// A context limit: 1024 (the sim-small preset's), or a size at a page boundary (a multiple of
/// 64, one below or one above), up to 2K or, for one seed in four, up to 8K.
fn draw_context(cr: &mut Rng) -> u32 {
    let u = cr.unit();
    if u < 0.4 {
        return 1024;
    }
    let pages = if u < 0.75 {
        cr.range(3, 32)
    } else {
        cr.range(33, 128)
    };
    (pages * 64) as u32 + *cr.pick(&[0u32, 0, 1]) - *cr.pick(&[0u32, 0, 1])
}

/// The engine configuration: dtypes, layouts, the layer range, pools sized to the context,
/// policies and the scheduler's bounds.
fn draw_config(cr: &mut Rng, seed: u64, profile: &str) -> Config {
    if profile == "production" {
        return draw_production_config(cr, seed);
    }
    let quick = profile == "quick";
    let mut cfg = Config::preset("sim-small").expect("preset");
    cfg.name = format!("swarm-{seed}");
    let m = &mut cfg.model;
    m.layers = *cr.pick(&[1, 2, 2, 3, 4]);
    if profile == "pd" {
        // A transfer that lands a layer on the wrong one needs two to show.
        m.layers = m.layers.max(2);
    }
    m.layer_base = if cr.chance(0.3) {
        cr.range(1, 60) as u32
    } else {
        0
    };
    m.index_n_heads = cr.range(1, if quick { 2 } else { 4 }) as u32;
    (m.index_k_dtype, m.kv_dtype) = draw_dtypes(cr, 0.5);
    m.scale_fmt = if cr.chance(0.2) {
        ScaleFmt::Ue8m0
    } else {
        ScaleFmt::Fp32
    };
    m.index_topk = *cr.pick(&[4, 16, 32, 48, 64, 100, 200]);
    m.context_tokens_max = if profile == "swarm" {
        draw_context(cr)
    } else {
        1024
    };
    m.prefill_indexer = if cr.chance(0.15) {
        PrefillIndexer::EveryToken
    } else {
        PrefillIndexer::LastToken
    };
    let ctx = m.context_tokens_max;
    let c = &mut cfg.cache;
    // The device tier holds at least one request of the longest context.
    let pages_per_request = ctx.div_ceil(64) as u64;
    c.device_pages = (cr.range(17, 40) as u32).max((pages_per_request + cr.range(1, 12)) as u32);
    let ratio = if cr.chance(0.4) {
        1.05 + cr.unit() * 0.25 // a host tier barely larger than the device: always full
    } else {
        1.3 + cr.unit() * 2.7
    };
    // At least one whole host page more than the device tier holds (the configuration refuses
    // less); a ratio that already gives one is kept as drawn.
    let dp = c.device_pages as f64;
    c.host = HostCapacity::Ratio(ratio.max((dp + 1.5) / dp));
    draw_cache_policies(cr, c);
    draw_scheduler(cr, &mut cfg);
    // Drawn last, so that adding it left every other draw as it was: 30% of the seeds (of every
    // profile but `production`, whose presets keep the default) follow DeepSeek's reference
    // rule, under which contexts within 4096 tokens get plain RoPE.
    if cr.chance(0.3) {
        cfg.model.rope_yarn = YarnRule::ContextAboveOriginal;
    }
    cfg
}

/// The scheduler's limits, from the model and cache already drawn.
fn draw_scheduler(cr: &mut Rng, cfg: &mut Config) {
    let ctx = cfg.model.context_tokens_max;
    let s = &mut cfg.scheduler;
    s.queued_requests_max = cr.range(8, 64) as u32;
    // Half the seeds have a pending-token bound a few contexts deep, which bursts go over; one in
    // six one below the context, so that a prompt can be refused for it alone (and one of
    // exactly the bound must not be).
    let out_max = *cr.pick(&[8, 16, 32, 32, 64]);
    let u = cr.unit();
    s.pending_tokens_max = if u < 0.5 {
        64 * 1024
    } else if u < 5.0 / 6.0 || ctx < 2 * (out_max + 1) {
        cr.range(ctx as u64, 4 * ctx as u64)
    } else {
        cr.range((ctx / 2) as u64, (ctx - out_max - 1) as u64)
    };
    s.running_requests_max = cr.range(2, 8) as u32;
    s.prefill_tokens_per_step_max = if cfg.model.prefill_indexer == PrefillIndexer::EveryToken {
        cr.range(32, 96) as u32
    } else {
        *cr.pick(&[64, 128, 256, 512])
    };
    s.output_tokens_max = out_max;
}

/// The host mirror's order, the write policy and the load ring's slots.
fn draw_cache_policies(cr: &mut Rng, c: &mut CacheConfig) {
    c.host_layout = if cr.chance(0.5) {
        HostLayout::LayerFirst
    } else {
        HostLayout::PageFirst
    };
    c.write_policy = *cr.pick(&WritePolicy::ALL);
    c.load_slots = cr.range(1, 3) as u32;
}

/// The index-K and KV dtypes, each fp8 with probability `fp8`.
fn draw_dtypes(cr: &mut Rng, fp8: f64) -> (IndexKDtype, KvDtype) {
    let index_k = if cr.chance(fp8) {
        IndexKDtype::Fp8
    } else {
        IndexKDtype::Bf16
    };
    let kv = if cr.chance(fp8) {
        KvDtype::Fp8Packed
    } else {
        KvDtype::Bf16
    };
    (index_k, kv)
}

/// The production model's shapes (DeepSeek-V3.2: 64 indexer heads of 128, `index_topk` 2048, 61
/// layers, contexts up to 128K tokens) at a rate the CPU can afford: one or two layers of the 61
/// (a layer range anywhere in the model), long contexts drawn mostly short of the maximum,
/// production's dtypes most of the time, a device tier that holds a request or two.
fn draw_production_config(cr: &mut Rng, seed: u64) -> Config {
    let mut cfg = Config::preset("deepseek-v3.2").expect("preset");
    cfg.name = format!("production-{seed}");
    let m = &mut cfg.model;
    m.layers = cr.range(1, 2) as u32;
    m.layer_base = cr.range(0, 61 - m.layers as u64) as u32;
    m.context_tokens_max = *cr.pick(&[16_384, 16_384, 32_768, 32_768, 65_536, 131_072]);
    (m.index_k_dtype, m.kv_dtype) = draw_dtypes(cr, 0.7);
    m.scale_fmt = if cr.chance(0.3) {
        ScaleFmt::Ue8m0
    } else {
        ScaleFmt::Fp32
    };
    // A query per prefill chunk: every-token indexing would cost a query per prompt token.
    m.prefill_indexer = PrefillIndexer::LastToken;
    let pages_per_request = m.context_tokens_max.div_ceil(64);
    let c = &mut cfg.cache;
    // One request of the longest context and a part of another: the third prompt evicts.
    c.device_pages = pages_per_request + cr.range(8, pages_per_request as u64 / 2) as u32;
    c.host = HostCapacity::Ratio(1.5 + cr.unit() * 1.5);
    draw_cache_policies(cr, c);
    let s = &mut cfg.scheduler;
    s.queued_requests_max = 8;
    s.pending_tokens_max = 4 * m.context_tokens_max as u64;
    s.running_requests_max = 2;
    s.prefill_tokens_per_step_max = *cr.pick(&[8_192, 16_384]);
    s.output_tokens_max = 4;
    cfg
}

/// Production shapes' workload: two long prompts sharing a long prefix (a system prompt and
/// documents), then one with a prefix of its own that makes the device tier evict the first,
/// then the first again: its prefix is on the host only by then, and is loaded back.
fn production_workload(r: &mut Rng, s: &Shape) -> Workload {
    let room = s.ctx - s.output_max;
    let prefix = (r.range(room as u64 / 3, room as u64 * 2 / 3) as u32 / 64) * 64;
    let own = |r: &mut Rng| r.range(64, (room - prefix) as u64) as u32;
    let gap = r.range(1_000_000, 20_000_000);
    let generate = |r: &mut Rng| r.range(1, s.output_max as u64) as u32;
    let mut oneshots = Vec::new();
    for (i, stream) in [(0u64, 7_700_000u64), (1, 7_700_000), (2, 7_700_001)] {
        oneshots.push(OneShot {
            at_ns: i * gap,
            segments: vec![(stream, prefix), (7_700_100 + i, own(r))],
            generate: generate(r),
        });
    }
    oneshots.push(OneShot {
        at_ns: 200_000_000 + r.below(100_000_000),
        segments: oneshots[0].segments.clone(),
        generate: 1,
    });
    Workload {
        sessions: Vec::new(),
        oneshots,
    }
}

/// The simulated GPU: scheduling policy, timing, and copy faults.
fn draw_gpu(gr: &mut Rng) -> GpuKnobs {
    let pct = gr.chance(0.4);
    GpuKnobs {
        policy: ["random_walk", "pct"][pct as usize].into(),
        pct_depth: gr.range(1, 4) as u32,
        jitter_ns: gr.range(2_000, 60_000),
        copy_bytes_per_ns: *gr.pick(&[5.0, 12.0, 25.0, 50.0]),
        slow_copy_rate: if gr.chance(0.5) {
            0.0
        } else {
            0.02 + gr.unit() * 0.18
        },
        failed_copy_rate: if gr.chance(0.6) {
            0.0
        } else {
            0.005 + gr.unit() * 0.045
        },
        failed_enqueue_rate: if gr.chance(0.6) {
            0.0
        } else {
            0.02 + gr.unit() * 0.08
        },
        fail_first_host_alloc: gr.chance(0.1),
        failed_kernel_rate: if gr.chance(0.7) {
            0.0
        } else {
            0.002 + gr.unit() * 0.018
        },
        sticky_faults: gr.chance(0.5),
        torn_copy_rate: if gr.chance(0.7) {
            0.0
        } else {
            0.05 + gr.unit() * 0.25
        },
        completion_delay_ns: if gr.chance(0.5) {
            0
        } else {
            gr.range(1_000, 200_000)
        },
        // The engine allocates its pool buffers, the host mirror, then the step scratch.
        fail_alloc_nth: if gr.chance(0.9) {
            0
        } else {
            gr.range(1, 8) as u32
        },
        // CUDA's own fault model: a fault leaves the whole side in error in most seeds; refused
        // launches and hangs in some.
        context_faults: gr.chance(0.6),
        refused_launch_rate: if gr.chance(0.75) {
            0.0
        } else {
            0.002 + gr.unit() * 0.018
        },
        hang_rate: if gr.chance(0.85) {
            0.0
        } else {
            0.0002 + gr.unit() * 0.0008
        },
        // Small rings, so that they wrap within a run and large arguments go pageable.
        runtime_staging_bytes: *gr.pick(&[1024, 4096, 16384, 65536]),
        // Drawn in `draw_runtime`, from a stream of their own.
        runtime_copy_runs: false,
        driver_fault_rate: 0.0,
        runtime_timing: false,
        runtime_graphs: false,
    }
}

/// The runtime's knobs: its copy strategy, the driver's own faults, timing and graphs. A
/// stream of their own (`rng.fork(6)`), forked after every other, so that adding them left every
/// other draw as it was; graphs drawn last, so the others are as they were before them.
fn draw_runtime(dr: &mut Rng, gpu: &mut GpuKnobs) {
    gpu.runtime_copy_runs = dr.chance(0.25);
    gpu.driver_fault_rate = if dr.chance(0.4) {
        0.0
    } else {
        *dr.pick(&[0.0005, 0.002, 0.01])
    };
    gpu.runtime_timing = dr.chance(0.25);
    gpu.runtime_graphs = dr.chance(0.5);
}

/// The workload of `profile` for the configuration `cfg`.
fn draw_workload(
    wr: &mut Rng,
    profile: &str,
    cfg: &Config,
    trace: Option<&[tierkv_engine::trace::TraceRecord]>,
) -> Workload {
    let shape = Shape::of(cfg);
    match profile {
        "needle" => needle_workload(wr, &shape),
        "trace" => match trace {
            Some(t) => trace_workload(wr, t),
            None => sessions_workload(wr, 60, 80, false, &shape),
        },
        "sessions" => sessions_workload(wr, 60, 80, false, &shape),
        "quick" => sessions_workload(wr, 2, 6, false, &shape),
        "production" => production_workload(wr, &shape),
        _ => {
            let mut w = if wr.chance(0.15) {
                needle_workload(wr, &shape)
            } else {
                let burst = wr.chance(0.3);
                let hi = if wr.chance(0.1) { 64 } else { 24 };
                sessions_workload(wr, 6, hi, burst, &shape)
            };
            add_production_shapes(wr, &mut w, &shape);
            add_revisits(wr, &mut w, &shape);
            w
        }
    }
}

/// The limits a workload is drawn against.
struct Shape {
    ctx: u32,
    output_max: u32,
    pending_max: u64,
    device_pages: u32,
    every_token: bool,
    prefill_budget: u32,
}

impl Shape {
    fn of(cfg: &Config) -> Shape {
        Shape {
            ctx: cfg.model.context_tokens_max,
            output_max: cfg.scheduler.output_tokens_max,
            pending_max: cfg.scheduler.pending_tokens_max,
            device_pages: cfg.cache.device_pages,
            every_token: cfg.model.prefill_indexer == PrefillIndexer::EveryToken,
            prefill_budget: cfg.scheduler.prefill_tokens_per_step_max,
        }
    }
    /// Tokens to generate: mostly a few, sometimes exactly the limit.
    fn generate(&self, r: &mut Rng) -> u32 {
        if r.chance(0.1) {
            self.output_max
        } else {
            r.range(2, 10).min(self.output_max as u64) as u32
        }
    }
}

/// What production sends and a plain swarm rarely makes: requests that fill the context to the
/// token, identical prompts repeated (retries, "regenerate", batch duplicates) ending on a page
/// boundary or one token past it, bursts of long prompts against the pending-token bound, and
/// requests over the limits, which the engine must refuse.
fn add_production_shapes(r: &mut Rng, w: &mut Workload, s: &Shape) {
    let ctx = s.ctx;
    let mut stream = 7_000_000 + r.below(1_000) * 100;
    let mut next_stream = || {
        stream += 1;
        stream
    };
    if r.chance(0.3) {
        // Exactly the context: prompt + generation = context_tokens_max.
        for _ in 0..r.range(1, 2) {
            let generate = s.generate(r).min(ctx - 1);
            w.oneshots.push(OneShot {
                at_ns: r.below(4_000_000),
                segments: vec![(next_stream(), ctx - generate)],
                generate,
            });
        }
    }
    if r.chance(0.5) {
        // The same prompt again and again: 64k tokens, or 64k + 1; at once and spread out.
        let pages = r.range(1, ((ctx - s.output_max) / 64).clamp(1, 12) as u64) as u32;
        let len = pages * 64 + *r.pick(&[0u32, 1]);
        let len = len.min(ctx - s.output_max);
        let segments = vec![(next_stream(), len)];
        let at = r.below(2_000_000);
        for k in 0..r.range(2, 5) {
            let spread = if r.chance(0.5) { 0 } else { k * 1_500_000 };
            w.oneshots.push(OneShot {
                at_ns: at + spread,
                segments: segments.clone(),
                generate: s.generate(r),
            });
        }
    }
    if r.chance(0.3) {
        // A burst of long prompts at once, against the pending-token bound.
        let at = r.range(200_000, 3_000_000);
        let each = (ctx / 2).max(1);
        let n = (s.pending_max / each as u64 + 2).min(24);
        for _ in 0..n {
            w.oneshots.push(OneShot {
                at_ns: at,
                segments: vec![(next_stream(), each.min(ctx - s.output_max))],
                generate: s.generate(r),
            });
        }
    }
    if s.pending_max + (s.output_max as u64) < ctx as u64 && r.chance(0.8) {
        // Prompts at the pending-token bound: exactly on it (valid), one over (never valid).
        for extra in [0, 1] {
            w.oneshots.push(OneShot {
                at_ns: r.below(4_000_000),
                segments: vec![(next_stream(), s.pending_max as u32 + extra)],
                generate: 1,
            });
        }
    }
    if r.chance(0.2) {
        // Over the limits: one token past the context, or more tokens than may be generated.
        w.oneshots.push(OneShot {
            at_ns: r.below(3_000_000),
            segments: vec![(next_stream(), ctx - s.output_max + 1)],
            generate: s.output_max,
        });
        w.oneshots.push(OneShot {
            at_ns: r.below(3_000_000),
            segments: vec![(next_stream(), 16)],
            generate: s.output_max + 1,
        });
    }
}

/// Prompts revisited after the device tier has forgotten them, so that they are loaded back: a
/// small set of prefixes sent three times while it fits on the device (write-through backs each up at
/// once, the selective policy on the second hit, and a round may be refused), then a flood of other prefixes that fills the
/// device tier (write-back backs the set up as it is evicted), then each of the set alone and the
/// set once more, found on the host only. Every phase far apart from the next: a phase that meets a queue full of long
/// prompts is refused until it drains (the runner's clients retry). Prompts are shorter under
/// every-token indexing, which costs a query per prefill token.
fn add_revisits(r: &mut Rng, w: &mut Workload, s: &Shape) {
    if !r.chance(0.8) {
        return;
    }
    // Each prompt is a prefix of whole pages and 8 tokens of its own, so it is never all cached.
    let fit = ((s.ctx - s.output_max).saturating_sub(8) / 64).max(1);
    let cap = if s.every_token { 3 } else { 12 };
    let pages = (s.device_pages / 8).clamp(1, fit.min(cap));
    let set = (s.device_pages / 2 / pages).clamp(1, 4);
    let flood = (s.device_pages / pages + 2).min(if s.every_token { 8 } else { 16 });
    let base = 6_000_000 + r.below(1_000) * 100;
    let gap = r.range(100_000, 400_000);
    let mut at = r.below(2_000_000);
    let phase = |w: &mut Workload, r: &mut Rng, at: &mut u64, first: u32, n: u32, own: u64| {
        for i in 0..n as u64 {
            w.oneshots.push(OneShot {
                at_ns: *at + i * gap,
                segments: vec![(base + first as u64 + i, pages * 64), (own + i, 8)],
                generate: 2.min(s.output_max),
            });
        }
        *at += gap * n as u64 + r.range(20_000_000, 100_000_000);
    };
    phase(w, r, &mut at, 0, set, base + 50);
    phase(w, r, &mut at, 0, set, base + 60);
    phase(w, r, &mut at, 0, set, base + 65);
    phase(w, r, &mut at, 10, flood, base + 70);
    // Each of the set alone, found on the host only, behind a fresh prompt of exactly the
    // step's prefill budget: admitted with the prompt, the revisit waits a step for budget
    // while its load is in flight (the window of an abort mid-load), and the prompt is done in
    // that step — an aborted load that outlives it is all the next step has to wait for.
    let straggler = s.prefill_budget.min(s.ctx - s.output_max);
    for k in 0..set {
        w.oneshots.push(OneShot {
            at_ns: at,
            segments: vec![(base + 40 + k as u64, straggler)],
            generate: 1,
        });
        phase(w, r, &mut at, k, 1, base + 30 + k as u64);
    }
    phase(w, r, &mut at, 0, set, base + 90);
}

/// Multi-turn tool-call sessions sharing a system prompt; optionally a burst of one-shots.
fn sessions_workload(r: &mut Rng, lo: u64, hi: u64, burst: bool, s: &Shape) -> Workload {
    let n = r.range(lo, hi);
    let systems = r.range(1, 2);
    let system_tokens: Vec<u32> = (0..systems)
        .map(|_| (r.range(64, 320) as u32).min(s.ctx / 2))
        .collect();
    let sessions = (0..n)
        .map(|_| {
            let sid = r.below(systems);
            // One session in eight keeps going until its context is full.
            let turns = if r.chance(0.125) { 12 } else { r.range(1, 4) };
            let turns = (0..turns)
                .map(|_| Turn {
                    append_tokens: r.range(8, 120) as u32,
                    generate: s.generate(r),
                    think_ns: r.range(200_000, 5_000_000),
                })
                .collect();
            Session {
                start_ns: r.below(2_000_000),
                system_id: 1000 + sid,
                system_tokens: system_tokens[sid as usize],
                turns,
            }
        })
        .collect();
    let oneshots = if burst {
        let at = r.range(500_000, 3_000_000);
        (0..r.range(40, 120))
            .map(|i| OneShot {
                at_ns: at,
                segments: vec![(5000 + i, r.range(16, 64) as u32)],
                generate: 2.min(s.output_max),
            })
            .collect()
    } else {
        Vec::new()
    };
    Workload { sessions, oneshots }
}

/// Needle requests: a planted token early in the context, distractors, the same token queried last.
fn needle_workload(r: &mut Rng, s: &Shape) -> Workload {
    let longest = 900.min(s.ctx - s.output_max) as u64;
    let oneshots = (0..r.range(4, 16))
        .map(|i| {
            let ctx = r.range(longest.min(100), longest) as u32;
            let at = r.below(ctx as u64 / 4) as u32;
            OneShot {
                at_ns: r.below(3_000_000),
                // (stream, n): a shared preamble, the needle, distractors, the needle again.
                segments: vec![
                    (77, at),
                    (9_000_000 + i, 1),
                    (8000 + i, ctx - at - 2),
                    (9_000_000 + i, 1),
                ],
                generate: (r.range(1, 4) as u32).min(s.output_max),
            }
        })
        .collect();
    Workload {
        sessions: Vec::new(),
        oneshots,
    }
}

/// Requests in the slice of a Mooncake trace that one `trace` seed replays.
pub const TRACE_WINDOW_REQUESTS: usize = 48;

/// The first request of the slice a `trace` seed replays lies before the last this many.
const TRACE_WINDOW_STARTS_BEFORE_END: usize = 64;

/// The slices of `t` a `trace` seed can replay: [`TRACE_WINDOW_REQUESTS`] requests (fewer at
/// the end) from each start a seed can draw.
fn trace_windows(
    t: &[tierkv_engine::trace::TraceRecord],
) -> impl Iterator<Item = &[tierkv_engine::trace::TraceRecord]> {
    let starts = t
        .len()
        .saturating_sub(TRACE_WINDOW_STARTS_BEFORE_END)
        .max(1);
    (0..starts.min(t.len())).map(move |s| &t[s..(s + TRACE_WINDOW_REQUESTS).min(t.len())])
}

/// Whether `--profile trace` can replay `t`: every slice a seed can draw spans at most
/// [`limits::TIME_NS_MAX`] of virtual time (a trace millisecond is a virtual microsecond), so
/// that no arrival time wraps. The error names the two lines.
pub fn check_trace(t: &[tierkv_engine::trace::TraceRecord]) -> Result<(), String> {
    let span_ms_max = limits::TIME_NS_MAX / 1_000;
    for w in trace_windows(t) {
        let (first, last) = (&w[0], &w[w.len() - 1]);
        let span = last.timestamp_ms.checked_sub(first.timestamp_ms);
        if span.is_none_or(|s| s > span_ms_max) {
            return Err(format!(
                "line {} arrives {} ms after line {} (timestamps {} and {}): a `trace` seed \
                 replays {TRACE_WINDOW_REQUESTS} consecutive requests within {span_ms_max} ms",
                last.line,
                last.timestamp_ms.wrapping_sub(first.timestamp_ms),
                first.line,
                first.timestamp_ms,
                last.timestamp_ms
            ));
        }
    }
    Ok(())
}

/// A slice of a Mooncake trace, blocks scaled down to fit the simulator's small contexts: each
/// 512-token block becomes a 64-token page of the same id, arrivals keep their spacing (ms → µs).
/// The trace passed [`check_trace`].
fn trace_workload(r: &mut Rng, t: &[tierkv_engine::trace::TraceRecord]) -> Workload {
    let start = r.below(
        t.len()
            .saturating_sub(TRACE_WINDOW_STARTS_BEFORE_END)
            .max(1) as u64,
    ) as usize;
    let slice = &t[start..(start + TRACE_WINDOW_REQUESTS).min(t.len())];
    let t0 = slice.first().map(|x| x.timestamp_ms).unwrap_or(0);
    let oneshots = slice
        .iter()
        .map(|rec| {
            let blocks: Vec<(u64, u32)> = rec.hash_ids.iter().take(14).map(|&h| (h, 64)).collect();
            OneShot {
                at_ns: (rec.timestamp_ms - t0)
                    .checked_mul(1_000)
                    .filter(|&ns| ns <= limits::TIME_NS_MAX)
                    .expect("the trace's windows were checked (check_trace)"),
                segments: blocks,
                generate: rec.output_length.clamp(1, 8),
            }
        })
        .collect();
    Workload {
        sessions: Vec::new(),
        oneshots,
    }
}
