//! Typed errors of the kernels: the conditions a caller can meet and handle.

use crate::layout::LayoutFingerprint;

/// Why a kernel refused to run. Invariant violations inside a kernel panic instead.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: layout mismatch: source is {src}, destination is {dst}")]
    LayoutMismatch {
        op: &'static str,
        src: LayoutFingerprint,
        dst: LayoutFingerprint,
    },
    #[error("{op}: buffer `{buffer}` is {found} B but must be {needed} B")]
    BufferSize {
        op: &'static str,
        buffer: &'static str,
        needed: u64,
        found: u64,
    },
    #[error("{op}: buffer `{buffer}` is {found} B, less than the {needed} B it must hold")]
    BufferTooSmall {
        op: &'static str,
        buffer: &'static str,
        needed: u64,
        found: u64,
    },
    #[error("{op}: argument `{arg}`: {detail}")]
    BadArgument {
        op: &'static str,
        arg: &'static str,
        detail: String,
    },
    #[error("{op}: entry {index} names slot or page {value}, outside the buffer's {limit}")]
    OutOfRange {
        op: &'static str,
        index: usize,
        value: i64,
        limit: u64,
    },
    #[error(
        "{op}: this call needs a larger {what} than tierkv holds, and its stream is being \
         captured into a CUDA graph, where growing it would put an allocation into the graph: \
         call the op once without capture, at its largest shape, before capturing"
    )]
    GrowsInCapture {
        op: &'static str,
        what: &'static str,
    },
    #[error("{op}: built without CUDA; rebuild with `--features cuda` to run it on a GPU")]
    BuiltWithoutCuda { op: &'static str },
    #[error("{op}: CUDA error: {detail}")]
    Cuda { op: &'static str, detail: String },
    #[error("NVRTC could not compile {file}: {log}")]
    Compile { file: &'static str, log: String },
}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;

pub(crate) fn bad(op: &'static str, arg: &'static str, detail: impl Into<String>) -> KernelError {
    KernelError::BadArgument {
        op,
        arg,
        detail: detail.into(),
    }
}
