//! Reading a user's input file (a configuration, a trace, a scenario, a schedule, a campaign
//! result): a regular file only, and at most a stated number of bytes. A FIFO whose writer never
//! closes would block the reader for ever, and a device such as `/dev/zero` never ends; neither
//! is refused by a size limit alone, so both are refused before they are read.

use std::io::Read;
use std::path::Path;

/// The largest configuration file read (a configuration is a few kilobytes).
pub const CONFIG_BYTES_MAX: u64 = 1 << 20;
/// The largest trace read (Mooncake's published traces are 1–3 MB).
pub const TRACE_BYTES_MAX: u64 = 256 << 20;

/// Why an input file was not read; the text names the limit or the kind of file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("{0}")]
    Io(String),
    #[error("not a regular file (a FIFO, a device or a directory): give a file")]
    NotAFile,
    #[error("larger than {max} bytes")]
    TooLarge { max: u64 },
}

/// The text of regular file `path`, if it holds at most `max` bytes of UTF-8.
pub fn read_text(path: &Path, max: u64) -> Result<String, InputError> {
    let io = |e: std::io::Error| InputError::Io(e.to_string());
    // Follows symbolic links: a link to a regular file is one.
    if !std::fs::metadata(path).map_err(io)?.is_file() {
        return Err(InputError::NotAFile);
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(max + 1).read_to_string(&mut text))
        .map_err(io)?;
    if text.len() as u64 > max {
        return Err(InputError::TooLarge { max });
    }
    Ok(text)
}
