//! The engine's device calls after a fault (`device::call_recovering`).

use tierkv_engine::cpu_device::InOrderDevice;
use tierkv_engine::device::{call_recovering, DeviceError, DeviceFault, StreamKind, CALL_TRIES};

/// `call_recovering` repeats a call after a transient error (recovering the device between
/// calls) up to `CALL_TRIES` calls in all, and never repeats a refusal of the call's
/// arguments.
#[test]
fn call_recovering_repeats_transient_errors_only() {
    let in_error = DeviceError::InError {
        cause: DeviceFault::Failed {
            op: "topk",
            stream: StreamKind::Compute,
        },
    };
    let failing = |errors: u32, error: DeviceError| {
        let mut calls = 0;
        let mut dev = InOrderDevice::new();
        let r = call_recovering(&mut dev, |_| {
            calls += 1;
            if calls <= errors {
                Err(error.clone())
            } else {
                Ok(calls)
            }
        });
        (r, calls)
    };
    assert_eq!(failing(2, in_error.clone()), (Ok(3), 3));
    assert_eq!(
        failing(CALL_TRIES - 1, in_error.clone()),
        (Ok(CALL_TRIES), CALL_TRIES)
    );
    assert_eq!(
        failing(u32::MAX, in_error.clone()),
        (Err(in_error), CALL_TRIES)
    );
    let refusal = DeviceError::Kernel {
        op: "topk",
        detail: "k = 0".into(),
    };
    assert!(!refusal.is_transient());
    assert_eq!(failing(u32::MAX, refusal.clone()), (Err(refusal), 1));
    let backend = DeviceError::Backend {
        detail: "injected".into(),
    };
    assert_eq!(failing(1, backend), (Ok(2), 2));
}
