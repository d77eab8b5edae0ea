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
