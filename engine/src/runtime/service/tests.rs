use super::{keep_sample, StepSample};

#[test]
fn the_first_steps_up_to_the_limit_are_kept() {
    let mut steps = Vec::new();
    for i in 0..5u64 {
        let s = StepSample {
            wall_ns: i,
            ..StepSample::default()
        };
        keep_sample(&mut steps, s, 3);
    }
    let kept: Vec<u64> = steps.iter().map(|s| s.wall_ns).collect();
    assert_eq!(kept, [0, 1, 2]);
}

/// The engine thread's wait returns at once while work is queued, and once intake is closed:
/// it sleeps only with nothing to do. (A wait that slept anyway would sleep here for an hour.)
#[test]
fn the_intake_wait_returns_at_once_with_work_queued_or_intake_closed() {
    use super::{Intake, Submission};
    use crate::scheduler::RequestSpec;
    use std::time::{Duration, Instant};
    let intake = Intake::new();
    let (reply, _rx) = tokio::sync::oneshot::channel();
    let queued = Submission {
        spec: RequestSpec {
            prompt: vec![1, 2, 3],
            max_new_tokens: 1,
        },
        submitted: Instant::now(),
        reply,
    };
    assert!(intake.push(queued).is_ok());
    intake.wait(Duration::from_secs(3600));
    assert_eq!(intake.drain().len(), 1);
    intake.close();
    intake.wait(Duration::from_secs(3600));
}
