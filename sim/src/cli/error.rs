//! What a `tierkv` command refuses, or fails to do, by kind. Each kind has one exit code
//! ([`CliError::exit_code`]); `--help` lists them ([`super::EXIT_CODES`]). The texts are held by
//! snapshot tests (`tests.rs` beside this file), one or more per kind.
//!
//! Findings of a campaign or a replay are not errors: they are its result (exit code 1).

use std::path::Path;

use crate::shard::MergeError;

/// A refusal or a failure of the command line, by kind.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Arguments that are out of range, conflict with each other, or would do nothing here.
    /// The text names the flag or value involved and, where there is one, what to do instead.
    #[error("{0}")]
    Arguments(String),
    /// A flag this build cannot honour: it needs a cargo feature the binary was built without.
    #[error("{flag} needs a build with `--features {feature}`")]
    NotBuilt {
        flag: &'static str,
        feature: &'static str,
    },
    /// The build has CUDA, the machine has no usable CUDA device (or driver).
    #[error("{flag}: no usable CUDA device: {detail}")]
    NoDevice { flag: &'static str, detail: String },
    /// A configuration (a file or a preset) that does not load or does not validate.
    #[error("{0}")]
    Config(String),
    /// An input file the command reads (a trace, a scenario, a schedule, a recording of vLLM's
    /// calls) that cannot be read or does not hold what it should.
    #[error("{flag} {path}: {detail}")]
    Input {
        flag: &'static str,
        path: String,
        detail: String,
    },
    /// What the command would need of the machine (memory, a port, threads) is not there.
    #[error("{0}")]
    Resources(String),
    /// `campaign merge` refused its shard results.
    #[error("tierkv campaign merge: {0}")]
    Merge(#[from] MergeError),
    /// An output (a file, stdout) could not be written.
    #[error("{flag} {path}: {detail}")]
    Output {
        flag: &'static str,
        path: String,
        detail: String,
    },
}

impl CliError {
    /// The exit code of this kind: 3 when an output could not be written, 2 for every refusal
    /// of the input (arguments, configuration, files, the machine's resources).
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Output { .. } => 3,
            CliError::Arguments(_)
            | CliError::NotBuilt { .. }
            | CliError::NoDevice { .. }
            | CliError::Config(_)
            | CliError::Input { .. }
            | CliError::Resources(_)
            | CliError::Merge(_) => 2,
        }
    }

    /// An input file refused: `flag path: detail`.
    pub fn input(flag: &'static str, path: &Path, detail: impl std::fmt::Display) -> CliError {
        CliError::Input {
            flag,
            path: path.display().to_string(),
            detail: detail.to_string(),
        }
    }

    /// A trace `flag` names refused: `flag path: detail`, the path said once (the trace reader's
    /// texts carry it too).
    pub fn trace(flag: &'static str, path: &Path, e: tierkv_engine::trace::TraceError) -> CliError {
        use tierkv_engine::trace::TraceError;
        match e {
            TraceError::InFile { error, .. } => CliError::input(flag, path, error),
            TraceError::Empty { .. } => CliError::input(flag, path, "the trace holds no request"),
            TraceError::Io { reason, .. } => {
                CliError::input(flag, path, format!("could not read it: {reason}"))
            }
            e => CliError::input(flag, path, e),
        }
    }

    /// An output not written: `flag path: detail`.
    pub fn output(flag: &'static str, path: &Path, detail: impl std::fmt::Display) -> CliError {
        CliError::Output {
            flag,
            path: path.display().to_string(),
            detail: detail.to_string(),
        }
    }

    /// Prints the error on stderr and answers its exit code.
    pub fn report(self) -> i32 {
        eprintln!("{self}");
        self.exit_code()
    }
}

/// Why a scenario file's text is not a scenario `--replay` can run.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioFileError {
    #[error("not a scenario: {0}")]
    NotJson(serde_json::Error),
    #[error("invalid scenario: {0}")]
    Invalid(crate::scenario::ScenarioError),
    /// Its mutant is unknown, or this build has no bug zoo.
    #[error("{0}")]
    Mutant(String),
}

#[cfg(test)]
mod tests;
