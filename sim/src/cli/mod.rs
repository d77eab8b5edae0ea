//! The `tierkv` CLI: `check-config`, the simulator's campaigns and their merge, the zoo, the
//! GPU bench and the trace replay.
//!
//! Exit codes ([`EXIT_CODES`]; the kinds of refusal in [`error::CliError`]): 0 success; 1 a
//! campaign found failures, or a replay or bench failed once started; 2 refused before any work;
//! 3 an output could not be written once the work was done; 128 + the signal (130, 143) a
//! campaign stopped by SIGINT or SIGTERM, after printing and writing what ended.

use clap::{Parser, Subcommand};
use error::CliError;
use std::path::PathBuf;
use tierkv_engine::config::Config;

pub mod bench;
pub mod bench_cache;
pub mod bench_campaign;
pub mod bench_catch;
pub mod campaign;
mod check_config;
pub mod data;
pub mod error;
pub mod replay;
pub mod replay_pd;
pub mod sim;
pub mod zoo;

/// The exit codes, as `--help` prints them.
pub const EXIT_CODES: &str = "Exit codes:\n  0  success (a campaign or seed: no findings)\n  1  a campaign or seed found failures, or a replay or bench failed once started\n  2  refused before any work: arguments, a configuration, an input file (trace, scenario,\n     schedule, result, recording), a feature this build lacks, no usable GPU, not enough\n     memory, a port in use, an output path that cannot be written\n  3  an output could not be written once the work was done (a full disk; output into a closed\n     pipe ends the process by SIGPIPE instead, as any Unix tool's)\n  130, 143  a campaign stopped by SIGINT or SIGTERM, after printing and writing (--json) the seeds that ended";

#[derive(Parser, Debug)]
#[command(
    name = "tierkv",
    version = concat!(env!("CARGO_PKG_VERSION"), " (source ", env!("TIERKV_SOURCE_ID"), ")"),
    about = "tierkv: tiered KV-cache engine for sparse-attention LLM serving, and its deterministic simulator",
    after_help = EXIT_CODES
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process; the `sim` arguments being larger than the others costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Validate a configuration and print its derived layout (exit code 2 when invalid).
    CheckConfig {
        /// A TOML or JSON configuration file (default: the built-in `sim-small` preset).
        file: Option<PathBuf>,
        /// A built-in preset instead of a file.
        #[arg(long, conflicts_with = "file")]
        preset: Option<String>,
        /// Print the configuration as a TOML file to start from, every key documented.
        #[arg(long)]
        emit_toml: bool,
        /// Check a prefill/decode pair: this configuration is the prefill engine's, FILE the
        /// decode engine's; their layout handshake must agree (exit 2, naming every differing
        /// field, if not).
        #[arg(long, value_name = "FILE", conflicts_with = "emit_toml")]
        pd_decode: Option<PathBuf>,
    },
    /// Run the deterministic simulator: one seed, a campaign, or a saved scenario.
    Sim(sim::SimArgs),
    /// Work with the results of campaigns spread over machines (`tierkv sim --shard I/N --json
    /// FILE` on each).
    #[command(subcommand)]
    Campaign(campaign::CampaignCommand),
    /// Run every bug-zoo mutant through seeded campaigns (the `tierkv-zoo` binary, built with
    /// `--features mutants`). Hidden from the plain binary's help, which refuses it.
    #[command(hide = cfg!(not(feature = "mutants")))]
    Zoo(zoo::ZooArgs),
    /// Time the kernels and page transfers on the GPU (needs `--features cuda`); with
    /// `--campaign` the simulator's campaign speed, with `--cache` the prefix cache's logic over
    /// a trace (any build).
    Bench(bench::BenchArgs),
    /// Replay a Mooncake trace through the production service (tokio intake, /metrics).
    Replay(replay::ReplayArgs),
}

/// Loads a configuration from a file or a preset (the default preset when neither is given).
pub fn load_config(file: Option<&PathBuf>, preset: Option<&str>) -> Result<Config, CliError> {
    let loaded = match (file, preset) {
        (Some(f), _) => Config::from_file(f).map_err(|e| match e {
            tierkv_engine::ConfigError::Io { .. } => e.to_string(),
            _ => format!("invalid configuration {}: {e}", f.display()),
        }),
        (None, Some(p)) => Config::preset(p).map_err(|e| e.to_string()),
        (None, None) => Config::preset(Config::DEFAULT_PRESET).map_err(|e| e.to_string()),
    };
    loaded.map_err(CliError::Config)
}

/// The kernels on GPU `ordinal`, or why `flag` cannot have them: [`CliError::NotBuilt`] in a
/// build without CUDA (the kernels' stand-in answers so), [`CliError::NoDevice`] on a machine
/// without a usable device of that number. The one place the command line asks for a GPU.
pub fn cuda_kernels(
    flag: &'static str,
    ordinal: usize,
) -> Result<&'static tierkv_kernels::cuda::launch::Kernels, CliError> {
    use tierkv_kernels::KernelError;
    tierkv_kernels::cuda::launch::Kernels::on(ordinal).map_err(|e| match e {
        KernelError::BuiltWithoutCuda { .. } => CliError::NotBuilt {
            flag,
            feature: "cuda",
        },
        e => CliError::NoDevice {
            flag,
            detail: format!("GPU {ordinal}: {e}"),
        },
    })
}

/// Restores the default action of SIGPIPE, which the Rust runtime ignores: output into a closed
/// pipe (`tierkv check-config --emit-toml | head`) then ends the process quietly, as it does any
/// Unix tool, instead of making `println!` panic.
fn default_sigpipe() {
    #[cfg(unix)]
    // SAFETY: sets a signal's disposition to its default; no handler runs Rust code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// A full disk makes `println!` (or `eprintln!`) panic: that becomes a one-line error (none
/// when stderr is what failed) and exit code 3, not a panic report. (A standard stream closed
/// before the start, `>&-`, is one Rust's standard library writes nothing to without an error;
/// a closed pipe ends the process by SIGPIPE, see `default_sigpipe`.) Every other panic reports
/// as usual.
fn output_errors_exit() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if let Some(why) = msg.strip_prefix("failed printing to stdout: ") {
            eprintln!("tierkv: could not write the output: {why}");
            std::process::exit(3);
        }
        // stderr itself failed (a full device): nothing can be said; the exit code says it.
        if msg.starts_with("failed printing to stderr: ") {
            std::process::exit(3);
        }
        default(info);
    }));
}

pub fn main() -> i32 {
    default_sigpipe();
    output_errors_exit();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    match cli.command {
        Command::CheckConfig {
            file,
            preset,
            emit_toml,
            pd_decode,
        } => match pd_decode {
            Some(decode) => check_config::run_pd(file.as_ref(), preset.as_deref(), &decode),
            None => check_config::run(file.as_ref(), preset.as_deref(), emit_toml),
        },
        Command::Sim(args) => sim::run_sim(args),
        Command::Campaign(cmd) => campaign::run_campaign_command(cmd),
        Command::Zoo(args) => zoo::run_zoo(args),
        Command::Bench(args) => bench::run_bench(args),
        Command::Replay(args) => replay::run_replay(args),
    }
}
