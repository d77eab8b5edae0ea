//! The layout oracle: every copy and launch is checked against the buffers it touches — declared
//! formats against registered fingerprints, declared ranges against buffer sizes — when it is
//! enqueued and again when it runs (the paired assertion of STYLE §6). A refusal at enqueue is a
//! finding even if the engine then handles the error; a failure at execution is a broken
//! invariant of the simulator itself.

use tierkv_engine::device::{check_op, BufferDesc, BufferId, DeviceError, Op, StreamKind};

/// The enqueue-side check: `Err` carries the finding's message.
pub fn at_enqueue(
    op: &Op,
    stream: StreamKind,
    desc: impl Fn(BufferId) -> BufferDesc,
) -> Result<(), (DeviceError, String)> {
    check_op(op, desc).map_err(|e| {
        let msg = format!(
            "{} refused at enqueue on the {} stream: {e}",
            op.name(),
            stream.name()
        );
        (e, msg)
    })
}

/// The execution-side check: an op that passed at enqueue must still fit when it runs.
pub fn at_execution(op: &Op, op_id: u64, desc: impl Fn(BufferId) -> BufferDesc) {
    if let Err(e) = check_op(op, desc) {
        panic!("op {op_id} passed its enqueue check but not its execution check: {e}");
    }
}
