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

/// The engine thread's wait sleeps only with nothing to do: not while work is queued, not once
/// intake is closed; with nothing queued it sleeps (here 1 ms).
#[test]
fn the_intake_wait_sleeps_only_with_nothing_to_do() {
    use super::{Intake, Submission};
    use crate::scheduler::RequestSpec;
    use std::time::{Duration, Instant};
    let intake = Intake::new();
    let ms = Duration::from_millis(1);
    assert!(intake.wait(ms), "nothing queued");
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
    assert!(!intake.wait(ms), "work queued");
    assert_eq!(intake.drain().len(), 1);
    intake.close();
    assert!(!intake.wait(ms), "intake closed");
}
