//! `Transfer`: host ↔ device page movement for one layer, coalesced into runs of consecutive pages,
//! enqueued on the load or write stream. Both sides are checked before anything is enqueued
//! (and the device checks them again when the copy is enqueued and when it runs).

use crate::device::{BufferId, Device, DeviceError, Op, StreamKind};
use crate::layout::{coalesce_runs, PageId, PagedView};

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TransferError {
    #[error("transfer refused: source pages are {src}, destination pages are {dst}")]
    LayoutMismatch {
        src: crate::layout::LayoutFingerprint,
        dst: crate::layout::LayoutFingerprint,
    },
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// Moves pages between two paged views on a stream.
pub trait Transfer {
    /// Copies `pairs` (source page, destination page) from `src` to `dst` on `stream`.
    fn copy_pages<D: Device>(
        &mut self,
        dev: &mut D,
        stream: StreamKind,
        src: (BufferId, PagedView),
        dst: (BufferId, PagedView),
        pairs: &[(PageId, PageId)],
    ) -> Result<(), TransferError>;
}

/// The default: coalesce consecutive pages into runs, one `PageCopy` op per call.
#[derive(Clone, Copy, Debug, Default)]
pub struct PageRuns {
    /// Under the mutants of incidents 1 and 4 the copy trusts one side's item size for both.
    pub one_item_size: bool,
}

impl Transfer for PageRuns {
    fn copy_pages<D: Device>(
        &mut self,
        dev: &mut D,
        stream: StreamKind,
        src: (BufferId, PagedView),
        dst: (BufferId, PagedView),
        pairs: &[(PageId, PageId)],
    ) -> Result<(), TransferError> {
        if pairs.is_empty() {
            return Ok(());
        }
        let (src_buf, src_view) = src;
        let (dst_buf, mut dst_view) = dst;
        if self.one_item_size {
            // The bug of incident 1: one item size (the source's) for both sides.
            dst_view.fingerprint = src_view.fingerprint;
        }
        if src_view.fingerprint != dst_view.fingerprint {
            return Err(TransferError::LayoutMismatch {
                src: src_view.fingerprint,
                dst: dst_view.fingerprint,
            });
        }
        dev.enqueue(
            stream,
            Op::PageCopy {
                src: src_buf,
                src_view,
                dst: dst_buf,
                dst_view,
                runs: coalesce_runs(pairs),
            },
        )?;
        Ok(())
    }
}
