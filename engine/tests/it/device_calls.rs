//! The engine's device calls after a fault (`device::call_recovering`).

use tierkv_engine::cpu_device::InOrderDevice;
use tierkv_engine::device::{
    call_recovering, call_recovering_since, Device, DeviceError, DeviceFault, EventId, StreamKind,
    CALL_TRIES_MAX,
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

/// A call bound to a context generation (an op of a step) is not made again after a recovery
/// that recreated the context, nor made at all once the generation moved; a call bound to none
/// is repeated as before (swarm seed 1916: a sparse_read repeated after the recreation read a
/// selection the recreation had lost).
#[test]
fn a_call_of_a_lost_generation_is_not_repeated() {
    let in_error = DeviceError::InError {
        cause: DeviceFault::Hung {
            op: "copy",
            stream: StreamKind::Compute,
            after_ns: 1_000_000_000,
        },
    };
    let mut dev = InOrderDevice::new();
    dev.recover_recreates = true;
    let since = dev.context_generation();
    let mut calls = 0;
    let made = call_recovering_since(&mut dev, since, |_| {
        calls += 1;
        Err::<(), _>(in_error.clone())
    });
    assert_eq!(made, Ok(None), "not made again after the recreation");
    assert_eq!((calls, dev.recoveries), (1, 1));
    // The generation moved: a later call of the same step is not made at all.
    let made = call_recovering_since(&mut dev, since, |_| {
        calls += 1;
        Ok(())
    });
    assert_eq!((made, calls), (Ok(None), 1));
    // One of the new generation is, and so is one bound to none after a recreation.
    let now = dev.context_generation();
    assert_eq!(call_recovering_since(&mut dev, now, |_| Ok(7)), Ok(Some(7)));
    let mut tries = 0;
    let r = call_recovering(&mut dev, |_| {
        tries += 1;
        if tries == 1 {
            Err(in_error.clone())
        } else {
            Ok(tries)
        }
    });
    assert_eq!((r, dev.recoveries), (Ok(2), 2));
}

/// A device in error says which op's fault put it there, on which stream, and for a hung op
/// after how long.
#[test]
fn a_device_in_error_names_its_fault() {
    let failed = DeviceError::InError {
        cause: DeviceFault::Failed {
            op: "topk",
            stream: StreamKind::Compute,
        },
    };
    let hung = DeviceError::InError {
        cause: DeviceFault::Hung {
            op: "copy",
            stream: StreamKind::Load,
            after_ns: 5_000,
        },
    };
    let (failed, hung) = (failed.to_string(), hung.to_string());
    assert!(
        failed.contains("since topk failed on the compute stream;"),
        "{failed}"
    );
    assert!(
        hung.contains("since copy on the load stream did not finish within 5000 ns;"),
        "{hung}"
    );
}

/// An event is named `ev<N>` in messages (the simulator's findings about a record or a wait
/// name it so).
#[test]
fn an_event_displays_as_ev_and_its_number() {
    assert_eq!(EventId(9).to_string(), "ev9");
    assert_eq!(EventId(0).to_string(), "ev0");
}
