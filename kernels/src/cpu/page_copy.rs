//! `page_copy`: runs of whole pages between two paged views of possibly different strides (device
//! pool ↔ pinned host mirror). Refuses views whose layout fingerprints differ: a copy that sizes both
//! sides from one of them is DESIGN §1 incident 1.

use crate::error::{KernelError, Result};
use crate::layout::{PageId, PageRun, PagedView};

/// Checks a copy before it runs: equal fingerprints, both views inside their buffers, every run
/// inside both views. Shared by the CPU reference, the CUDA launcher and the simulated GPU.
pub fn check_page_copy(
    src: &PagedView,
    src_len: u64,
    dst: &PagedView,
    dst_len: u64,
    runs: &[PageRun],
) -> Result<()> {
    const OP: &str = "page_copy";
    if src.fingerprint != dst.fingerprint {
        return Err(KernelError::LayoutMismatch {
            op: OP,
            src: src.fingerprint,
            dst: dst.fingerprint,
        });
    }
    for (view, len, buffer) in [(src, src_len, "src"), (dst, dst_len, "dst")] {
        if view.required_bytes() > len {
            return Err(KernelError::BufferSize {
                op: OP,
                buffer,
                needed: view.required_bytes(),
                found: len,
            });
        }
    }
    for (i, run) in runs.iter().enumerate() {
        for (first, view) in [(run.src, src), (run.dst, dst)] {
            let end = first.0 as u64 + run.count as u64;
            if end > view.pages as u64 {
                return Err(KernelError::OutOfRange {
                    op: OP,
                    index: i,
                    value: end as i64 - 1,
                    limit: view.pages as u64,
                });
            }
        }
    }
    Ok(())
}

/// The CPU reference of `page_copy`.
pub fn page_copy(
    src: &[u8],
    src_view: &PagedView,
    dst: &mut [u8],
    dst_view: &PagedView,
    runs: &[PageRun],
) -> Result<()> {
    check_page_copy(src_view, src.len() as u64, dst_view, dst.len() as u64, runs)?;
    for run in runs {
        for j in 0..run.count {
            let s = src_view.page_range(PageId(run.src.0 + j));
            let d = dst_view.page_range(PageId(run.dst.0 + j));
            dst[d.start as usize..d.end as usize]
                .copy_from_slice(&src[s.start as usize..s.end as usize]);
        }
    }
    Ok(())
}
