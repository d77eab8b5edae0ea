//! The engine over the simulated GPU, one step ahead, where a load's copy takes device time:
//! a load still in flight once its request is gone, its pages counted until it lands.

use tierkv_engine::config::WritePolicy;
use tierkv_engine::{Config, Engine, EngineError, EngineOptions, RequestSpec};
use tierkv_sim::gpu::{GpuOptions, SimGpu};

/// A prefix kept on the host alone is loaded back for a new request; the request is aborted
/// while the load is in flight (the engine one step ahead). The load is still counted: a weight
/// update is refused naming it, beside the step in flight, and goes through once idle; the
/// engine's page count (tree, requests, loads in flight, orphaned ones included) holds after
/// every step and at the abort.
#[test]
fn a_load_in_flight_outlives_its_aborted_request() {
    let gpu = SimGpu::new(1, GpuOptions::default()).expect("a simulated GPU");
    let clock = gpu.clock();
    let mut cfg = Config::preset("sim-small").expect("preset");
    cfg.cache.write_policy = WritePolicy::WriteBack;
    let options = EngineOptions {
        overlap: true,
        ..EngineOptions::default()
    };
    let mut e = Engine::new(cfg, gpu, clock, options).expect("an engine");
    let s = e.synth;
    let spec = || RequestSpec {
        prompt: (0..288u64).map(|i| s.token(7, i)).collect(),
        max_new_tokens: 4,
    };
    let run_to_idle = |e: &mut Engine<SimGpu, _>| {
        for _ in 0..10_000 {
            let idle = e.step().expect("step").idle;
            e.check_invariants();
            if idle {
                return;
            }
        }
        panic!("not idle after 10,000 steps");
    };
    e.submit(spec()).expect("accepted");
    run_to_idle(&mut e);
    for _ in 0..16 {
        if e.metrics.device_pages_used == 0 {
            break;
        }
        e.evict_device(4).expect("eviction");
        run_to_idle(&mut e);
    }
    assert_eq!(e.metrics.device_pages_used, 0, "{:?}", e.metrics);
    let id = e.submit(spec()).expect("accepted");
    e.step().expect("step");
    assert_eq!(e.loads_in_flight(), 1, "{:?}", e.metrics);
    assert!(e.abort(id));
    assert_eq!(e.loads_in_flight(), 1, "the load outlives its request");
    e.check_invariants();
    let err = e.update_weights(1).expect_err("a load in flight");
    assert!(
        matches!(
            err,
            EngineError::NotIdle {
                step_in_flight: 1,
                requests: 0,
                loads: 1,
                exports: 0,
                imports: 0
            }
        ),
        "{err}"
    );
    run_to_idle(&mut e);
    assert_eq!(e.loads_in_flight(), 0);
    e.update_weights(1).expect("idle");
}
