//! The scheduler's invariant checker catches broken bookkeeping (the simulator relies on it after
//! every step).

use super::*;
use crate::config::Config;

fn with_one_queued() -> Scheduler {
    let cfg = Config::preset("sim-small").expect("preset");
    let mut s = Scheduler::new(&cfg, Mutants::none());
    let spec = RequestSpec {
        prompt: vec![7; 100],
        max_new_tokens: 4,
    };
    s.submit(spec, 0).expect("a valid request");
    s.check_invariants();
    s
}

#[test]
#[should_panic(expected = "queued tokens = the queued prompts")]
fn a_wrong_queued_token_count_is_caught() {
    let mut s = with_one_queued();
    s.queued_tokens += 1;
    s.check_invariants();
}

#[test]
#[should_panic(expected = "every request is queued or running")]
fn a_request_in_neither_set_is_caught() {
    let mut s = with_one_queued();
    s.queue.clear();
    s.queued_tokens = 0;
    s.check_invariants();
}
