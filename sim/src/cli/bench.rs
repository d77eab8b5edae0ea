//! `tierkv bench` (feature `cuda`): times the kernels and page transfers on the GPU against the
//! device-copy bandwidth measured in the same run and, given `--torch-json`, against the PyTorch
//! implementations of `bench/torch_bench.py` run on the same machine just before.
//! `tierkv bench --campaign` (any build) measures the simulator instead (`bench_campaign`),
//! `tierkv-zoo bench --catch` how soon its campaigns find the zoo's bugs (`bench_catch`), and
//! `tierkv bench --cache` the prefix cache's logic over a trace (`bench_cache`).
//!
//! Every time is the median of repeated runs between CUDA events, after warm-up. Bytes moved count
//! each input read once and each output written once.

use super::error::CliError;

#[derive(clap::Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("sim_bench").args(["campaign", "catch"])))]
pub struct BenchArgs {
    /// Results of `bench/torch_bench.py` (JSON lines) to compare with.
    #[arg(long)]
    pub torch_json: Option<std::path::PathBuf>,
    /// Write the results table (markdown) here too.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Timed repetitions per measurement (of the GPU bench: not with `--campaign` or `--cache`).
    #[arg(long, default_value_t = 10, conflicts_with_all = ["campaign", "catch", "cache"])]
    pub reps: usize,
    /// Measure the simulator's campaign speed instead (no GPU needed): seeds/s, ops/s, checked
    /// reads per wall and CPU second, and each probe's reach, for this build and `--baseline`.
    #[arg(long, conflicts_with_all = ["torch_json", "catch"])]
    pub campaign: bool,
    /// Measure how soon campaigns catch each mutant of the bug zoo instead (no GPU needed; in
    /// `tierkv-zoo`, the build with the mutants): CPU-seconds and seeds to the first catch per
    /// mutant, and over the zoo, for this build and `--baseline`.
    #[arg(long, conflicts_with = "torch_json")]
    pub catch: bool,
    /// With --campaign or --catch: another build's binary (`tierkv`, or `tierkv-zoo` for
    /// --catch) measured the same way in the same run.
    #[arg(long, requires = "sim_bench", conflicts_with = "cache")]
    pub baseline: Option<std::path::PathBuf>,
    /// With --campaign: the seeds, `A..B` (default 0..60). With --catch: the seeds of each
    /// mutant's first campaign (default 0..100); repeat `r` runs the next `r`-th window of the
    /// same width.
    #[arg(long, requires = "sim_bench", conflicts_with = "cache", value_parser = super::sim::parse_range)]
    pub seeds: Option<(u64, u64)>,
    /// With --campaign: worker threads; with --catch: campaigns at once, each on one thread
    /// (default: the machine's cores).
    #[arg(long, requires = "sim_bench", conflicts_with = "cache")]
    pub jobs: Option<usize>,
    /// With --campaign: the scenario profile; with --catch: the profile of every mutant but the
    /// prefill/decode ones, which run under `pd`.
    #[arg(
        long,
        requires = "sim_bench",
        conflicts_with = "cache",
        default_value = "swarm"
    )]
    pub profile: String,
    /// With --campaign: runs of each build, alternating (1..=20, default 1); the report keeps
    /// each build's run of median CPU time and lists every run's. With --catch: campaigns of
    /// each mutant and build, each on its own seeds (1..=20, default 3).
    #[arg(long, requires = "sim_bench", conflicts_with = "cache")]
    pub repeat: Option<usize>,
    /// With --catch: only these mutants (comma-separated names).
    #[arg(long, requires = "catch", value_delimiter = ',')]
    pub only: Vec<String>,
    /// With --catch: measure a guided campaign of this build (`sim --corpus`, each campaign
    /// starting from a fresh copy of this corpus file) against the plain one, in the same run.
    /// Mutants of another profile than the corpus's run plain in both.
    #[arg(long, requires = "catch", conflicts_with = "baseline")]
    pub guided: Option<std::path::PathBuf>,
    /// With --catch: measure this build's campaigns with these `sim` flags too (one argument,
    /// flags apart by spaces; e.g. `--with "--cut-share 0.5"`) against its plain ones, in the
    /// same run.
    #[arg(long, requires = "catch", conflicts_with_all = ["baseline", "guided"], allow_hyphen_values = true)]
    pub with: Option<String>,
    /// Measure the prefix cache's logic over a whole trace instead, on one core (no GPU needed):
    /// match, lock, device and host eviction, insert and write-through backup per request.
    #[arg(long, conflicts_with_all = ["torch_json", "campaign", "catch"])]
    pub cache: bool,
    /// With --cache: a Mooncake-format trace (JSON lines); default: the built-in excerpt.
    #[arg(long, requires = "cache", conflicts_with = "campaign")]
    pub trace: Option<std::path::PathBuf>,
    /// With --cache: the device tier, in 64-token pages.
    #[arg(long, requires = "cache", conflicts_with = "campaign", default_value_t = super::bench_cache::DEVICE_PAGES_DEFAULT)]
    pub device_pages: u32,
    /// With --cache: the host tier, in pages (default: as large as the trace, so nothing is
    /// evicted from it).
    #[arg(long, requires = "cache", conflicts_with = "campaign")]
    pub host_pages: Option<u32>,
}

/// `--out` can be written (checked before the bench runs).
fn check_out(args: &BenchArgs) -> Result<(), CliError> {
    match &args.out {
        Some(p) => super::sim::check_output_file(p)
            .map_err(|e| CliError::Arguments(format!("--out {}: {e}", p.display()))),
        None => Ok(()),
    }
}

/// Prints a bench's report and writes it to `--out` too; the exit code (3 when `--out` could not
/// be written).
fn emit(report: &str, out: Option<&std::path::Path>) -> i32 {
    print!("{report}");
    if let Some(out) = out {
        if let Err(e) = std::fs::write(out, report) {
            return CliError::output("--out", out, e).report();
        }
    }
    0
}

/// `--cache`: the prefix cache's logic over a trace.
fn run_cache_bench(args: &BenchArgs) -> i32 {
    let plan = super::bench_cache::Plan {
        trace: args.trace.clone(),
        device_pages: args.device_pages,
        host_pages: args.host_pages,
    };
    match super::bench_cache::run(&plan) {
        Ok(report) => emit(&report, args.out.as_deref()),
        Err(e) => CliError::Arguments(format!("cache bench: {e}")).report(),
    }
}

/// `--baseline` is an executable file (checked before any campaign runs).
fn check_baseline(args: &BenchArgs, which: &str) -> Result<(), CliError> {
    let Some(b) = &args.baseline else {
        return Ok(());
    };
    #[cfg(unix)]
    let runnable = {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(b).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    #[cfg(not(unix))]
    let runnable = b.is_file();
    if runnable {
        return Ok(());
    }
    Err(CliError::input(
        "--baseline",
        b,
        format!("not an executable file (give another build's `{which}` binary)"),
    ))
}

/// `--repeat` within 1..=20 (`default` when not given).
fn repeat(args: &BenchArgs, default: usize) -> Result<usize, CliError> {
    let r = args.repeat.unwrap_or(default);
    if !(1..=20).contains(&r) {
        return Err(CliError::Arguments(format!(
            "--repeat {r}: give 1..=20 runs"
        )));
    }
    Ok(r)
}

/// `--campaign`'s arguments, checked.
fn campaign_plan(args: &BenchArgs) -> Result<super::bench_campaign::Plan, CliError> {
    let jobs = super::sim::worker_count(args.jobs).map_err(CliError::Arguments)?;
    if !crate::scenario::PROFILES.contains(&args.profile.as_str()) || args.profile == "trace" {
        return Err(CliError::Arguments(format!(
            "--profile {}: the campaign bench takes one of {} but trace",
            args.profile,
            crate::scenario::PROFILES.join(", ")
        )));
    }
    repeat(args, 1)?;
    check_baseline(args, "tierkv")?;
    let (first, end) = args.seeds.unwrap_or((0, 60));
    Ok(super::bench_campaign::Plan {
        first,
        end,
        jobs,
        profile: args.profile.clone(),
    })
}

/// `--campaign`: the simulator's speed, this build against `--baseline`.
fn run_campaign_bench(args: &BenchArgs) -> i32 {
    let plan = match campaign_plan(args) {
        Ok(p) => p,
        Err(e) => return e.report(),
    };
    let repeat = args.repeat.unwrap_or(1);
    match super::bench_campaign::run(&plan, args.baseline.as_ref(), repeat) {
        Ok(report) => emit(&report, args.out.as_deref()),
        Err(e) => {
            eprintln!("campaign bench: {e}");
            1
        }
    }
}

/// `--only`'s mutants, or the whole zoo.
fn catch_mutants(only: &[String]) -> Result<Vec<tierkv_engine::mutants::Mutant>, CliError> {
    use tierkv_engine::mutants::Mutant;
    if only.is_empty() {
        return Ok(Mutant::ALL.to_vec());
    }
    let unknown = |n: &String| {
        CliError::Arguments(format!(
            "--only: unknown mutant `{n}`; mutants are: {}",
            Mutant::ALL.map(|m| m.name()).join(", ")
        ))
    };
    only.iter()
        .map(|n| Mutant::parse(n).ok_or_else(|| unknown(n)))
        .collect()
}

/// `--catch`'s arguments, checked: the mutants (all of the zoo, or `--only`), each with its
/// profile.
fn catch_plan(args: &BenchArgs) -> Result<super::bench_catch::Plan, CliError> {
    let jobs = super::sim::worker_count(args.jobs).map_err(CliError::Arguments)?;
    let profiles: Vec<&str> = crate::scenario::PROFILES
        .iter()
        .copied()
        .filter(|&p| !["trace", "vllm", "pd"].contains(&p))
        .collect();
    if !profiles.contains(&args.profile.as_str()) {
        return Err(CliError::Arguments(format!(
            "--profile {}: the catch bench runs the zoo under one of {}",
            args.profile,
            profiles.join(", ")
        )));
    }
    let repeat = repeat(args, 3)?;
    check_baseline(args, "tierkv-zoo")?;
    let (first, end) = args.seeds.unwrap_or((0, 100));
    let mutants = catch_mutants(&args.only)?;
    let width = end - first;
    if width
        .checked_mul(repeat as u64)
        .and_then(|w| first.checked_add(w))
        .is_none()
    {
        return Err(CliError::Arguments(format!(
            "--seeds {first}..{end} with --repeat {repeat}: the last repeat's seeds pass the largest seed"
        )));
    }
    let guided = match &args.guided {
        Some(file) => {
            let corpus = crate::corpus::Corpus::read(file)
                .map_err(|e| CliError::input("--guided", file, e))?;
            Some((file.clone(), corpus.profile))
        }
        None => None,
    };
    let with = with_flags(args.with.as_deref())?;
    // Checked last, so that a build without the mutants still checks the other arguments.
    if !cfg!(feature = "mutants") {
        return Err(CliError::NotBuilt {
            flag: "bench --catch (run the zoo's binary, tierkv-zoo)",
            feature: "mutants",
        });
    }
    let out_dir = std::env::temp_dir().join(format!("tierkv-catch-{}", std::process::id()));
    Ok(super::bench_catch::Plan {
        targets: mutants
            .into_iter()
            .map(|m| super::bench_catch::Target {
                name: m.name().to_string(),
                profile: if m.is_pd() {
                    "pd".into()
                } else {
                    args.profile.clone()
                },
            })
            .collect(),
        first,
        width,
        repeat,
        jobs,
        out_dir,
        guided,
        with,
    })
}

/// The flags the catch bench gives every campaign itself (`bench_catch::campaign`), and those
/// that do not fit a campaign that stops at its first failure on its own seeds; `--with` may
/// give none of them.
const CATCH_OWN_FLAGS: &[&str] = &[
    "--seeds",
    "--mutant",
    "--profile",
    "--jobs",
    "--out-dir",
    "--no-shrink",
    "--corpus",
];
const CATCH_UNFIT_FLAGS: &[&str] = &["--seed", "--keep-going", "--json", "--shard", "--replay"];

/// `--with`'s flags, split at spaces; refused when empty, when a flag is not one of `sim`'s, or
/// when it is one the bench sets or one that does not fit its campaigns.
fn with_flags(with: Option<&str>) -> Result<Option<Vec<String>>, CliError> {
    use clap::Args;
    let Some(with) = with else {
        return Ok(None);
    };
    let flags: Vec<String> = with.split_whitespace().map(str::to_string).collect();
    if flags.is_empty() {
        return Err(CliError::Arguments(
            "--with: give the sim flags to measure, e.g. --with \"--cut-share 0.5\"".into(),
        ));
    }
    let sim = super::sim::SimArgs::augment_args(clap::Command::new("sim"));
    let known: Vec<String> = (sim.get_arguments())
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    for f in flags.iter().filter(|f| f.starts_with('-')) {
        let name = f.split('=').next().unwrap_or(f);
        let why = if CATCH_OWN_FLAGS.contains(&name) {
            format!(
                "the catch bench sets it for every campaign ({})",
                CATCH_OWN_FLAGS.join(", ")
            )
        } else if CATCH_UNFIT_FLAGS.contains(&name) {
            format!(
                "a catch campaign runs its own seeds and stops at its first failure, so it takes none of {}",
                CATCH_UNFIT_FLAGS.join(", ")
            )
        } else if !known.iter().any(|k| k == name) {
            "it is not a flag of `tierkv sim` (`tierkv sim --help`)".to_string()
        } else {
            continue;
        };
        return Err(CliError::Arguments(format!("--with: `{f}`: {why}")));
    }
    Ok(Some(flags))
}

/// The configurations `--catch` compares, the one compared against last: this build and
/// `--baseline`, this build guided by `--guided`'s corpus and plain, or this build with
/// `--with`'s flags and plain.
fn catch_configs(
    me: std::path::PathBuf,
    args: &BenchArgs,
    plan: &super::bench_catch::Plan,
) -> Vec<super::bench_catch::Config> {
    use super::bench_catch::Config;
    if let Some(flags) = &plan.with {
        return vec![
            Config {
                name: format!("with `{}`", flags.join(" ")),
                args: flags.clone(),
                ..Config::plain(me.clone(), String::new())
            },
            Config::plain(me, "plain".into()),
        ];
    }
    match &plan.guided {
        Some((file, profile)) => vec![
            Config {
                bin: me.clone(),
                name: format!("guided by `{}`", file.display()),
                corpus: Some((file.clone(), profile.clone())),
                args: Vec::new(),
            },
            Config::plain(me, "plain".into()),
        ],
        None => std::iter::once(Config::plain(me, "this build".into()))
            .chain(
                args.baseline
                    .iter()
                    .map(|b| Config::plain(b.clone(), format!("baseline `{}`", b.display()))),
            )
            .collect(),
    }
}

/// `--catch`: CPU-seconds to the first catch of each zoo mutant, this build against
/// `--baseline`, or guided against plain (`--guided`).
fn run_catch_bench(args: &BenchArgs) -> i32 {
    let plan = match catch_plan(args) {
        Ok(p) => p,
        Err(e) => return e.report(),
    };
    if let Err(e) = std::fs::create_dir_all(&plan.out_dir) {
        return CliError::output("the campaigns' folder", &plan.out_dir, e).report();
    }
    let me = match std::env::current_exe() {
        Ok(me) => me,
        Err(e) => return CliError::Resources(format!("this executable: {e}")).report(),
    };
    let configs = catch_configs(me, args, &plan);
    let outcome = super::bench_catch::run_all(&configs, &plan);
    let _ = std::fs::remove_dir_all(&plan.out_dir);
    match outcome {
        Ok(out) => emit(
            &super::bench_catch::report(&plan, &configs, &out),
            args.out.as_deref(),
        ),
        // A campaign that could not run, or ended without an outcome: not a finding.
        Err(e) => CliError::Resources(format!("catch bench: {e}")).report(),
    }
}

#[cfg(not(feature = "cuda"))]
pub fn run_bench(args: BenchArgs) -> i32 {
    if let Err(e) = check_out(&args) {
        return e.report();
    }
    if args.campaign {
        return run_campaign_bench(&args);
    }
    if args.catch {
        return run_catch_bench(&args);
    }
    if args.cache {
        return run_cache_bench(&args);
    }
    CliError::NotBuilt {
        flag: "tierkv bench (the kernels and transfers on the GPU)",
        feature: "cuda",
    }
    .report()
}

#[cfg(feature = "cuda")]
pub fn run_bench(args: BenchArgs) -> i32 {
    if let Err(e) = check_out(&args) {
        return e.report();
    }
    if args.campaign {
        return run_campaign_bench(&args);
    }
    if args.catch {
        return run_catch_bench(&args);
    }
    if args.cache {
        return run_cache_bench(&args);
    }
    match imp::run(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("bench failed: {e}");
            1
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::BenchArgs;
    use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
    use half::bf16;
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use tierkv_engine::device::{BufferDesc, BufferId, BufferRole, MemoryTier, Op, PageCopy};
    use tierkv_engine::device::{Device, StreamKind};
    use tierkv_engine::runtime::cuda::{CopyStrategy, CudaDevice, PinnedHost};
    use tierkv_kernels::args;
    use tierkv_kernels::cpu::numerics::{e4m3_encode, mix64};
    use tierkv_kernels::cuda::launch::{
        check_index_k_store, check_index_logits, CheckedIndexLogits, DevPtr, IndexKStorePtrs,
        IndexLogitsPtrs, Kernels, LogitsKernel, LogitsTuning, TopKPtrs, TopKTuning,
    };
    use tierkv_kernels::layout::*;
    use tierkv_kernels::rope::{Rope, RopeParams};

    type R<T> = Result<T, String>;

    fn e<E: std::fmt::Display>(x: E) -> String {
        x.to_string()
    }

    struct Ctx {
        k: &'static Kernels,
        s: Arc<CudaStream>,
        reps: usize,
    }

    fn ptr(s: &Arc<CudaStream>, d: &CudaSlice<u8>) -> DevPtr {
        let (p, _g) = d.device_ptr(s);
        DevPtr {
            ptr: p,
            bytes: Bytes(d.len() as u64),
        }
    }

    impl Ctx {
        fn buf(&self, bytes: usize) -> R<CudaSlice<u8>> {
            self.s.alloc_zeros::<u8>(bytes.max(1)).map_err(e)
        }
        fn up<T: Copy>(&self, v: &[T]) -> R<CudaSlice<u8>> {
            // SAFETY: plain data viewed as bytes.
            let b = unsafe {
                std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v))
            };
            self.s.clone_htod(b).map_err(e)
        }
        /// Median milliseconds of one call of `f` alone between two events, after warm-up: its
        /// host check and launch included, as PyTorch's script times its ops.
        fn time(&self, f: impl FnMut() -> R<()>) -> R<f64> {
            self.timed(f, 1, false)
        }

        /// Milliseconds per call of `f` with [`QUEUED`] calls queued between the two events
        /// (median of the reps), the first event queued behind one call already in flight: each
        /// call's host check and launch are hidden behind the call before it, as when the engine
        /// enqueues a step's work — the kernel's own time, unless the host cannot queue calls as
        /// fast as the GPU runs them (a kernel of a few µs), when it is the host's rate.
        fn time_queued(&self, f: impl FnMut() -> R<()>) -> R<f64> {
            self.timed(f, QUEUED, true)
        }

        /// Median milliseconds per call of `calls` calls of `f` between two events, after
        /// warm-up; `behind` queues one call before the first event.
        fn timed(&self, mut f: impl FnMut() -> R<()>, calls: usize, behind: bool) -> R<f64> {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            for _ in 0..3 {
                f()?;
            }
            self.s.synchronize().map_err(e)?;
            let mut ms = Vec::new();
            for _ in 0..self.reps {
                let a = self.k.ctx.new_event(flags).map_err(e)?;
                let b = self.k.ctx.new_event(flags).map_err(e)?;
                if behind {
                    f()?;
                }
                a.record(&self.s).map_err(e)?;
                for _ in 0..calls {
                    f()?;
                }
                b.record(&self.s).map_err(e)?;
                b.synchronize().map_err(e)?;
                ms.push(a.elapsed_ms(&b).map_err(e)? as f64 / calls as f64);
            }
            ms.sort_by(|x, y| x.partial_cmp(y).unwrap());
            Ok(ms[ms.len() / 2])
        }
    }

    /// Calls queued back to back by `time_queued`.
    const QUEUED: usize = 8;

    struct Row {
        name: String,
        ms: f64,
        bytes: u64,
        note: String,
    }

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            ((mix64(s) >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        }
    }

    fn cu(r: sys::CUresult) -> R<()> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{r:?}"))
        }
    }

    /// One bench run: its measurements so far and the ceilings they are compared with.
    struct Bench {
        c: Ctx,
        rows: Vec<Row>,
        /// The tensor-core logits launch-shape sweep, as table lines.
        tuning: Vec<String>,
        /// The top-k cluster-size sweep, as table lines.
        topk_tuning: Vec<String>,
        /// Outputs that differ from the CPU reference: the table is still written (with these
        /// under it) and the bench then fails.
        mismatches: Vec<String>,
        copy_bw: f64,
        h2d_bw: f64,
        d2h_bw: f64,
    }

    /// The indexer's benchmark shape: batch 64 x 64K context, 64 heads, and its inputs on the GPU.
    struct Indexer {
        bsz: usize,
        ctx: usize,
        heads: usize,
        pt_stride: usize,
        page_table: Vec<i32>,
        lens: Vec<i32>,
        q_bytes: u64,
        w_bytes: u64,
        dev: Vec<CudaSlice<u8>>,
        out: CudaSlice<u8>,
    }

    impl Indexer {
        /// The `index_logits` launch of every row over `pool`, in `dtype`.
        fn logits_launch(
            &self,
            s: &Arc<CudaStream>,
            dtype: IndexKDtype,
            pool: &CudaSlice<u8>,
        ) -> (args::IndexLogits<'_>, IndexLogitsPtrs) {
            let [q, w, page_table, context_lens] = [0, 1, 2, 3].map(|i| ptr(s, &self.dev[i]));
            let record = args::IndexLogits {
                dtype,
                heads: self.heads as u32,
                page_table: (&self.page_table[..]).into(),
                pt_stride: self.pt_stride as u32,
                context_lens: (&self.lens[..]).into(),
                out_stride: self.ctx as u32,
            };
            let ptrs = IndexLogitsPtrs {
                q,
                w,
                page_table,
                context_lens,
                k: ptr(s, pool),
                k_fp: PageFormat::IndexK(dtype).fingerprint(),
                out: ptr(s, &self.out),
            };
            (record, ptrs)
        }
    }

    pub fn run(a: &BenchArgs) -> R<()> {
        let k = Kernels::global().map_err(e)?;
        let s = k.ctx.new_stream().map_err(e)?;
        let name = k.ctx.name().unwrap_or_default();
        println!("device: {name}");
        let mut b = Bench {
            c: Ctx { k, s, reps: a.reps },
            rows: Vec::new(),
            tuning: Vec::new(),
            topk_tuning: Vec::new(),
            mismatches: Vec::new(),
            copy_bw: 0.0,
            h2d_bw: 0.0,
            d2h_bw: 0.0,
        };
        b.ceilings()?;
        b.store()?;
        let ix = b.indexer_inputs()?;
        for dtype in IndexKDtype::ALL {
            b.logits(&ix, dtype)?;
        }
        b.topk(&ix)?;
        drop(ix);
        b.transfers()?;
        let md = b.table(&name, a)?;
        print!("{md}");
        if let Some(p) = &a.out {
            std::fs::write(p, &md).map_err(e)?;
        }
        if !b.mismatches.is_empty() {
            return Err(format!(
                "outputs differ from the CPU reference:\n{}",
                b.mismatches.join("\n")
            ));
        }
        Ok(())
    }

    impl Bench {
        /// Ceilings: a large device-to-device copy, and one large pinned copy each way.
        fn ceilings(&mut self) -> R<()> {
            let (c, s) = (&self.c, &self.c.s);
            let big = 2usize << 30;
            let (x, y) = (c.buf(big)?, c.buf(big)?);
            let (xp, yp) = (ptr(s, &x), ptr(s, &y));
            // SAFETY: both buffers are `big` bytes.
            let ms = c.time(|| {
                cu(unsafe { sys::cuMemcpyDtoDAsync_v2(yp.ptr, xp.ptr, big, s.cu_stream()) })
            })?;
            self.copy_bw = 2.0 * big as f64 / (ms * 1e-3);
            self.rows.push(Row {
                name: "device copy 2 GiB (read + write)".into(),
                ms,
                bytes: 2 * big as u64,
                note: "ceiling".into(),
            });
            drop((x, y));
            let hbytes = 1usize << 30;
            let host = PinnedHost::new(&c.k.ctx, hbytes).map_err(e)?;
            let hp = host.dev_ptr();
            let dev = c.buf(hbytes)?;
            let dp = ptr(s, &dev);
            // SAFETY: both sides are `hbytes` bytes.
            let h2d = c.time(|| {
                cu(unsafe { sys::cuMemcpyAsync(dp.ptr, hp.ptr, hbytes, s.cu_stream()) })
            })?;
            // SAFETY: as above.
            let d2h = c.time(|| {
                cu(unsafe { sys::cuMemcpyAsync(hp.ptr, dp.ptr, hbytes, s.cu_stream()) })
            })?;
            self.h2d_bw = hbytes as f64 / (h2d * 1e-3);
            self.d2h_bw = hbytes as f64 / (d2h * 1e-3);
            for (dir, ms) in [("H2D", h2d), ("D2H", d2h)] {
                self.rows.push(Row {
                    name: format!("pinned {dir} 1 GiB, one cuMemcpyAsync"),
                    ms,
                    bytes: hbytes as u64,
                    note: "transfer ceiling".into(),
                });
            }
            Ok(())
        }

        /// index_k_store of 1M tokens, each pool dtype.
        fn store(&mut self) -> R<()> {
            let (c, s, k) = (&self.c, &self.c.s, self.c.k);
            let n = 1usize << 20;
            let mut r = rng(1);
            let keys: Vec<bf16> = (0..n * 128).map(|_| bf16::from_f32(r() * 4.0)).collect();
            let rope = Rope::new(&RopeParams::deepseek_v32(131_072))
                .rows((0..n).map(|i| (i % 131_072) as u32));
            let gamma = vec![1.0f32; 128];
            let beta = vec![0.0f32; 128];
            let slots: Vec<i32> = (0..n as i32).collect();
            let ins = [
                c.up(&keys)?,
                c.up(&gamma)?,
                c.up(&beta)?,
                c.up(&rope)?,
                c.up(&slots)?,
            ];
            let [kd, gd, bd, rd, sd] = ins.each_ref().map(|d| ptr(s, d));
            for dtype in IndexKDtype::ALL {
                let fmt = PageFormat::IndexK(dtype);
                let pool = c.buf((n / 64) * fmt.page_bytes() as usize)?;
                let pp = ptr(s, &pool);
                let record = args::IndexKStore {
                    dtype,
                    ue8m0: false,
                    slots: (&slots[..]).into(),
                };
                let ptrs = IndexKStorePtrs {
                    keys: kd,
                    gamma: gd,
                    beta: bd,
                    rope: rd,
                    slots: sd,
                    dst: pp,
                    dst_fp: fmt.fingerprint(),
                };
                // The kernel alone (a launch checked once), then the launcher as the engine
                // calls it: its host check of 1M slots runs between the events too.
                let checked = check_index_k_store(&record, &ptrs).map_err(e)?;
                let ms = c.time(|| k.index_k_store_checked(s, &checked).map_err(e))?;
                let full_ms = c.time(|| k.index_k_store(s, &record, &ptrs).map_err(e))?;
                // The pool the timed runs wrote, against the CPU reference on the same inputs.
                let mut got = vec![0u8; pool.len()];
                s.memcpy_dtoh(&pool, &mut got).map_err(e)?;
                s.synchronize().map_err(e)?;
                let mut want = vec![0u8; pool.len()];
                tierkv_kernels::cpu::index_k_store(
                    &record,
                    &tierkv_kernels::cpu::IndexKStoreInputs {
                        keys: &keys,
                        gamma: &gamma,
                        beta: &beta,
                        rope: &rope,
                    },
                    &mut want,
                    fmt.fingerprint(),
                )
                .map_err(e)?;
                let exact = got == want;
                if !exact {
                    let bad = got.iter().zip(&want).filter(|(x, y)| x != y).count();
                    self.mismatches.push(format!(
                        "index_k_store {}: {bad} bytes differ from cpu::index_k_store",
                        dtype.name()
                    ));
                }
                let bytes = kd.bytes + rd.bytes + sd.bytes + pp.bytes;
                self.rows.push(Row {
                    name: format!("index_k_store 1M tokens {}", dtype.name()),
                    ms,
                    bytes: bytes.0,
                    note: if exact {
                        "keys + rope rows + slots read, pool written; bit-exact with cpu::index_k_store"
                    } else {
                        "DIFFERS from cpu::index_k_store"
                    }
                    .into(),
                });
                self.rows.push(Row {
                    name: format!(
                        "launcher (host check of 1M slots + launch), index_k_store {}",
                        dtype.name()
                    ),
                    ms: full_ms,
                    bytes: bytes.0,
                    note: "what a caller with an idle GPU waits".into(),
                });
            }
            Ok(())
        }

        fn indexer_inputs(&self) -> R<Indexer> {
            let c = &self.c;
            let (bsz, ctx, heads) = (64usize, 65_536usize, 64usize);
            let pt_stride = ctx / 64;
            let page_table: Vec<i32> = (0..(bsz * pt_stride) as i32).collect();
            let lens = vec![ctx as i32; bsz];
            let mut r = rng(2);
            let q: Vec<u8> = (0..bsz * heads * 128)
                .map(|_| e4m3_encode(r() * 200.0))
                .collect();
            let w: Vec<f32> = (0..bsz * heads).map(|_| r() * 0.01).collect();
            let dev = vec![c.up(&q)?, c.up(&w)?, c.up(&page_table)?, c.up(&lens)?];
            Ok(Indexer {
                bsz,
                ctx,
                heads,
                pt_stride,
                q_bytes: fp8_bytes(q.len() as u64).0,
                w_bytes: f32_bytes(w.len() as u64).0,
                page_table,
                lens,
                dev,
                out: c.buf(f32_bytes((bsz * ctx) as u64).usize())?,
            })
        }

        /// A pool of `pages` index-K pages of random keys (fp8 with real key scales).
        fn key_pool(&self, dtype: IndexKDtype, pages: usize) -> R<CudaSlice<u8>> {
            let fmt = PageFormat::IndexK(dtype);
            let mut r = rng(3);
            let mut host: Vec<u8> = (0..pages * fmt.page_bytes() as usize)
                .map(|i| match dtype {
                    IndexKDtype::Fp8 => e4m3_encode(r() * 400.0),
                    IndexKDtype::Bf16 => (mix64(i as u64) >> 17) as u8 & 0x3F,
                })
                .collect();
            if dtype == IndexKDtype::Fp8 {
                // Real key scales (the bytes above would read as arbitrary floats, inf and NaN).
                for (i, page) in host.chunks_exact_mut(fmt.page_bytes() as usize).enumerate() {
                    for t in 0..64u32 {
                        let at = index_k_page::scale_offset(dtype, t).expect("fp8 scales");
                        let scale =
                            0.01 * (1.0 + (mix64(i as u64 * 64 + t as u64) % 100) as f32 / 100.0);
                        page[at..at + 4].copy_from_slice(&scale.to_le_bytes());
                    }
                }
            }
            self.c.up(&host)
        }

        /// index_logits 64 x 64K, 64 heads: the exact kernel and both tensor-core kernels (the
        /// production wgmma one and the previous mma.sync one); the wgmma kernel at the decode
        /// shapes 1 x 64K and 8 x 8K (each against the exact kernel on the same input); then the
        /// tensor-core launch shapes swept. Every row times a launch whose page table was
        /// checked once (`CheckedIndexLogits`), except the launcher rows, which time the host's
        /// check of the page table with the launch.
        fn logits(&mut self, ix: &Indexer, dtype: IndexKDtype) -> R<()> {
            let s = self.c.s.clone();
            let k = self.c.k;
            let fmt = PageFormat::IndexK(dtype);
            let pool = self.key_pool(dtype, ix.page_table.len())?;
            let (record, ptrs) = ix.logits_launch(&s, dtype, &pool);
            let IndexLogitsPtrs {
                q: qd,
                w: wd,
                page_table: ptd,
                k: kp,
                out: op,
                ..
            } = ptrs;
            let run = |kind: LogitsKernel, tuning: LogitsTuning| {
                k.index_logits_with(kind, tuning, &s, &record, &ptrs)
                    .map_err(e)
            };
            let bytes = kp.bytes.0 + ix.q_bytes + ix.w_bytes + ptd.bytes.0 + op.bytes.0;
            let flops = 2.0 * (ix.bsz * ix.ctx * ix.heads * 128) as f64;
            let tflops = |ms: f64| flops / (ms * 1e-3) / 1e12;
            let def = LogitsTuning::default();
            // The page table checked once, as a caller that relaunches over the same table
            // would (the launcher's walk of the 64 x 1024 entries is its own row).
            let checked = check_index_logits(&record, &ptrs).map_err(e)?;
            let run_checked = |kind: LogitsKernel, tuning: LogitsTuning, c: &CheckedIndexLogits| {
                // SAFETY: the device page tables and context lengths are the ones the checks
                // walked (uploaded from them), nothing writes them while the bench runs, and
                // their buffers live to the end of this function.
                unsafe { k.index_logits_checked(kind, tuning, &s, c) }.map_err(e)
            };
            let exact_ms = self
                .c
                .time(|| run_checked(LogitsKernel::Exact, def, &checked))?;
            let exact = self.read_f32s(&ix.out)?;
            let mut rows = vec![(
                "exact".to_string(),
                exact_ms,
                format!("{:.1} TFLOP/s fp32 FMA", tflops(exact_ms)),
            )];
            for (kind, label) in [
                (LogitsKernel::TensorCore, "wgmma"),
                (LogitsKernel::Mma, "mma.sync"),
            ] {
                let ms = self.c.time(|| run_checked(kind, def, &checked))?;
                let worst = worst_relative(&exact, &self.read_f32s(&ix.out)?)
                    .map_err(|m| format!("index_logits {label} {}: {m}", dtype.name()))?;
                rows.push((
                    format!("tensor-core ({label})"),
                    ms,
                    format!(
                        "{:.1} TFLOP/s {label}, one launch of a checked page table; max |Δ| vs exact {worst:.1e} of the largest logit",
                        tflops(ms)
                    ),
                ));
                let launcher = self.c.time(|| run(kind, def))?;
                rows.push((
                    format!(
                        "tensor-core ({label}) launcher (host check of the page table + launch),"
                    ),
                    launcher,
                    "what a caller that checks every launch waits".to_string(),
                ));
                let queued = self.c.time_queued(|| run_checked(kind, def, &checked))?;
                rows.push((
                    format!("tensor-core ({label}), {QUEUED} queued back to back,"),
                    queued,
                    format!(
                        "per launch; {:.1} TFLOP/s; one launch alone {ms:.3} ms",
                        tflops(queued)
                    ),
                ));
            }
            for (kind, ms, note) in rows {
                let name = match kind.strip_prefix("launcher ") {
                    Some(rest) => format!(
                        "launcher {rest} index_logits 64 x 64K, 64 heads, {}",
                        dtype.name()
                    ),
                    None => format!("index_logits {kind} 64 x 64K, 64 heads, {}", dtype.name()),
                };
                self.rows.push(Row {
                    name,
                    ms,
                    bytes,
                    note,
                });
            }
            // The decode shapes, on the first rows of the same inputs (the same page table, so
            // each row's first pages).
            for (rows, ctx) in [(1usize, 65_536usize), (8, 8192)] {
                let lens = vec![ctx as i32; rows];
                let lens_dev = self.c.up(&lens)?;
                let pages = rows * ctx / 64;
                let (qb, wb) = (ix.q_bytes / ix.bsz as u64, ix.w_bytes / ix.bsz as u64);
                let out_bytes = f32_bytes((rows * ctx) as u64);
                let small_record = args::IndexLogits {
                    page_table: (&ix.page_table[..rows * ix.pt_stride]).into(),
                    context_lens: (&lens[..]).into(),
                    out_stride: ctx as u32,
                    ..record.clone()
                };
                let small_ptrs = IndexLogitsPtrs {
                    q: qd.offset(Bytes(0), Bytes(qb * rows as u64)),
                    w: wd.offset(Bytes(0), Bytes(wb * rows as u64)),
                    page_table: ptd.offset(Bytes(0), i32_bytes((rows * ix.pt_stride) as u64)),
                    context_lens: ptr(&s, &lens_dev),
                    out: op.offset(Bytes(0), out_bytes),
                    ..ptrs
                };
                let n = rows * ctx;
                let small = check_index_logits(&small_record, &small_ptrs).map_err(e)?;
                let exact_ms = self
                    .c
                    .time(|| run_checked(LogitsKernel::Exact, def, &small))?;
                let exact = self.read_f32s(&ix.out)?;
                let ms = self
                    .c
                    .time(|| run_checked(LogitsKernel::TensorCore, def, &small))?;
                let queued = self
                    .c
                    .time_queued(|| run_checked(LogitsKernel::TensorCore, def, &small))?;
                let got = self.read_f32s(&ix.out)?;
                let worst = worst_relative(&exact[..n], &got[..n])
                    .map_err(|m| format!("index_logits {rows} x {ctx} {}: {m}", dtype.name()))?;
                let shape = format!("{rows} x {}K", ctx / 1024);
                self.rows.push(Row {
                    name: format!(
                        "index_logits tensor-core (wgmma) {shape}, 64 heads, {}",
                        dtype.name()
                    ),
                    ms,
                    bytes: pages as u64 * fmt.page_bytes()
                        + qb * rows as u64
                        + wb * rows as u64
                        + i32_bytes(pages as u64).0
                        + out_bytes.0,
                    note: format!(
                        "decode shape; exact kernel {exact_ms:.3} ms; max |Δ| vs exact {worst:.1e} of the largest logit; {QUEUED} queued back to back: {queued:.4} ms per launch (at this size the host's launch rate may set it)"
                    ),
                });
            }
            // The tensor-core launch shapes: the wgmma kernel's CTAs per launch (0 = two per
            // multiprocessor); the mma.sync kernel's CTAs x L2 prefetch distance.
            let shapes = [
                (LogitsKernel::TensorCore, 132usize, 0usize),
                (LogitsKernel::TensorCore, 0, 0),
                (LogitsKernel::TensorCore, 528, 0),
                (LogitsKernel::TensorCore, 1056, 0),
                (LogitsKernel::TensorCore, 2112, 0),
                (LogitsKernel::Mma, 1056, 2),
                (LogitsKernel::Mma, 2112, 0),
                (LogitsKernel::Mma, 2112, 2),
            ];
            for (kind, ctas, ahead) in shapes {
                let ms = self
                    .c
                    .time(|| run_checked(kind, LogitsTuning { ctas, ahead }, &checked))?;
                let bw = bytes as f64 / (ms * 1e-3);
                let label = if kind == LogitsKernel::Mma {
                    "mma.sync"
                } else {
                    "wgmma"
                };
                self.tuning.push(format!(
                    "| {} | {label} | {ctas} | {ahead} | {ms:.4} | {:.0} | {:.0}% |",
                    dtype.name(),
                    bw / 1e9,
                    100.0 * bw / self.copy_bw
                ));
            }
            Ok(())
        }

        fn read_f32s(&self, d: &CudaSlice<u8>) -> R<Vec<f32>> {
            let mut host = vec![0u8; d.len()];
            self.c.s.memcpy_dtoh(d, &mut host).map_err(e)?;
            self.c.s.synchronize().map_err(e)?;
            Ok(tierkv_kernels::cpu::numerics::le_f32s(&host))
        }

        /// top-k over the logits of the last `logits` run: 64 rows at k = 512 and 2048 and one
        /// row at k = 2048 in the default launch shape, then the cluster size swept. Every
        /// output is compared with `cpu::topk` on the same logits.
        fn topk(&mut self, ix: &Indexer) -> R<()> {
            let host = self.read_f32s(&ix.out)?;
            let (op, ptd, ld) = (
                ptr(&self.c.s, &ix.out),
                ptr(&self.c.s, &ix.dev[2]),
                ptr(&self.c.s, &ix.dev[3]),
            );
            let row_bytes = f32_bytes(ix.ctx as u64);
            let one = (
                op.offset(Bytes(0), row_bytes),
                ptd.offset(Bytes(0), i32_bytes(ix.pt_stride as u64)),
                ld.offset(Bytes(0), i32_bytes(1)),
            );
            for (rows, topk) in [(ix.bsz, 512usize), (ix.bsz, 2048), (1, 2048)] {
                let (lp, pp, lens_dev) = if rows == 1 { one } else { (op, ptd, ld) };
                let sel = self.c.buf(i32_bytes((rows * topk) as u64).usize())?;
                let sp = ptr(&self.c.s, &sel);
                let record = args::TopK {
                    k: topk as u32,
                    stride: ix.ctx as u32,
                    context_lens: (&ix.lens[..rows]).into(),
                    page_table: (&ix.page_table[..rows * ix.pt_stride]).into(),
                    pt_stride: ix.pt_stride as u32,
                };
                let ptrs = TopKPtrs {
                    logits: lp,
                    context_lens: lens_dev,
                    page_table: pp,
                    out: sp,
                };
                let mut want = vec![0i32; rows * topk];
                tierkv_kernels::cpu::topk(&record, &host[..rows * ix.ctx], &mut want).map_err(e)?;
                let shapes = if topk == 2048 {
                    vec![None, Some(1), Some(2), Some(4), Some(8)]
                } else {
                    vec![None]
                };
                for cluster in shapes {
                    let tuning = TopKTuning { cluster };
                    let (k, s) = (self.c.k, self.c.s.clone());
                    let ms = self
                        .c
                        .time(|| k.topk_with(tuning, &s, &record, &ptrs).map_err(e))?;
                    let queued = self
                        .c
                        .time_queued(|| k.topk_with(tuning, &s, &record, &ptrs).map_err(e))?;
                    let got = self.read_i32s(&sel)?;
                    let equal = got == want;
                    if !equal {
                        let bad = got.iter().zip(&want).filter(|(x, y)| x != y).count();
                        self.mismatches.push(format!(
                            "topk {rows} x 64K k={topk} {tuning:?}: {bad} of {} slots differ \
                             from cpu::topk",
                            want.len()
                        ));
                    }
                    let verdict = if equal {
                        "equal to cpu::topk"
                    } else {
                        "DIFFERS from cpu::topk"
                    };
                    let bytes = (lp.bytes + sp.bytes).0;
                    match cluster {
                        None => self.rows.push(Row {
                            name: format!("topk k={topk}, {rows} x 64K"),
                            ms,
                            bytes,
                            note: format!(
                                "{verdict}; {QUEUED} queued back to back: {queued:.4} ms per launch"
                            ),
                        }),
                        Some(c) => self.topk_tuning.push(format!(
                            "| {rows} x 64K | {topk} | {c} | {ms:.4} | {queued:.4} | {verdict} |"
                        )),
                    }
                }
            }
            Ok(())
        }

        fn read_i32s(&self, d: &CudaSlice<u8>) -> R<Vec<i32>> {
            let mut host = vec![0u8; d.len()];
            self.c.s.memcpy_dtoh(d, &mut host).map_err(e)?;
            self.c.s.synchronize().map_err(e)?;
            Ok(tierkv_kernels::cpu::numerics::le_i32s(&host))
        }

        /// Page transfers of one 128K-token layer (2048 pages of KV + index-K), each way, with
        /// both copy strategies, for scattered and contiguous pages.
        fn transfers(&mut self) -> R<()> {
            let layout = Layout::new(LayoutParams {
                layers: 1,
                layer_base: 0,
                index_n_heads: 64,
                index_k_dtype: IndexKDtype::Fp8,
                kv_dtype: KvDtype::Fp8Packed,
                device_pages: 2048,
                host_pages: 4096,
                host_layout: HostLayout::LayerFirst,
            })
            .map_err(e)?;
            let mut perm: Vec<u32> = (0..4096).collect();
            for i in (1..perm.len()).rev() {
                let j = (mix64(i as u64 ^ 77) % (i as u64 + 1)) as usize;
                perm.swap(i, j);
            }
            let scattered: Vec<(PageId, PageId)> = (0..2048)
                .map(|d| (PageId(perm[d as usize]), PageId(d)))
                .collect();
            let contiguous: Vec<(PageId, PageId)> =
                (0..2048).map(|d| (PageId(d), PageId(d))).collect();
            let mut bufs = TransferBufs::new(&layout)?;
            for (label, pairs) in [("scattered", &scattered), ("contiguous", &contiguous)] {
                for to_device in [true, false] {
                    for strategy in [CopyStrategy::MemcpyRuns, CopyStrategy::Gather] {
                        self.transfer(&mut bufs, &layout, label, pairs, to_device, strategy)?;
                    }
                }
            }
            Ok(())
        }

        fn transfer(
            &mut self,
            bufs: &mut TransferBufs,
            layout: &Layout,
            label: &str,
            pairs: &[(PageId, PageId)],
            to_device: bool,
            strategy: CopyStrategy,
        ) -> R<()> {
            bufs.dev.strategy = strategy;
            let list: Vec<Op> = BufferKind::ALL
                .iter()
                .enumerate()
                .map(|(i, &kind)| {
                    let (host, dev) = (BufferId(2 * i as u32), BufferId(2 * i as u32 + 1));
                    let hv = layout.host_layer_view(kind, LayerId(0));
                    let dv = layout.device_layer_view(kind);
                    let (src, src_view, dst, dst_view, runs) = if to_device {
                        (host, hv, dev, dv, coalesce_runs(pairs))
                    } else {
                        let back: Vec<_> = pairs.iter().map(|&(h, d)| (d, h)).collect();
                        (dev, dv, host, hv, coalesce_runs(&back))
                    };
                    Op::PageCopy(PageCopy {
                        src,
                        src_view,
                        dst,
                        dst_view,
                        runs,
                    })
                })
                .collect();
            let runs: usize = list
                .iter()
                .map(|o| match o {
                    Op::PageCopy(p) => p.runs.len(),
                    _ => 0,
                })
                .sum();
            // Timed on the device's compute stream, where the runtime queues the copies.
            let c = Ctx {
                k: self.c.k,
                s: bufs.dev.stream(StreamKind::Compute).clone(),
                reps: self.c.reps,
            };
            let dev = &mut bufs.dev;
            let ms = c.time(|| {
                for op in &list {
                    dev.enqueue(StreamKind::Compute, op.clone()).map_err(e)?;
                }
                Ok(())
            })?;
            let ceiling = if to_device { self.h2d_bw } else { self.d2h_bw };
            let dir = if to_device {
                "host→device"
            } else {
                "device→host"
            };
            self.rows.push(Row {
                name: format!("page transfer 128K-token layer, {label}, {dir} , {strategy:?}"),
                ms,
                bytes: bufs.moved,
                note: format!(
                    "{runs} runs; {:.0}% of one large pinned copy",
                    100.0 * bufs.moved as f64 / (ms * 1e-3) / ceiling
                ),
            });
            Ok(())
        }

        /// The results table, with PyTorch beside it where the script measured the same
        /// operation.
        fn table(&self, name: &str, a: &BenchArgs) -> R<String> {
            // The largest `--torch-json` read, in bytes (the script writes a line per operation).
            const TORCH_JSON_BYTES_MAX: u64 = 1 << 20;
            let torch: BTreeMap<String, f64> = match &a.torch_json {
                Some(p) => tierkv_engine::input::read_text(p, TORCH_JSON_BYTES_MAX)
                    .map_err(e)?
                    .lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .filter_map(|v| Some((v["name"].as_str()?.to_string(), v["ms"].as_f64()?)))
                    .collect(),
                None => BTreeMap::new(),
            };
            let mut md = format!(
                "device: {name}; device copy bandwidth {:.0} GB/s (read + write); pinned H2D {:.1} GB/s, D2H {:.1} GB/s\n\n",
                self.copy_bw / 1e9,
                self.h2d_bw / 1e9,
                self.d2h_bw / 1e9
            );
            md.push_str("| operation | time ms | GB/s | vs device copy | PyTorch ms | vs PyTorch | note |\n|---|---:|---:|---:|---:|---:|---|\n");
            for row in &self.rows {
                let bw = row.bytes as f64 / (row.ms * 1e-3);
                let (tms, speed) = match torch_key(&row.name).and_then(|k| torch.get(k)) {
                    Some(t) => (format!("{t:.3}"), format!("{:.2}x", t / row.ms)),
                    None => ("-".into(), "-".into()),
                };
                md.push_str(&format!(
                    "| {} | {:.3} | {:.0} | {:.0}% | {} | {} | {} |\n",
                    row.name,
                    row.ms,
                    bw / 1e9,
                    100.0 * bw / self.copy_bw,
                    tms,
                    speed,
                    row.note
                ));
            }
            md.push_str("\nTop-k launch shape (CTAs per row, one thread-block cluster):\n\n| rows | k | CTAs per row | ms | ms, 8 queued | output |\n|---|---:|---:|---:|---:|---|\n");
            for t in &self.topk_tuning {
                md.push_str(t);
                md.push('\n');
            }
            md.push_str("\nTensor-core logits launch shape (64 x 64K, 64 heads; CTAs 0 = the kernel's default):\n\n| dtype | kernel | CTAs | L2 prefetch ahead | ms | GB/s | vs device copy |\n|---|---|---:|---:|---:|---:|---:|\n");
            for t in &self.tuning {
                md.push_str(t);
                md.push('\n');
            }
            Ok(md)
        }
    }

    /// The largest difference between the exact and the tensor-core logits of one input,
    /// relative to the largest logit (the conformance test checks the real bound); an error when
    /// any logit is not finite.
    fn worst_relative(exact: &[f32], tensor: &[f32]) -> Result<f32, String> {
        let top = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
        // NaN anywhere makes `worst` NaN (f32::max would skip it).
        let worst = exact.iter().zip(tensor).fold(0f32, |m, (a, b)| {
            let d = if a == b { 0.0 } else { (a - b).abs() };
            if d.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        });
        if !top.is_finite() || !worst.is_finite() {
            return Err(format!(
                "non-finite logits (largest {top}, worst difference {worst})"
            ));
        }
        Ok(worst / top)
    }

    /// A host mirror and a device layer per buffer kind, for the transfer benchmark: buffer
    /// `2i` is kind `i`'s mirror, `2i + 1` its device layer.
    struct TransferBufs {
        /// The runtime on GPU 0, holding a host mirror and a device layer per kind (buffers
        /// `2i` and `2i + 1`).
        dev: CudaDevice,
        /// Bytes one transfer of the 2048 pages moves over both kinds.
        moved: u64,
    }

    impl TransferBufs {
        fn new(layout: &Layout) -> R<TransferBufs> {
            let mut dev = CudaDevice::new(CopyStrategy::default()).map_err(e)?;
            let mut moved = 0;
            for kind in BufferKind::ALL {
                moved += 2048 * layout.page_bytes(kind).0;
                dev.alloc(BufferDesc {
                    role: BufferRole::Mirror { kind },
                    tier: MemoryTier::PinnedHost,
                    bytes: layout.host_bytes(kind),
                    fingerprint: layout.fingerprint(kind),
                })
                .map_err(e)?;
                dev.alloc(BufferDesc {
                    role: BufferRole::Pool {
                        kind,
                        layer: LayerId(0),
                    },
                    tier: MemoryTier::Device,
                    bytes: layout.device_layer_bytes(kind),
                    fingerprint: layout.fingerprint(kind),
                })
                .map_err(e)?;
            }
            Ok(TransferBufs { dev, moved })
        }
    }

    /// The name the PyTorch script uses for the same operation.
    fn torch_key(name: &str) -> Option<&'static str> {
        Some(match name {
            // PyTorch's script times one call alone: compared with tierkv's one call alone.
            n if n.contains("queued") => return None,
            n if n.contains("launcher") => return None,
            n if n.starts_with("device copy") => "device copy",
            n if n.starts_with("index_k_store 1M tokens fp8") => "index_k_store fp8",
            n if n.starts_with("index_k_store 1M tokens bf16") => "index_k_store bf16",
            n if n.starts_with("index_logits") && n.contains(" 64 x 64K") && n.ends_with("fp8") => {
                "index_logits fp8"
            }
            n if n.starts_with("index_logits")
                && n.contains(" 64 x 64K")
                && n.ends_with("bf16") =>
            {
                "index_logits bf16"
            }
            n if n.starts_with("topk k=512, 64 x") => "topk 512",
            n if n.starts_with("topk k=2048, 64 x") => "topk 2048",
            n if n.starts_with("topk k=2048, 1 x") => "topk 2048 batch1",
            n if n.contains("scattered") && n.contains("host→device") && n.contains("Gather") => {
                "page transfer scattered h2d"
            }
            n if n.contains("scattered") && n.contains("device→host") && n.contains("Gather") => {
                "page transfer scattered d2h"
            }
            _ => return None,
        })
    }
}
