//! The simulated driver's CUDA-graph semantics: a capture's launches run at each launch of its
//! graph, and the calls CUDA refuses during a capture, or a graph over freed memory, are the
//! runtime's errors. Also the runtime over it: its RoPE table, its record-to-wait count.

use super::*;
use crate::gpu::{GpuOptions, SimGpu};
use std::cell::RefCell;
use std::rc::Rc;
use tierkv_engine::config::limits::CONTEXT_TOKENS_MAX;
use tierkv_engine::runtime::driven::CopyStrategy;
use tierkv_engine::runtime::driver::DrawKind;
use tierkv_kernels::rope::Rope;

/// A driver over a fresh simulated GPU, with a drawn-rows upload and an output allocation
/// of 4 KiB each on the compute stream.
fn driver() -> (SimDriver, Ptr, Ptr) {
    let gpu = Rc::new(RefCell::new(
        SimGpu::new(1, GpuOptions::default()).expect("a simulated GPU"),
    ));
    let mut d = SimDriver::new(SimSide { gpu, side: 0 });
    let s = StreamKind::Compute;
    let rows = d.alloc_async(s, 4096).expect("rows");
    let out = d.alloc_async(s, 4096).expect("outputs");
    (
        d,
        Ptr::whole(rows, Bytes(4096)),
        Ptr::whole(out, Bytes(4096)),
    )
}

fn draw<'a>(rows: Ptr, out: Ptr) -> Launch<'a> {
    Launch::Draw {
        kind: DrawKind::KvRows,
        seed: 1,
        layer: 0,
        rows: 2,
        rows_dev: rows,
        out,
    }
}

/// The message `f` panics with (it must panic).
fn refusal(f: impl FnOnce()) -> String {
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("a refusal");
    match (e.downcast_ref::<String>(), e.downcast_ref::<&str>()) {
        (Some(s), _) => s.clone(),
        (None, Some(s)) => s.to_string(),
        (None, None) => String::from("(a panic without a message)"),
    }
}

/// A graph names the allocations of its capture and launches, again and again, while they
/// live; a capture of the same op kinds updates it in place.
#[test]
fn a_graph_launches_while_its_allocations_live() {
    let (mut d, rows, out) = driver();
    let s = StreamKind::Compute;
    d.capture_begin(s).unwrap();
    d.launch(s, &draw(rows, out)).unwrap();
    let g = d.capture_end(s, None).unwrap();
    let named: Vec<Mem> = d.graphs.get(Mem(g.0)).mems.iter().map(|m| m.0).collect();
    assert_eq!(named, vec![rows.mem, out.mem]);
    d.graph_launch(s, g).unwrap();
    d.graph_launch(s, g).unwrap();
    d.capture_begin(s).unwrap();
    d.launch(s, &draw(rows, out)).unwrap();
    assert_eq!(d.capture_end(s, Some(g)).unwrap(), g);
    d.graph_destroy(g);
}

/// The allocation a graph's launch names was freed, and its id reused by a new one, since
/// the capture: launching the graph is the runtime's error.
#[test]
fn a_graph_launched_over_a_freed_allocation_is_refused() {
    let (mut d, rows, out) = driver();
    let s = StreamKind::Compute;
    d.capture_begin(s).unwrap();
    d.launch(s, &draw(rows, out)).unwrap();
    let g = d.capture_end(s, None).unwrap();
    d.free_async(s, out.mem).unwrap();
    let again = d.alloc_async(s, 4096).unwrap();
    assert_eq!(again, out.mem, "the freed id is reused");
    let m = refusal(|| drop(d.graph_launch(s, g)));
    assert!(
        m.contains("a graph launched over allocation 1 freed since its capture"),
        "{m}"
    );
}

/// No event is recorded on a capturing stream (CUDA would make it a node of the graph), and
/// the host waits for nothing while a capture is open.
#[test]
fn calls_during_a_capture_are_refused() {
    let s = StreamKind::Compute;
    let (mut d, _, _) = driver();
    let e = d.event_create(EventUse::Engine).unwrap();
    d.capture_begin(s).unwrap();
    let m = refusal(|| drop(d.event_record(s, e)));
    assert_eq!(
        m,
        "the runtime called cuEventRecord during a stream capture"
    );
    let (mut d, _, _) = driver();
    d.capture_begin(s).unwrap();
    let m = refusal(|| drop(d.stream_synchronize(StreamKind::Load)));
    assert_eq!(
        m,
        "the runtime called cuStreamSynchronize during a stream capture"
    );
}

/// A RoPE table prepared for a model's context holds every position of it before the first
/// step; preparing fewer keeps it, and more positions than any context is a typed refusal
/// that leaves the table as it was.
#[test]
fn a_rope_table_is_prepared_for_a_whole_context() {
    let (d, _, _) = driver();
    let mut dev = DrivenDevice::with_staging(d, CopyStrategy::Gather, 1 << 16).expect("device");
    let cfg = tierkv_engine::Config::preset("deepseek-v3.2").expect("a preset");
    let rope = Rope::new(&cfg.rope());
    assert_eq!(dev.rope_rows(), 0);
    dev.prepare_rope(&rope, 0).expect("no positions");
    assert_eq!(dev.rope_rows(), 0, "no positions need no table");
    dev.prepare_rope(&rope, 10_000).expect("a table");
    assert_eq!(
        dev.rope_rows(),
        16_384,
        "positions 0..10000 in the next power of two"
    );
    dev.prepare_rope(&rope, 300).expect("fewer positions");
    assert_eq!(
        dev.rope_rows(),
        16_384,
        "a table with the rows asked is kept"
    );
    let past = CONTEXT_TOKENS_MAX + 1;
    let e = dev.prepare_rope(&rope, past).expect_err("past any context");
    assert!(
        e.to_string()
            .contains(&format!("RoPE position {}", past - 1)),
        "{e}"
    );
    assert_eq!(
        dev.rope_rows(),
        16_384,
        "a refused preparation keeps the table"
    );
    // A server's preparation: every position of its model's longest context (longer than the
    // table so far, so the preparation must grow it).
    assert!(cfg.model.context_tokens_max > 16_384);
    dev.prepare_rope_for(&cfg).expect("the model's context");
    assert_eq!(
        dev.rope_rows(),
        cfg.model.context_tokens_max.next_power_of_two()
    );
}

/// The runtime counts the ops enqueued, on every stream, between an event's record and a wait
/// on it (`mark.runtime.ops_from_record_to_wait`): five ops give the levels 2^0 to 2^2, a wait
/// right after a record none, and a wait on an event never recorded none.
#[test]
fn a_wait_counts_the_ops_since_its_events_record() {
    use tierkv_engine::device::{
        BufferDesc, BufferRole, Device, LinearCopy, MemoryTier, Op, Region,
    };
    use tierkv_engine::layout::LayoutFingerprint;
    use tierkv_engine::probe;
    let (d, _, _) = driver();
    let mut dev = DrivenDevice::with_staging(d, CopyStrategy::Gather, 1 << 16).expect("device");
    let desc = BufferDesc {
        role: BufferRole::Scratch { name: "test" },
        tier: MemoryTier::Device,
        bytes: Bytes(64),
        fingerprint: LayoutFingerprint::unpaged(64),
    };
    let (a, b) = (dev.alloc(desc).expect("a"), dev.alloc(desc).expect("b"));
    let region = |buffer| Region {
        buffer,
        offset: Bytes::ZERO,
        bytes: Bytes(64),
    };
    let copy = Op::Copy(LinearCopy {
        src: region(a),
        dst: region(b),
    });
    let (ev, never) = (
        dev.new_event().expect("event"),
        dev.new_event().expect("event"),
    );
    let level = |k: u32| format!("mark.runtime.ops_from_record_to_wait>=2^{k}");
    probe::take();
    dev.record(StreamKind::Compute, ev).expect("record");
    for i in 0..5 {
        let s = [StreamKind::Compute, StreamKind::Write][i % 2];
        dev.enqueue(s, copy.clone()).expect("a copy");
    }
    dev.synchronize(ev);
    let hits = probe::take();
    for k in 0..3 {
        assert_eq!(hits.get(level(k).as_str()), Some(&1), "level {k}: {hits:?}");
    }
    assert_eq!(hits.get(level(3).as_str()), None, "{hits:?}");
    dev.record(StreamKind::Compute, ev).expect("record");
    dev.synchronize(ev);
    dev.wait(StreamKind::Load, never).expect("a wait");
    let hits = probe::take();
    assert!(
        !hits.keys().any(|n| n.starts_with("mark.runtime")),
        "{hits:?}"
    );
}

/// A timed runtime answers, for the work the host has waited for, the device time of each op
/// kind (their sum the busy time) and the host time its enqueues took, once: a second answer
/// holds only what ran since. Untimed, it answers nothing; shared by a pair, the one device's
/// (its records too).
#[test]
fn a_timed_runtime_answers_its_ops_time_once() {
    use tierkv_engine::device::{
        BufferDesc, BufferRole, Device, LinearCopy, MemoryTier, Op, Region,
    };
    use tierkv_engine::layout::LayoutFingerprint;
    use tierkv_engine::pd::SharedDevice;
    let (d, _, _) = driver();
    let mut dev = DrivenDevice::with_staging(d, CopyStrategy::Gather, 1 << 16).expect("device");
    assert_eq!(dev.take_timing(), None, "untimed");
    dev.set_timing(true);
    let desc = BufferDesc {
        role: BufferRole::Scratch { name: "test" },
        tier: MemoryTier::Device,
        bytes: Bytes(1 << 20),
        fingerprint: LayoutFingerprint::unpaged(1 << 20),
    };
    assert_eq!(dev.buffers(), 0);
    let (a, b) = (dev.alloc(desc).expect("a"), dev.alloc(desc).expect("b"));
    assert_eq!(dev.buffers(), 2, "the buffers alloc made");
    let region = |buffer| Region {
        buffer,
        offset: Bytes::ZERO,
        bytes: Bytes(1 << 20),
    };
    let copy = Op::Copy(LinearCopy {
        src: region(a),
        dst: region(b),
    });
    let kind = copy.kind();
    let ev = dev.new_event().expect("event");
    for _ in 0..3 {
        dev.enqueue(StreamKind::Compute, copy.clone())
            .expect("a copy");
    }
    dev.record(StreamKind::Compute, ev).expect("record");
    dev.synchronize(ev);
    let t = dev.take_timing().expect("timed");
    assert!(t.busy_by_op_ns[kind] > 0, "{t:?}");
    assert_eq!(t.busy_ns, t.busy_by_op_ns.iter().sum::<u64>(), "{t:?}");
    assert!(t.enqueue_ns[kind] > 0, "{t:?}");
    assert_eq!(
        t.enqueue_ns.iter().sum::<u64>(),
        t.enqueue_ns[kind],
        "{t:?}"
    );
    let again = dev.take_timing().expect("still timed");
    assert_eq!(again.busy_ns, 0, "{again:?}");
    assert_eq!(again.enqueue_ns, [0; Op::KINDS], "{again:?}");
    // Shared by the two engines of a pair: the one device's timing, to whichever asks.
    let one = Rc::new(RefCell::new(dev));
    let mut shared = SharedDevice(one.clone());
    shared
        .enqueue(StreamKind::Compute, copy.clone())
        .expect("a copy");
    shared.record(StreamKind::Compute, ev).expect("record");
    shared.synchronize(ev);
    let t = shared.take_timing().expect("the shared device is timed");
    assert!(t.busy_by_op_ns[kind] > 0, "{t:?}");
    assert_eq!(one.borrow_mut().take_timing().map(|t| t.busy_ns), Some(0));
    // A record through the shared handle is the one device's: a wait on its event counts the
    // ops enqueued since (`mark.runtime.ops_from_record_to_wait`; an event never recorded
    // counts none).
    let fresh = shared.new_event().expect("event");
    tierkv_engine::probe::take();
    shared.record(StreamKind::Compute, fresh).expect("record");
    shared
        .enqueue(StreamKind::Compute, copy.clone())
        .expect("a copy");
    shared.synchronize(fresh);
    let hits = tierkv_engine::probe::take();
    assert_eq!(
        hits.get("mark.runtime.ops_from_record_to_wait>=2^0"),
        Some(&1),
        "{hits:?}"
    );
}
