//! The conservation oracle: at the end of a run every device page, host page, pin and lock is
//! accounted for — the pools hold exactly what the prefix cache holds, nothing is locked or pinned,
//! no load or backup is in flight. It asks the engine's own accounting (`Engine::check_quiescent`)
//! after the device has drained; during the run the engine's invariant assertions
//! (`Engine::check_invariants`, run after every step) check the same equations continuously.

use crate::report::{Finding, OracleKind};

pub fn check<D, C, T>(engine: &tierkv_engine::Engine<D, C, T>, time_ns: u64) -> Option<Finding>
where
    D: tierkv_engine::device::Device,
    C: tierkv_engine::device::Clock,
    T: tierkv_engine::transfer::Transfer,
{
    engine.check_quiescent().err().map(|message| Finding {
        oracle: OracleKind::Conservation,
        time_ns,
        message,
    })
}
