//! `Transfer`: host ↔ device page movement for one layer, coalesced into runs of consecutive pages,
//! enqueued on the load or write stream. Both sides are checked before anything is enqueued
//! (and the device checks them again when the copy is enqueued and when it runs).

use crate::device::{Device, DeviceError, StreamKind};
use crate::layout::{coalesce_runs, PageId};
use crate::pools::PoolSide;

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

/// Moves pages between two pool sides on a stream.
pub trait Transfer {
    /// Copies `pairs` (source page, destination page) from `src` to `dst` on `stream`.
    fn copy_pages<D: Device>(
        &mut self,
        dev: &mut D,
        stream: StreamKind,
        src: PoolSide,
        dst: PoolSide,
        pairs: &[(PageId, PageId)],
    ) -> Result<(), TransferError>;
}

/// The default: coalesce consecutive pages into runs, one `PageCopy` op per call.
#[derive(Clone, Copy, Debug, Default)]
pub struct PageRuns;

impl Transfer for PageRuns {
    fn copy_pages<D: Device>(
        &mut self,
        dev: &mut D,
        stream: StreamKind,
        src: PoolSide,
        dst: PoolSide,
        pairs: &[(PageId, PageId)],
    ) -> Result<(), TransferError> {
        if pairs.is_empty() {
            return Ok(());
        }
        let (sf, df) = (src.view().fingerprint, dst.view().fingerprint);
        if sf != df {
            return Err(TransferError::LayoutMismatch { src: sf, dst: df });
        }
        dev.enqueue(stream, src.copy_to(dst, coalesce_runs(pairs)))?;
        Ok(())
    }
}
