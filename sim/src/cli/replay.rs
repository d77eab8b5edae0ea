//! `tierkv replay`: replays a Mooncake trace through the production service — tokio intake, the
//! engine thread, `/metrics` on loopback — on the GPU (`--device cuda`) or the in-order CPU
//! device, with arrivals at their (scaled) timestamps. Prints hit rates per tier, load and backup
//! bandwidth, and step and time-to-first-token percentiles. With `--pd`, a prefill/decode pair
//! against one engine instead (`replay_pd`), without the service.
//!
//! What it does not replay faithfully, by choice: prompts are the trace's block ids turned into
//! tokens (DESIGN §6), generations are capped (`--output-max`), the indexer runs on each prefill
//! chunk's last token (`prefill_indexer = last_token`; every-token indexing of 8K-token prompts is
//! beyond a replay's budget), and the model has `--layers` layers of DeepSeek-V3.2's shapes.

use super::error::CliError;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tierkv_engine::config::{Config, HostCapacity, PrefillIndexer, WritePolicy};
use tierkv_engine::device::{DeviceTiming, Op};
use tierkv_engine::metrics::Metrics;
use tierkv_engine::runtime::service::{serve_metrics, Service, ServiceError, StepSample};
use tierkv_engine::runtime::MonotonicClock;
use tierkv_engine::synth::Synth;
use tierkv_engine::trace::{prompt_tokens, read_trace, TraceRecord};
use tierkv_engine::{Engine, EngineOptions, RequestSpec};

#[derive(clap::Args, Debug, Clone)]
pub struct ReplayArgs {
    /// `cpu` (the in-order CPU device) or `cuda`.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// A Mooncake-format JSONL trace (default: the built-in excerpt of the Mooncake
    /// conversation trace, `data/mooncake/`).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Replay the first N requests (at least 1).
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Divide the trace's inter-arrival times by this (not with `--pd`, which has no arrival
    /// times).
    #[arg(long, default_value_t = 10.0, conflicts_with = "pd")]
    pub time_scale: f64,
    /// Model layers (DeepSeek-V3.2 shapes otherwise).
    #[arg(long, default_value_t = 4)]
    pub layers: u32,
    /// Cap on generated tokens per request.
    #[arg(long, default_value_t = 16)]
    pub output_max: u32,
    /// Device pool pages.
    #[arg(long, default_value_t = 4096)]
    pub device_pages: u32,
    /// Serve /metrics on this loopback port (0: any free port; a port in use is refused before
    /// the engine starts). Not with `--pd`, which serves no /metrics.
    #[arg(long, default_value_t = 0, conflicts_with = "pd")]
    pub metrics_port: u16,
    /// Host tier size as a multiple of the device tier.
    #[arg(long, default_value_t = 4.0)]
    pub host_ratio: f64,
    /// Write policy of the host tier.
    #[arg(long, default_value = "write_through", value_parser = ["write_through", "write_through_selective", "write_back"])]
    pub write_policy: String,
    /// With `--device cuda`: page transfers by `runs` (one cuMemcpy2DAsync per run) or `gather`
    /// (one kernel). Default: gather.
    #[arg(long, value_parser = ["runs", "gather"])]
    pub copy: Option<String>,
    /// With `--device cuda`: indexer logits by `tensor-core` (wgmma, within 1e-5 of each
    /// logit's magnitude) or `exact` (the CPU reference's operation order, bit-exact,
    /// compute-bound). Default: tensor-core.
    #[arg(long, value_parser = ["tensor-core", "exact"])]
    pub logits: Option<String>,
    /// With `--device cuda`: do not time the compute stream's ops (two timing events an op,
    /// several microseconds of host time per op), so the report has no device breakdown.
    #[arg(long)]
    pub no_device_timing: bool,
    /// With `--device cuda`: launch each of the compute stream's kernels on its own, not from
    /// CUDA graphs (`DrivenDevice::set_graphs`; graphs are the production default).
    #[arg(long)]
    pub no_graphs: bool,
    /// Run the engine one step ahead: each step is enqueued before the host waits for the one
    /// in flight, its pending tokens read on the device (`EngineOptions::overlap`).
    #[arg(long, conflicts_with = "pd")]
    pub overlap: bool,
    /// Prefill/decode disaggregation: run the requests through a prefill engine and a decode
    /// engine joined by the peer link (both on the one device), and through one engine, and
    /// compare their outputs digest for digest (no arrival times, no /metrics).
    #[arg(long)]
    pub pd: bool,
    /// With `--pd --device cuda`: 1 (both engines on GPU 0, the peer link) or 2 (prefill on GPU
    /// 0, decode on GPU 1, the NCCL link; needs `--features nccl`), then NCCL's throughput
    /// between the GPUs against a peer copy's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=2), requires = "pd")]
    pub pd_gpus: u32,
}

fn percentile(v: &mut [u64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize] as f64 / 1e6
}

/// What the clients saw: the /metrics probe, each finished request's time to first token, and
/// how many finished, were rejected, or failed.
struct Seen {
    probe: Result<String, String>,
    ttft: Vec<u64>,
    ok: usize,
    rejected: usize,
    failed: usize,
}

/// The longest a replay may take, by the trace's arrivals over `--time-scale`.
const REPLAY_SPAN_MAX: Duration = Duration::from_secs(24 * 3600);

/// The trace's first `--requests` records, the configuration and the timed requests; a usage
/// error names what was wrong. Everything `tierkv replay` checks before it starts the service.
pub fn prepare(a: &ReplayArgs) -> Result<(Config, Vec<(Duration, RequestSpec)>), CliError> {
    if a.requests == 0 {
        return Err(CliError::Arguments(
            "--requests 0: nothing to replay".into(),
        ));
    }
    if a.output_max == 0 {
        return Err(CliError::Arguments(
            "--output-max 0: every request generates at least one token".into(),
        ));
    }
    // Flags that choose how the GPU runs do nothing on the CPU device: refused, not ignored.
    if a.device != "cuda" {
        let gpu_only = [
            ("--copy", a.copy.is_some()),
            ("--logits", a.logits.is_some()),
            ("--no-device-timing", a.no_device_timing),
            ("--no-graphs", a.no_graphs),
            ("--pd-gpus", a.pd_gpus != 1),
        ];
        if let Some((flag, _)) = gpu_only.iter().find(|f| f.1) {
            return Err(CliError::Arguments(format!(
                "{flag} chooses how the GPU runs: add --device cuda, or drop {flag}"
            )));
        }
    }
    if !(a.time_scale.is_finite() && a.time_scale > 0.0) {
        return Err(CliError::Arguments(format!(
            "--time-scale {:?}: must be a finite number above 0 (arrivals are divided by it)",
            a.time_scale
        )));
    }
    if a.device == "cuda" {
        super::cuda_kernels("--device cuda", 0)?;
        if a.pd_gpus == 2 {
            if !cfg!(feature = "nccl") {
                return Err(CliError::NotBuilt {
                    flag: "--pd-gpus 2",
                    feature: "nccl",
                });
            }
            super::cuda_kernels("--pd-gpus 2", 1)?;
        }
    }
    let recs = match &a.trace {
        Some(p) => read_trace(p).map_err(|e| CliError::trace("--trace", p, e))?,
        None => super::data::mooncake_excerpt().expect("the built-in excerpt is a trace"),
    };
    let recs: Vec<_> = recs.into_iter().take(a.requests).collect();
    let cfg =
        replay_config(a).map_err(|e| CliError::Config(format!("replay configuration: {e}")))?;
    let work = workload(&recs, &cfg, a).map_err(CliError::Arguments)?;
    if work.is_empty() {
        return Err(CliError::Arguments(
            "the trace's requests all have empty prompts: nothing to replay".into(),
        ));
    }
    Ok((cfg, work))
}

pub fn run_replay(a: ReplayArgs) -> i32 {
    if a.pd {
        return super::replay_pd::run_replay_pd(&a);
    }
    replay(&a).unwrap_or_else(CliError::report)
}

/// `tierkv replay` without `--pd`: the exit code of the replay, or why it could not start.
fn replay(a: &ReplayArgs) -> Result<i32, CliError> {
    let (cfg, work) = prepare(a)?;
    let held = check_memory(&cfg, a, memory_available())?;
    // The port is taken before the engine starts: a port in use is the machine's refusal.
    let listener = std::net::TcpListener::bind(("127.0.0.1", a.metrics_port))
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| {
            CliError::Resources(format!(
                "--metrics-port {}: cannot serve /metrics on 127.0.0.1:{} ({e}); choose another \
                 port, or 0 for any free one",
                a.metrics_port, a.metrics_port
            ))
        })?;
    let tokens: usize = work.iter().map(|w| w.1.prompt.len()).sum();
    println!(
        "replaying {} requests ({} prompt tokens) of {} on {}, arrivals /{}; {} layers, device {} pages, host {}x, {}; the engine {}; it will hold about {:.2} GB of host memory",
        work.len(),
        tokens,
        a.trace.as_ref().map_or(super::data::MOONCAKE_EXCERPT_NAME.to_string(), |p| p.display().to_string()),
        a.device,
        a.time_scale,
        a.layers,
        a.device_pages,
        a.host_ratio,
        a.write_policy,
        if a.overlap {
            "one step ahead (--overlap)"
        } else {
            "in order"
        },
        held as f64 / 1e9
    );
    let service = match start_service(&cfg, a)? {
        Ok(s) => s,
        Err(e) => {
            // An engine that refuses to start is the replay's failure (on either device).
            eprintln!("replay: {e}");
            return Ok(1);
        }
    };
    let started = Instant::now();
    let seen = match drive(&service, work, listener, started) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("replay failed: {e}");
            return Ok(1);
        }
    };
    let wall = started.elapsed();
    let published = service.published.clone();
    if let Err(e) = service.shutdown() {
        eprintln!("engine: {e}");
        return Ok(1);
    }
    let p = published.lock().expect("published");
    if let Some(b) = p.built_in {
        println!(
            "engine built in {:.2} s on its thread (device, kernels, host mirror), within the replay's time",
            b.as_secs_f64()
        );
    }
    Ok(report(&p.metrics, &p.steps, seen, wall))
}

/// DeepSeek-V3.2's shapes with the replay's layers, pools, host tier and write policy.
/// The bytes a replay holds in this process's memory, sized before anything is allocated: each
/// engine's host mirror and readback buffer (pinned host memory), and on the CPU device its
/// device tier and scratch too. `--pd` on the CPU holds three engines at once (the pair and
/// the single engine it is compared with); on CUDA the pair's device tiers are on the GPU.
fn resident_bytes(cfg: &Config, a: &ReplayArgs) -> Result<u64, CliError> {
    let fp = cfg
        .footprint(cfg.model.index_topk)
        .map_err(|e| CliError::Config(format!("replay configuration: {e}")))?;
    let per_engine = match a.device.as_str() {
        "cuda" => fp.host.0,
        _ => fp.host.0.saturating_add(fp.device.0),
    };
    let engines = if a.pd { 3 } else { 1 };
    Ok(per_engine.saturating_mul(engines))
}

/// What this process may hold: the smallest of the memory the kernel says is available
/// (`MemAvailable`), the control group's memory limit (cgroup v2 `memory.max`, v1
/// `memory.limit_in_bytes`: a container's) and the address-space limit (`ulimit -v`), with what
/// limited it. `None` where none can be read.
pub fn memory_available() -> Option<(u64, &'static str)> {
    // "max" (v2) when unlimited does not parse; v1's unlimited is a huge number.
    let cgroup = [
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ]
    .iter()
    .find_map(|f| std::fs::read_to_string(f).ok()?.trim().parse::<u64>().ok())
    .map(|b| (b, "the container's memory limit (cgroup)"));
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| {
                (
                    kib.saturating_mul(1024),
                    "the memory available (MemAvailable)",
                )
            })
    });
    let limit =
        crate::campaign::address_space_limit().map(|b| (b, "the address-space limit (ulimit -v)"));
    [meminfo, cgroup, limit]
        .into_iter()
        .flatten()
        .min_by_key(|m| m.0)
}

/// The share of the memory available a replay may hold (an address-space limit counts the
/// program, its threads and its other allocations too).
pub const MEMORY_SHARE_MAX: f64 = 0.9;

/// The bytes the replay will hold (sized before anything is allocated), or a refusal when that
/// is more than [`MEMORY_SHARE_MAX`] of `available` (what [`memory_available`] found), naming the
/// figure and the flags that set it. Apart from [`prepare`], whose verdict depends on the
/// arguments alone.
pub fn check_memory(
    cfg: &Config,
    a: &ReplayArgs,
    available: Option<(u64, &'static str)>,
) -> Result<u64, CliError> {
    let need = resident_bytes(cfg, a)?;
    let Some((have, what)) = available else {
        return Ok(need);
    };
    if need as f64 <= MEMORY_SHARE_MAX * have as f64 {
        return Ok(need);
    }
    Err(CliError::Resources(format!(
        "the replay would hold {:.2} GB ({}{} pages x {} layers on the device tier \
         (--device-pages, --layers){}, a host mirror {}x as large (--host-ratio)), over 90% of \
         {what}, {:.2} GB: lower --device-pages, --layers or --host-ratio",
        need as f64 / 1e9,
        if a.pd { "three engines, each " } else { "" },
        a.device_pages,
        a.layers,
        if a.device == "cuda" {
            " on the GPU"
        } else {
            " in host memory on the CPU device"
        },
        a.host_ratio,
        have as f64 / 1e9
    )))
}

fn replay_config(a: &ReplayArgs) -> Result<Config, tierkv_engine::ConfigError> {
    let mut cfg = Config::preset("deepseek-v3.2")?;
    cfg.name = "replay".into();
    cfg.model.layers = a.layers;
    cfg.model.prefill_indexer = PrefillIndexer::LastToken;
    cfg.cache.device_pages = a.device_pages;
    cfg.cache.host = HostCapacity::Ratio(a.host_ratio);
    cfg.cache.write_policy = match a.write_policy.as_str() {
        "write_through" => WritePolicy::WriteThrough,
        "write_back" => WritePolicy::WriteBack,
        _ => WritePolicy::WriteThroughSelective,
    };
    cfg.scheduler.output_tokens_max = a.output_max.max(1);
    cfg.validate()?;
    Ok(cfg)
}

/// Each record as a request at its scaled arrival time, its prompt cut to fit the context. The
/// whole replay must end within a day.
fn workload(
    recs: &[TraceRecord],
    cfg: &Config,
    a: &ReplayArgs,
) -> Result<Vec<(Duration, RequestSpec)>, String> {
    let synth = Synth::new(0);
    let t0 = recs.first().map_or(0, |r| r.timestamp_ms);
    let fits = cfg.model.context_tokens_max as usize - a.output_max as usize - 1;
    let mut out = Vec::with_capacity(recs.len());
    for r in recs {
        // Arrival times are ordered (the reader checks), so `timestamp_ms >= t0`.
        let secs = (r.timestamp_ms - t0) as f64 / 1e3 / a.time_scale;
        let at = Duration::try_from_secs_f64(secs)
            .ok()
            .filter(|d| *d <= REPLAY_SPAN_MAX)
            .ok_or_else(|| {
                format!(
                    "--time-scale {:?}: line {}'s arrival would come {secs:.3e} s after the first, over a replay of at most {} s",
                    a.time_scale,
                    r.line,
                    REPLAY_SPAN_MAX.as_secs()
                )
            })?;
        let prompt = prompt_tokens(r, &synth, fits);
        if prompt.is_empty() {
            continue;
        }
        let spec = RequestSpec {
            prompt,
            max_new_tokens: r.output_length.clamp(1, a.output_max),
        };
        out.push((at, spec));
    }
    Ok(out)
}

/// The service on the device `a` names: a refusal of the command line when the build or the
/// machine has no such device, else whether the engine started.
fn start_service(cfg: &Config, a: &ReplayArgs) -> Result<Result<Service, ServiceError>, CliError> {
    let options = EngineOptions {
        overlap: a.overlap,
        ..EngineOptions::default()
    };
    match a.device.as_str() {
        "cpu" => {
            let cfg = cfg.clone();
            Ok(Service::start(move || {
                Engine::new(
                    cfg,
                    tierkv_engine::cpu_device::InOrderDevice::new(),
                    MonotonicClock::new(),
                    options,
                )
            }))
        }
        _ => start_cuda(
            cfg.clone(),
            a.copy.as_deref().unwrap_or("gather"),
            a.logits.as_deref().unwrap_or("tensor-core"),
            !a.no_device_timing,
            !a.no_graphs,
            options,
        ),
    }
}

/// Serves /metrics, submits every request at its arrival time through the service's client,
/// probes /metrics while they run, and waits for every answer.
fn drive(
    service: &Service,
    work: Vec<(Duration, RequestSpec)>,
    listener: std::net::TcpListener,
    started: Instant,
) -> Result<Seen, String> {
    let client = service.client();
    let published = service.published.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio: {e}"))?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        println!("/metrics on http://{addr}/metrics");
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let server = tokio::spawn(serve_metrics(listener, published, stop_rx));
        let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ticker = tokio::spawn(progress(answered.clone(), work.len(), started));
        let handles = submit_at_arrivals(&client, work, started, &answered);
        // Probe /metrics while the replay runs, once the engine has published a snapshot (a
        // large configuration takes a while to start: its pools are allocated and pinned first).
        let mut probe = Err("the engine published no metrics while the replay ran".to_string());
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            match fetch_metrics(addr).await {
                Ok(t) if !t.is_empty() => {
                    probe = Ok(t);
                    break;
                }
                Err(e) => probe = Err(e),
                Ok(_) => {}
            }
            if handles.iter().all(|h| h.is_finished()) {
                break;
            }
        }
        let mut seen = Seen {
            probe,
            ttft: Vec::new(),
            ok: 0,
            rejected: 0,
            failed: 0,
        };
        for h in handles {
            match h.await.map_err(|e| e.to_string())? {
                Ok(c) => {
                    seen.ok += 1;
                    seen.ttft.push(c.ttft_ns);
                }
                Err(ServiceError::Rejected(_)) => seen.rejected += 1,
                Err(e) => {
                    seen.failed += 1;
                    eprintln!("request failed: {e}");
                }
            }
        }
        ticker.abort();
        let _ = stop_tx.send(true);
        let _ = server.await;
        Ok(seen)
    })
}

/// One task per request: it submits the request at its arrival time and counts its answer in
/// `answered`.
fn submit_at_arrivals(
    client: &tierkv_engine::runtime::service::Client,
    work: Vec<(Duration, RequestSpec)>,
    started: Instant,
    answered: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<Result<tierkv_engine::runtime::service::Completion, ServiceError>>>
{
    work.into_iter()
        .map(|(at, spec)| {
            let c = client.clone();
            let answered = answered.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(tokio::time::Instant::from_std(started + at)).await;
                let r = c.generate(spec).await;
                answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                r
            })
        })
        .collect()
}

/// Prints `answered` of `total` on stderr every `PROGRESS_EVERY` (the campaign's interval)
/// until aborted: a long replay is otherwise silent until its report.
async fn progress(
    answered: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    total: usize,
    started: Instant,
) {
    let mut every = tokio::time::interval(crate::campaign::PROGRESS_EVERY);
    every.tick().await; // The first tick is at once.
    loop {
        every.tick().await;
        eprintln!(
            "replay: {} of {total} requests answered, {:.0} s",
            answered.load(std::sync::atomic::Ordering::Relaxed),
            started.elapsed().as_secs_f64()
        );
    }
}

/// Prints what the replay measured; the exit code says whether every request was answered and
/// /metrics was.
fn report(m: &Metrics, samples: &[StepSample], mut seen: Seen, wall: Duration) -> i32 {
    let mut steps: Vec<u64> = samples.iter().map(|s| s.wall_ns).collect();
    match &seen.probe {
        Ok(text) => println!(
            "/metrics answered during the replay ({} lines), e.g. {}",
            text.lines().count(),
            text.lines()
                .find(|l| l.starts_with("tierkv_prefix_hit_rate"))
                .unwrap_or("")
        ),
        Err(e) => println!("/metrics probe failed: {e}"),
    }
    println!(
        "finished {}, rejected {}, failed {} in {:.2} s",
        seen.ok,
        seen.rejected,
        seen.failed,
        wall.as_secs_f64()
    );
    println!(
        "prefix hit rate: device {:.4}, host {:.4} (of {} prompt pages)",
        m.hit_rate(m.prefix_pages_device_hit),
        m.hit_rate(m.prefix_pages_host_hit),
        m.prefix_pages_queried
    );
    let gbps = |bytes: u64, ns: u64| {
        if ns == 0 {
            0.0
        } else {
            bytes as f64 / ns as f64
        }
    };
    println!(
        "loads: {} ({:.2} GB, {:.2} GB/s over their latency); backups: {} ({:.2} GB, {:.2} GB/s); load failures {}",
        m.loads,
        m.load_bytes as f64 / 1e9,
        gbps(m.load_bytes, m.load_latency.sum_ns),
        m.backups,
        m.backup_bytes as f64 / 1e9,
        gbps(m.backup_bytes, m.backup_latency.sum_ns),
        m.load_failures
    );
    let ttft = &mut seen.ttft;
    println!(
        "step latency ms (each engine iteration's wall time): p50 {:.3} p90 {:.3} p99 {:.3} ({} steps); TTFT ms: p50 {:.1} p90 {:.1} p99 {:.1}",
        percentile(&mut steps, 0.5),
        percentile(&mut steps, 0.9),
        percentile(&mut steps, 0.99),
        steps.len(),
        percentile(ttft, 0.5),
        percentile(ttft, 0.9),
        percentile(ttft, 0.99)
    );
    step_breakdown(m, samples);
    if seen.failed > 0 || seen.probe.is_err() {
        1
    } else {
        0
    }
}

/// Per op kind, the device's busy time and the host's time inside the device's enqueue, per
/// timed step; then the share of launches from CUDA graphs.
fn per_op_breakdown(timed: &[(u64, DeviceTiming)]) {
    let ms = |ns: u64| ns as f64 / timed.len() as f64 / 1e6;
    let per_op = |of: &dyn Fn(&DeviceTiming) -> [u64; Op::KINDS]| {
        let mut sum = [0u64; Op::KINDS];
        for (_, d) in timed {
            for (s, ns) in sum.iter_mut().zip(of(d)) {
                *s += ns;
            }
        }
        Op::NAMES
            .iter()
            .zip(sum)
            .filter(|(_, ns)| *ns > 0)
            .map(|(name, ns)| format!("{name} {:.3}", ms(ns)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "per op kind, ms per step (mean): device busy: {}; host inside the device's enqueue (checks, uploads, launches): {}",
        per_op(&|d| d.busy_by_op_ns),
        per_op(&|d| d.enqueue_ns)
    );
    graph_share(timed);
}

/// The compute stream's kernel launches per timed step, and the share of them queued from CUDA
/// graphs.
fn graph_share(timed: &[(u64, DeviceTiming)]) {
    let launches: u64 = timed.iter().map(|t| t.1.launches).sum();
    let graphed: u64 = timed.iter().map(|t| t.1.launches_from_graphs).sum();
    println!(
        "kernel launches of the compute stream's ops per step (mean): {:.1}, of which {:.1}% from CUDA graphs (captured for their op, or replayed)",
        launches as f64 / timed.len() as f64,
        100.0 * graphed as f64 / launches.max(1) as f64
    );
}

/// Where the computing steps' time went: the host's phases, the device's busy and stalled time,
/// and the host time the device did not overlap. Steps that computed nothing (they only waited
/// for copies) are left out.
fn step_breakdown(m: &Metrics, samples: &[StepSample]) {
    let computing: Vec<&StepSample> = samples.iter().filter(|s| s.rows > 0).collect();
    if computing.is_empty() {
        return;
    }
    let n = computing.len() as f64;
    let mean = |f: &dyn Fn(&StepSample) -> u64| {
        computing.iter().map(|s| f(s)).sum::<u64>() as f64 / n / 1e6
    };
    println!(
        "computing steps ({} of {}), host ms per step (mean): schedule {:.3}, enqueue {:.3}, wait for the device {:.3}, finish {:.3}; wall {:.3}",
        computing.len(),
        samples.len(),
        mean(&|s| s.host.schedule_ns),
        mean(&|s| s.host.enqueue_ns),
        mean(&|s| s.host.wait_ns),
        mean(&|s| s.host.finish_ns),
        mean(&|s| s.wall_ns),
    );
    let timed: Vec<(u64, DeviceTiming)> = computing
        .iter()
        .filter_map(|s| s.device.map(|d| (s.wall_ns, d)))
        .collect();
    if timed.is_empty() {
        println!(
            "device timing: off (--no-device-timing, or the CPU device, which computes each op inside enqueue)"
        );
        return;
    }
    let tn = timed.len() as f64;
    let ms = |ns: u64| ns as f64 / tn / 1e6;
    let busy = ms(timed.iter().map(|t| t.1.busy_ns).sum());
    let stalled = ms(timed.iter().map(|t| t.1.stalled_ns).sum());
    let mut exposed: Vec<u64> = timed
        .iter()
        .map(|t| t.0.saturating_sub(t.1.busy_ns + t.1.stalled_ns))
        .collect();
    let exposed_mean = ms(exposed.iter().sum());
    println!(
        "device ms per step (mean): busy {busy:.3} (each op from its start event to its end event: a device waiting for the host inside an op's launch counts as busy), stalled on loads {stalled:.3}; \
         device idle within the step (wall - busy - stalled: a lower bound) mean {exposed_mean:.3}, p50 {:.3}, p90 {:.3}",
        percentile(&mut exposed, 0.5),
        percentile(&mut exposed, 0.9),
    );
    per_op_breakdown(&timed);
    let load_s = m.load_latency.sum_ns as f64 / 1e9;
    let stalled_s = m.step_device.stalled_ns as f64 / 1e9;
    println!(
        "loads: {} with {load_s:.3} s of latency summed (loads overlap one another), of which the compute stream stalled {stalled_s:.3} s (exposed); the rest ran beside other work",
        m.loads
    );
}

async fn fetch_metrics(addr: std::net::SocketAddr) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut body = String::new();
    s.read_to_string(&mut body)
        .await
        .map_err(|e| e.to_string())?;
    if !body.starts_with("HTTP/1.1 200") {
        return Err(body.lines().next().unwrap_or("").to_string());
    }
    Ok(body.split("\r\n\r\n").nth(1).unwrap_or("").to_string())
}

/// The service on the GPU, or the replay's exit code: 2 when no GPU is usable (or the build has
/// no CUDA), 1 when the engine refused to start.
#[cfg(feature = "cuda")]
fn start_cuda(
    cfg: Config,
    copy: &str,
    logits: &str,
    timing: bool,
    graphs: bool,
    options: EngineOptions,
) -> Result<Result<Service, ServiceError>, CliError> {
    use tierkv_engine::runtime::cuda::{CopyStrategy, CudaDevice, LogitsKernel};
    let logits = if logits == "exact" {
        LogitsKernel::Exact
    } else {
        LogitsKernel::TensorCore
    };
    let strategy = if copy == "runs" {
        CopyStrategy::MemcpyRuns
    } else {
        CopyStrategy::Gather
    };
    let started = Service::start(move || {
        let mut dev = CudaDevice::new(strategy)?;
        dev.driver.logits = logits;
        dev.set_timing(timing);
        dev.set_graphs(graphs);
        // The cos/sin rows of every position a request may reach, before the first step.
        dev.prepare_rope_for(&cfg)?;
        Engine::new(cfg, dev, MonotonicClock::new(), options)
    });
    // No usable device above is the environment's refusal (exit 2); an engine that refuses to
    // start is the replay's failure (the caller's exit 1, as on the CPU).
    Ok(started)
}

#[cfg(not(feature = "cuda"))]
fn start_cuda(
    _: Config,
    _: &str,
    _: &str,
    _: bool,
    _: bool,
    _: EngineOptions,
) -> Result<Result<Service, ServiceError>, CliError> {
    unreachable!("`prepare` refuses --device cuda in a build without CUDA")
}
