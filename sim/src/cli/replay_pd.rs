//! `tierkv replay --pd`: the trace's requests through a prefill/decode pair and through one
//! engine, on the same device kind, and the two compared request by request, digest for digest.
//!
//! By default both engines of the pair share one device (the in-order CPU device, or one CUDA
//! GPU) and are joined by the peer link: each transfer is page copies on the device's load stream, from the
//! prefill engine's pools to the decode engine's. The requests are submitted in trace order and
//! the engines stepped to idle on this thread (no arrival times: the comparison is of outputs,
//! not of latency). Prints each role's `/metrics` text, the transfers, and the comparison; exits
//! 1 when any request differs. With `--device cuda --pd-gpus 2` (feature `nccl`) the prefill
//! engine runs on GPU 0 and the decode engine on GPU 1, joined by NCCL
//! (`runtime::nccl::NcclLink`), and the link is then timed against a peer copy.

use super::replay::{prepare, ReplayArgs};
use crate::campaign::PROGRESS_EVERY;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Instant;
use tierkv_engine::cpu_device::ManualClock;
use tierkv_engine::device::Device;
use tierkv_engine::pd::{KvLink, PeerLink, SharedDevice};
use tierkv_engine::{Config, Engine, EngineOptions, Output, PdPair, Rejection, RequestSpec};

/// What one request emitted.
#[derive(Debug, Default, PartialEq)]
struct Emitted {
    /// Query position → digests.
    digests: BTreeMap<u32, Vec<u64>>,
    tokens: Vec<u32>,
    finished: Option<Vec<u32>>,
    ended_otherwise: Option<String>,
}

fn collect(out: Vec<Output>, seen: &mut BTreeMap<u64, Emitted>) {
    for o in out {
        match o {
            Output::Digests {
                request,
                position,
                digests,
            } => {
                seen.entry(request)
                    .or_default()
                    .digests
                    .insert(position, digests);
            }
            Output::Token { request, token, .. } => {
                seen.entry(request).or_default().tokens.push(token)
            }
            Output::Finished { request, generated } => {
                seen.entry(request).or_default().finished = Some(generated)
            }
            Output::Aborted { request } => {
                seen.entry(request).or_default().ended_otherwise = Some("aborted".into())
            }
            Output::TransferFailed { request, tries } => {
                seen.entry(request).or_default().ended_otherwise =
                    Some(format!("transfer failed {tries} times"))
            }
            Output::TransferTimedOut { request, tries } => {
                seen.entry(request).or_default().ended_otherwise =
                    Some(format!("transfer timed out ({tries} tries)"))
            }
            // A failed host-tier load recomputed, or a request requeued after its side's context
            // was recreated: its tokens come later.
            Output::Recompute { .. } | Output::Requeued { .. } => {}
        }
    }
}

/// A step budget: far more than any replay of this size needs.
const STEPS_MAX: u64 = 10_000_000;

/// Prints a progress line (on stderr) of the engine called `what` once `PROGRESS_EVERY` (the
/// campaign's interval) has passed since the last one: the engines step on this thread for
/// minutes at DeepSeek's sizes.
struct Progress<'a> {
    what: &'a str,
    started: Instant,
    next: Instant,
}

impl Progress<'_> {
    fn note(&mut self, steps: u64, submitted: usize, seen: &BTreeMap<u64, Emitted>) {
        let now = Instant::now();
        if now < self.next {
            return;
        }
        self.next = now + PROGRESS_EVERY;
        let ended = seen
            .values()
            .filter(|e| e.finished.is_some() || e.ended_otherwise.is_some())
            .count();
        eprintln!(
            "replay --pd: {}: {steps} steps, {submitted} requests submitted, {ended} ended, {:.0} s",
            self.what,
            self.started.elapsed().as_secs_f64()
        );
    }
}

/// Submits `work` in order (stepping while admission control refuses) and steps to idle,
/// printing a progress line every `PROGRESS_EVERY` under the name `what`.
fn drive<S, E>(
    what: &str,
    work: &[RequestSpec],
    mut submit: S,
    mut step: E,
    seen: &mut BTreeMap<u64, Emitted>,
) -> Result<u64, String>
where
    S: FnMut(RequestSpec) -> Result<u64, Rejection>,
    E: FnMut(&mut BTreeMap<u64, Emitted>) -> Result<bool, String>,
{
    let started = Instant::now();
    let mut progress = Progress {
        what,
        started,
        next: started + PROGRESS_EVERY,
    };
    let mut steps = 0u64;
    for (i, spec) in work.iter().enumerate() {
        loop {
            match submit(spec.clone()) {
                Ok(id) if id == i as u64 => break,
                Ok(id) => return Err(format!("request {i} got id {id}")),
                Err(Rejection::Invalid { reason }) => {
                    return Err(format!("request {i} refused: {reason}"))
                }
                Err(_) => {
                    step(seen)?;
                    steps += 1;
                    progress.note(steps, i, seen);
                }
            }
        }
    }
    while !step(seen)? {
        steps += 1;
        progress.note(steps, work.len(), seen);
        if steps > STEPS_MAX {
            return Err(format!("not idle after {STEPS_MAX} steps"));
        }
    }
    Ok(steps)
}

/// Runs `work` through one engine on `device`: its steps and what each request emitted.
fn run_single<D: Device>(
    cfg: &Config,
    work: &[RequestSpec],
    device: D,
) -> Result<(u64, BTreeMap<u64, Emitted>), String> {
    let mut one = Engine::new(
        cfg.clone(),
        device,
        ManualClock::default(),
        EngineOptions::default(),
    )
    .map_err(|e| format!("single engine: {e}"))?;
    let mut seen = BTreeMap::new();
    let one = RefCell::new(&mut one);
    let steps = drive(
        "single engine",
        work,
        |s| one.borrow_mut().submit(s),
        |seen| {
            let mut e = one.borrow_mut();
            let r = e.step().map_err(|e| format!("single engine: {e}"))?;
            collect(e.drain_outputs(), seen);
            Ok(r.idle)
        },
        &mut seen,
    )?;
    Ok((steps, seen))
}

/// Runs the single engine and the pair on devices made by `device`, both engines of the pair on
/// one shared device joined by the peer link, and compares them.
fn compare<D: Device>(
    cfg: &Config,
    work: &[RequestSpec],
    device: impl Fn() -> Result<D, String>,
) -> Result<bool, String> {
    let shared = SharedDevice(Rc::new(RefCell::new(device()?)));
    compare_with(cfg, work, device()?, || {
        PdPair::new(
            cfg.clone(),
            cfg.clone(),
            shared.clone(),
            shared,
            ManualClock::default(),
            ManualClock::default(),
            PeerLink,
            EngineOptions::default(),
        )
        .map_err(|e| format!("prefill/decode pair: {e}"))
    })
    .map(|(equal, _)| equal)
}

/// Runs the single engine on `single` and the pair `pair` makes, and compares them. Returns
/// whether every request was equal, and the pair (for what the caller measures next).
fn compare_with<D: Device, P: Device, L: KvLink<P>>(
    cfg: &Config,
    work: &[RequestSpec],
    single: D,
    pair: impl FnOnce() -> Result<PdPair<P, ManualClock, L>, String>,
) -> Result<(bool, PdPair<P, ManualClock, L>), String> {
    let started = Instant::now();
    let (one_steps, single) = run_single(cfg, work, single)?;
    let one_wall = started.elapsed();
    let mut pair = pair()?;
    let started = Instant::now();
    let mut paired = BTreeMap::new();
    let pair_steps = {
        let pair = RefCell::new(&mut pair);
        drive(
            "pair",
            work,
            |s| pair.borrow_mut().submit(s),
            |seen| {
                let mut p = pair.borrow_mut();
                let r = p.step().map_err(|e| format!("pair: {e}"))?;
                collect(p.drain_outputs(), seen);
                Ok(r.idle)
            },
            &mut paired,
        )?
    };
    let pair_wall = started.elapsed();
    pair.check_quiescent()
        .map_err(|e| format!("the pair leaked: {e}"))?;
    println!("# prefill engine /metrics");
    print!("{}", pair.prefill().metrics.render_prometheus());
    println!("# decode engine /metrics");
    print!("{}", pair.decode().metrics.render_prometheus());
    let st = pair.stats;
    let page_bytes = pair.prefill().layout().transfer_bytes(1).0;
    println!(
        "single engine: {} requests in {one_steps} steps, {:.2} s; pair: {pair_steps} steps, {:.2} s (stepped on one thread: not a serving timing)",
        single.len(),
        one_wall.as_secs_f64(),
        pair_wall.as_secs_f64()
    );
    println!(
        "transfers: {} started, {} done, {} failed, {} requests failed; {} layer-pages sent ({:.1} MB)",
        st.transfers_started,
        st.transfers_done,
        st.transfers_failed,
        st.requests_failed,
        st.layer_pages_sent,
        (st.layer_pages_sent * page_bytes / cfg.model.layers as u64) as f64 / 1e6
    );
    let (mut equal, mut digests) = (0usize, 0usize);
    let mut differ = Vec::new();
    for (id, s) in &single {
        let Some(p) = paired.get(id) else {
            differ.push(format!("request {id}: no output from the pair"));
            continue;
        };
        let mut why = Vec::new();
        if s.tokens != p.tokens {
            why.push("tokens".to_string());
        }
        if s.finished != p.finished || s.ended_otherwise != p.ended_otherwise {
            why.push(format!(
                "end (single {:?} {:?}, pair {:?} {:?})",
                s.finished.as_ref().map(Vec::len),
                s.ended_otherwise,
                p.finished.as_ref().map(Vec::len),
                p.ended_otherwise
            ));
        }
        // Positions both computed (each side's prefix cache decides which prompt positions it
        // recomputes) are equal, and both computed every generated position.
        for (pos, d) in &s.digests {
            match p.digests.get(pos) {
                Some(e) if e == d => digests += 1,
                Some(_) => why.push(format!("digests of position {pos}")),
                None => {}
            }
        }
        let generated: Vec<&u32> = s
            .digests
            .keys()
            .rev()
            .take(s.tokens.len())
            .filter(|pos| !p.digests.contains_key(pos))
            .collect();
        if !generated.is_empty() {
            why.push(format!("the pair never computed positions {generated:?}"));
        }
        if why.is_empty() {
            equal += 1;
        } else {
            differ.push(format!("request {id}: {}", why.join(", ")));
        }
    }
    println!(
        "pair = single engine: {equal} of {} requests equal ({digests} query digests compared)",
        single.len()
    );
    for d in differ.iter().take(20) {
        println!("  differs: {d}");
    }
    Ok((differ.is_empty() && equal == work.len(), pair))
}

pub fn run_replay_pd(a: &ReplayArgs) -> i32 {
    let ready = prepare(a).and_then(|(cfg, work)| {
        let held = super::replay::check_memory(&cfg, a, super::replay::memory_available())?;
        Ok((cfg, work, held))
    });
    let (cfg, work, held) = match ready {
        Ok(p) => p,
        Err(e) => return e.report(),
    };
    let work: Vec<RequestSpec> = work.into_iter().map(|(_, s)| s).collect();
    println!(
        "replaying {} requests through a prefill/decode pair and through one engine, on {}; {} layers, device {} pages each; they will hold about {:.2} GB of host memory",
        work.len(),
        a.device,
        a.layers,
        a.device_pages,
        held as f64 / 1e9
    );
    let result = match a.device.as_str() {
        "cpu" => compare(&cfg, &work, || {
            Ok(tierkv_engine::cpu_device::InOrderDevice::new())
        }),
        _ => cuda(&cfg, &work, a),
    };
    match result {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("replay --pd: {e}");
            1
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda(cfg: &Config, work: &[RequestSpec], a: &ReplayArgs) -> Result<bool, String> {
    use tierkv_engine::runtime::cuda::{CopyStrategy, CudaDevice, LogitsKernel};
    let logits = if a.logits.as_deref() == Some("exact") {
        LogitsKernel::Exact
    } else {
        LogitsKernel::TensorCore
    };
    let strategy = if a.copy.as_deref() == Some("runs") {
        CopyStrategy::MemcpyRuns
    } else {
        CopyStrategy::Gather
    };
    let device = |ordinal: usize| {
        let mut dev =
            CudaDevice::on(ordinal, strategy).map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
        dev.driver.logits = logits;
        dev.prepare_rope_for(cfg)
            .map_err(|e| format!("CUDA device {ordinal}: the RoPE table: {e}"))?;
        Ok::<_, String>(dev)
    };
    if a.pd_gpus == 2 {
        return two_gpus(cfg, work, device(0)?, device(0)?, device(1)?);
    }
    compare(cfg, work, || device(0))
}

/// Prefill on GPU 0, decode on GPU 1, joined by NCCL; the single engine on GPU 0. Then NCCL's
/// send/receive throughput between the two GPUs against `cuMemcpyPeerAsync`'s, on 1 GiB.
#[cfg(feature = "nccl")]
fn two_gpus(
    cfg: &Config,
    work: &[RequestSpec],
    single: tierkv_engine::runtime::cuda::CudaDevice,
    prefill: tierkv_engine::runtime::cuda::CudaDevice,
    decode: tierkv_engine::runtime::cuda::CudaDevice,
) -> Result<bool, String> {
    use tierkv_engine::runtime::nccl::{measure, NcclLink};
    let link = NcclLink::new(&prefill, &decode).map_err(|e| format!("NCCL link: {e}"))?;
    println!(
        "prefill engine on GPU {}, decode engine on GPU {}, joined by NCCL",
        link.ordinals[0], link.ordinals[1]
    );
    let (equal, pair) = compare_with(cfg, work, single, || {
        PdPair::new(
            cfg.clone(),
            cfg.clone(),
            prefill,
            decode,
            ManualClock::default(),
            ManualClock::default(),
            link,
            EngineOptions::default(),
        )
        .map_err(|e| format!("prefill/decode pair: {e}"))
    })?;
    let (p, d) = (pair.prefill(), pair.decode());
    // The link went into the pair; measure with a second communicator over the same GPUs.
    let probe = NcclLink::new(&p.dev, &d.dev).map_err(|e| format!("NCCL link: {e}"))?;
    let bytes = 1usize << 30;
    let (nccl, peer) =
        measure(&probe, &p.dev, &d.dev, bytes).map_err(|e| format!("link throughput: {e}"))?;
    println!(
        "link throughput, 1 GiB GPU {} -> GPU {}: NCCL send/recv {:.1} GB/s, cuMemcpyPeerAsync {:.1} GB/s (ceiling): {:.0}%",
        probe.ordinals[0],
        probe.ordinals[1],
        nccl / 1e9,
        peer / 1e9,
        100.0 * nccl / peer
    );
    Ok(equal)
}

#[cfg(all(feature = "cuda", not(feature = "nccl")))]
fn two_gpus(
    _: &Config,
    _: &[RequestSpec],
    _: tierkv_engine::runtime::cuda::CudaDevice,
    _: tierkv_engine::runtime::cuda::CudaDevice,
    _: tierkv_engine::runtime::cuda::CudaDevice,
) -> Result<bool, String> {
    unreachable!("`prepare` refuses --pd-gpus 2 in a build without NCCL")
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &Config, _: &[RequestSpec], _: &ReplayArgs) -> Result<bool, String> {
    unreachable!("`prepare` refuses --device cuda in a build without CUDA")
}
