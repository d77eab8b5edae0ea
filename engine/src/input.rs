//! Reading a user's input file (a configuration, a trace, a scenario, a schedule, a campaign
//! result): a regular file only, and at most a stated number of bytes. A FIFO whose writer never
//! closes would block its reader for ever, and a device or a pipe is no file to size; so the
//! path is opened without blocking and refused unless what was opened is a regular file (a
//! process substitution such as `<(...)` or `/dev/stdin` from a pipe is refused too: write the
//! input to a file).

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The largest configuration file read, in bytes (a configuration is a few kilobytes).
pub const CONFIG_BYTES_MAX: u64 = 1 << 20;
/// The largest trace read, in bytes (Mooncake's published traces are 1–3 MB).
pub const TRACE_BYTES_MAX: u64 = 256 << 20;

/// `O_NONBLOCK` of Linux: opening a FIFO for reading does not wait for a writer.
const O_NONBLOCK: i32 = 0o4000;

/// Why an input file was not read; the text names the limit or the kind of file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("{0}")]
    Io(String),
    #[error("not a regular file (a FIFO, a pipe, a device or a directory): give a file")]
    NotAFile,
    #[error("larger than {bytes_max} bytes")]
    TooLarge { bytes_max: u64 },
}

/// The text of regular file `path`, if it holds at most `bytes_max` bytes of UTF-8. The kind of
/// file is judged on what was opened (symbolic links followed), so a path swapped between a
/// check and the open cannot make it block.
pub fn read_text(path: &Path, bytes_max: u64) -> Result<String, InputError> {
    let io = |e: std::io::Error| InputError::Io(e.to_string());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    if !file.metadata().map_err(io)?.is_file() {
        return Err(InputError::NotAFile);
    }
    let mut text = String::new();
    file.take(bytes_max + 1)
        .read_to_string(&mut text)
        .map_err(io)?;
    if text.len() as u64 > bytes_max {
        return Err(InputError::TooLarge { bytes_max });
    }
    Ok(text)
}
