//! The engine's device calls after a fault (`device::call_recovering`).

use tierkv_engine::cpu_device::InOrderDevice;
use tierkv_engine::device::{
    call_recovering, DeviceError, DeviceFault, StreamKind, CALL_TRIES_MAX,
};

/// Calls `call_recovering` with a call that fails `errors` times with `error`, then succeeds;
/// returns its result, the calls made and the device's recoveries.
fn failing(errors: u32, error: &DeviceError) -> (Result<u32, DeviceError>, u32, u32) {
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
    (r, calls, dev.recoveries)
}

/// `call_recovering` repeats a call after a transient error up to `CALL_TRIES_MAX` calls in
/// all, recovering the device before each repeat only when it is in error, and never repeats a
/// refusal of the call's arguments.
#[test]
fn call_recovering_repeats_transient_errors_only() {
    let in_error = DeviceError::InError {
        cause: DeviceFault::Failed {
            op: "topk",
            stream: StreamKind::Compute,
        },
    };
    assert_eq!(failing(2, &in_error), (Ok(3), 3, 2));
    assert_eq!(
        failing(CALL_TRIES_MAX - 1, &in_error),
        (Ok(CALL_TRIES_MAX), CALL_TRIES_MAX, CALL_TRIES_MAX - 1)
    );
    assert_eq!(
        failing(u32::MAX, &in_error),
        (Err(in_error.clone()), CALL_TRIES_MAX, CALL_TRIES_MAX - 1)
    );
    let refusal = DeviceError::Kernel {
        op: "topk",
        detail: "k = 0".into(),
    };
    assert!(!refusal.is_transient());
    assert_eq!(failing(u32::MAX, &refusal), (Err(refusal), 1, 0));
    // A transient error of a device not in error is met by the call alone: no recovery, which
    // would clear stream errors the engine has not handled yet.
    let backend = DeviceError::Backend {
        detail: "injected".into(),
    };
    assert_eq!(failing(1, &backend), (Ok(2), 2, 0));
}

/// A device that cannot recover stops the repeats with the recovery's error.
#[test]
fn call_recovering_stops_when_the_device_cannot_recover() {
    let mut dev = InOrderDevice::new();
    dev.recover_fails = true;
    let mut calls = 0;
    let r = call_recovering(&mut dev, |_| {
        calls += 1;
        Err::<(), _>(DeviceError::InError {
            cause: DeviceFault::Hung {
                op: "page_copy",
                stream: StreamKind::Load,
                after_ns: 1,
            },
        })
    });
    match r {
        Err(DeviceError::Backend { detail }) => assert_eq!(detail, "injected: the device is lost"),
        other => panic!("expected the recovery's error, got {other:?}"),
    }
    assert_eq!((calls, dev.recoveries), (1, 1));
}
