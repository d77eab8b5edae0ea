//! Mooncake-format request traces (DESIGN §6): JSON lines with `timestamp` (ms from start),
//! `input_length` and `output_length` (tokens), and `hash_ids`, one id per 512-token block of the
//! prompt, where equal ids mean an equal prefix. Block ids become token pages deterministically:
//! block `h` holds tokens `token(h, 0..512)`, i.e. eight 64-token pages, so two prompts share cache
//! pages exactly where their traces share blocks.

use crate::synth::Synth;
use serde_json::Value;

pub mod cache_replay;

/// Tokens per trace block.
pub const BLOCK_TOKENS: u32 = 512;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    /// 1-based line number in the source.
    pub line: usize,
    pub timestamp_ms: u64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    #[error("could not read {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("line {line}: not valid JSON: {message}")]
    Json { line: usize, message: String },
    #[error("line {line}: missing field `{field}`")]
    Missing { line: usize, field: &'static str },
    #[error("line {line}: `{field}`: {reason}")]
    Invalid {
        line: usize,
        field: &'static str,
        reason: String,
    },
    #[error(
        "line {line}: timestamp {timestamp_ms} ms is earlier than line {previous_line}'s \
         {previous_ms} ms (a trace lists its requests in arrival order)"
    )]
    OutOfOrder {
        line: usize,
        timestamp_ms: u64,
        previous_line: usize,
        previous_ms: u64,
    },
    #[error("{path}: the trace holds no request")]
    Empty { path: String },
    /// An error of a file's contents, with the file's name.
    #[error("{path}: {error}")]
    InFile {
        path: String,
        error: Box<TraceError>,
    },
}

fn uint(
    obj: &serde_json::Map<String, Value>,
    line: usize,
    field: &'static str,
) -> Result<u64, TraceError> {
    let v = obj.get(field).ok_or(TraceError::Missing { line, field })?;
    v.as_u64().ok_or_else(|| TraceError::Invalid {
        line,
        field,
        reason: match v.as_i64() {
            Some(n) if n < 0 => format!("{n} is negative"),
            _ => format!("expected a non-negative integer, found {v}"),
        },
    })
}

/// Parses one record.
pub fn parse_line(text: &str, line: usize) -> Result<TraceRecord, TraceError> {
    let v: Value = serde_json::from_str(text).map_err(|e| TraceError::Json {
        line,
        message: e.to_string(),
    })?;
    let obj = v.as_object().ok_or_else(|| TraceError::Json {
        line,
        message: "expected a JSON object".into(),
    })?;
    let timestamp_ms = uint(obj, line, "timestamp")?;
    let input_length = uint(obj, line, "input_length")?;
    let output_length = uint(obj, line, "output_length")?;
    let ids = obj
        .get("hash_ids")
        .ok_or(TraceError::Missing {
            line,
            field: "hash_ids",
        })?
        .as_array()
        .ok_or_else(|| TraceError::Invalid {
            line,
            field: "hash_ids",
            reason: "expected an array".into(),
        })?;
    let mut hash_ids = Vec::with_capacity(ids.len());
    for id in ids {
        hash_ids.push(id.as_u64().ok_or_else(|| TraceError::Invalid {
            line,
            field: "hash_ids",
            reason: format!("block id {id} is not a non-negative integer"),
        })?);
    }
    let to_u32 = |v: u64, field: &'static str| {
        u32::try_from(v).map_err(|_| TraceError::Invalid {
            line,
            field,
            reason: format!("{v} does not fit in 32 bits"),
        })
    };
    let input_length = to_u32(input_length, "input_length")?;
    let output_length = to_u32(output_length, "output_length")?;
    if input_length == 0 {
        return Err(TraceError::Invalid {
            line,
            field: "input_length",
            reason: "must be at least 1".into(),
        });
    }
    let blocks = input_length.div_ceil(BLOCK_TOKENS) as usize;
    if hash_ids.len() != blocks {
        return Err(TraceError::Invalid {
            line,
            field: "hash_ids",
            reason: format!(
                "{} blocks, but input_length {input_length} needs exactly {blocks} of {BLOCK_TOKENS} tokens",
                hash_ids.len()
            ),
        });
    }
    Ok(TraceRecord {
        line,
        timestamp_ms,
        input_length,
        output_length,
        hash_ids,
    })
}

/// Parses JSON lines (blank lines are skipped). Requests must come in arrival order: a
/// timestamp earlier than the line before is refused with both line numbers, because every
/// consumer replays arrivals by their differences (a trace out of order is a broken trace, and
/// sorting it silently would replay a different workload).
pub fn parse_jsonl(text: &str) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out: Vec<TraceRecord> = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let r = parse_line(l, i + 1)?;
        if let Some(prev) = out.last() {
            if r.timestamp_ms < prev.timestamp_ms {
                return Err(TraceError::OutOfOrder {
                    line: r.line,
                    timestamp_ms: r.timestamp_ms,
                    previous_line: prev.line,
                    previous_ms: prev.timestamp_ms,
                });
            }
        }
        out.push(r);
    }
    Ok(out)
}

/// Reads a trace file (a regular file of at most [`crate::input::TRACE_BYTES_MAX`] bytes); one
/// without any request is an error.
pub fn read_trace(path: &std::path::Path) -> Result<Vec<TraceRecord>, TraceError> {
    let text = crate::input::read_text(path, crate::input::TRACE_BYTES_MAX).map_err(|e| {
        TraceError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        }
    })?;
    let recs = parse_jsonl(&text).map_err(|e| TraceError::InFile {
        path: path.display().to_string(),
        error: Box::new(e),
    })?;
    if recs.is_empty() {
        return Err(TraceError::Empty {
            path: path.display().to_string(),
        });
    }
    Ok(recs)
}

/// The prompt of a record, at most `tokens_max` tokens of it: its blocks' tokens, cut at
/// `input_length` (so a record of four billion tokens costs no more than the cut).
pub fn prompt_tokens(rec: &TraceRecord, synth: &Synth, tokens_max: usize) -> Vec<u32> {
    let len = (rec.input_length as usize).min(tokens_max);
    let mut out = Vec::with_capacity(len);
    'blocks: for &h in &rec.hash_ids {
        for i in 0..BLOCK_TOKENS as u64 {
            if out.len() == len {
                break 'blocks;
            }
            out.push(synth.token(h, i));
        }
    }
    out
}

/// A generated trace of the same format (tests use it when the real traces are absent): `n`
/// requests sharing prefixes in a tree of block ids.
pub fn generate(n: usize, seed: u64) -> Vec<TraceRecord> {
    let mut s = seed;
    let mut next = || {
        s = tierkv_kernels::cpu::numerics::mix64(s.wrapping_add(0x9E37_79B9_7F4A_7C15));
        s
    };
    let mut next_id = 1_000_000u64;
    let mut roots: Vec<Vec<u64>> = Vec::new();
    (0..n)
        .map(|i| {
            let reuse = !roots.is_empty() && next() % 3 != 0;
            let mut ids = if reuse {
                let r = &roots[(next() % roots.len() as u64) as usize];
                let keep = 1 + (next() % r.len() as u64) as usize;
                r[..keep].to_vec()
            } else {
                Vec::new()
            };
            for _ in 0..1 + next() % 6 {
                ids.push(next_id);
                next_id += 1;
            }
            roots.push(ids.clone());
            let input_length = (ids.len() as u32 - 1) * BLOCK_TOKENS + 1 + (next() % 512) as u32;
            TraceRecord {
                line: i + 1,
                timestamp_ms: i as u64 * 50,
                input_length,
                output_length: 1 + (next() % 64) as u32,
                hash_ids: ids,
            }
        })
        .collect()
}

/// Fuzz body (`fuzz/fuzz_targets/trace.rs`): any bytes parse to records that obey the format's
/// rules, or to an error naming a line — never a panic. Returns how many records it held to
/// those rules (those of fewer than 2^16 input tokens, whose prompts it builds).
pub fn fuzz_trace(data: &[u8]) -> usize {
    let Ok(text) = std::str::from_utf8(data) else {
        return 0;
    };
    let Ok(recs) = parse_jsonl(text) else {
        return 0;
    };
    let synth = Synth::new(1);
    let mut checked = 0;
    for r in recs.iter().filter(|r| r.input_length < 1 << 16) {
        assert_eq!(
            r.hash_ids.len(),
            r.input_length.div_ceil(BLOCK_TOKENS) as usize
        );
        assert_eq!(
            prompt_tokens(r, &synth, usize::MAX).len(),
            r.input_length as usize
        );
        checked += 1;
    }
    checked
}
