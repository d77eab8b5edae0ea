//! The host's own cost of enqueueing a step, without a GPU: the production runtime
//! (`DrivenDevice`) over a driver whose every call returns at once and does nothing, so that
//! what is left is the engine's and the runtime's own host time (building the step's ops, their
//! checks, staging their arrays), the part no GPU can take away. The replay's requests (the
//! built-in excerpt, `tierkv replay`'s configuration) are submitted at once and the engine
//! stepped until idle.
//!
//! `cargo run --release -p tierkv-sim --example host_cost -- [LAYERS [REQUESTS [OVERLAP [GRAPHS]]]]`
//! (defaults: 61 60 0 1). Makes the RoPE table for the model's whole context first, as the
//! replay on CUDA does. Prints the host time per computing step inside the engine's enqueue
//! phase (median, 90th percentile and largest, each the step at that rank rounded down; and
//! the mean) and of the whole step (mean), and the driver calls, launches (captured or not)
//! and graph launches a step, in all and by driver call. With GRAPHS 1 the compute stream's
//! ops go through graphs, as on CUDA.

use clap::Parser;
use std::process::ExitCode;
use tierkv_engine::device::{BufferDesc, DeviceError, EventState, StreamKind};
use tierkv_engine::layout::Bytes;
use tierkv_engine::runtime::driven::{CopyStrategy, DrivenDevice};
use tierkv_engine::runtime::driver::{
    Copy2d, Driver, DrvEvent, DrvGraph, EventUse, HostCallback, Launch, Mem, MemTable, Ptr,
};
use tierkv_engine::runtime::MonotonicClock;
use tierkv_engine::{Engine, EngineOptions};
use tierkv_sim::cli::replay::{prepare, ReplayArgs};

/// A driver that does nothing: every allocation a handle, every event done, pinned memory a
/// host vector (the engine reads its readback buffer).
#[derive(Default)]
struct NullDriver {
    mems: MemTable<Vec<u8>>,
    events: u32,
    /// The driver calls that queue work or change a stream, by name.
    by_call: std::collections::BTreeMap<&'static str, u64>,
    graphs: u32,
}

impl NullDriver {
    fn count(&mut self, call: &'static str) {
        *self.by_call.entry(call).or_default() += 1;
    }
    fn calls(&self, call: &str) -> u64 {
        self.by_call.get(call).copied().unwrap_or(0)
    }
}

impl Driver for NullDriver {
    fn bind(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    fn alloc(&mut self, desc: &BufferDesc) -> Result<Mem, DeviceError> {
        // Pinned buffers up to 256 MiB hold their bytes (the staging rings, the readback
        // buffer); the host mirror's do not (reads of it answer zeros).
        let pinned = desc.tier == tierkv_engine::device::MemoryTier::PinnedHost;
        Ok(self.mems.insert(if pinned && desc.bytes.0 <= 256 << 20 {
            // Every page written now, as pinned memory is mapped when it is allocated: the
            // steps' first writes to it are not page faults here either.
            let mut v = vec![0u8; desc.bytes.0 as usize];
            let n = v.len();
            for i in (0..n).step_by(4096).chain(n.checked_sub(1)) {
                // SAFETY: a valid byte of `v`; volatile, so that the write is kept.
                unsafe { std::ptr::write_volatile(&mut v[i], 0) };
            }
            v
        } else {
            Vec::new()
        }))
    }
    fn free(&mut self, mem: Mem) -> Result<(), DeviceError> {
        self.mems.take(mem);
        Ok(())
    }
    fn alloc_async(&mut self, _: StreamKind, _: u64) -> Result<Mem, DeviceError> {
        self.count("alloc_async");
        Ok(self.mems.insert(Vec::new()))
    }
    fn trim_pool(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    fn free_async(&mut self, _: StreamKind, mem: Mem) -> Result<(), DeviceError> {
        self.count("free_async");
        self.mems.take(mem);
        Ok(())
    }
    fn write_pinned(&mut self, mem: Mem, at: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        let m = self.mems.get_mut(mem);
        if let Some(m) = m.get_mut(at.0 as usize..at.0 as usize + data.len()) {
            m.copy_from_slice(data);
        }
        Ok(())
    }
    fn read_pinned(&mut self, mem: Mem, at: Bytes, out: &mut [u8]) -> Result<(), DeviceError> {
        match self
            .mems
            .get(mem)
            .get(at.0 as usize..at.0 as usize + out.len())
        {
            Some(m) => out.copy_from_slice(m),
            None => out.fill(0),
        }
        Ok(())
    }
    fn copy_async(&mut self, _: StreamKind, _: Ptr, _: Ptr) -> Result<(), DeviceError> {
        self.count("copy_async");
        Ok(())
    }
    fn copy_batch_async(&mut self, _: StreamKind, _: &[(Ptr, Ptr)]) -> Result<(), DeviceError> {
        self.count("copy_batch_async");
        Ok(())
    }
    fn copy_2d_async(&mut self, _: StreamKind, _: &Copy2d) -> Result<(), DeviceError> {
        self.count("copy_2d_async");
        Ok(())
    }
    fn copy_pageable(&mut self, _: StreamKind, _: Ptr, _: &[u8]) -> Result<(), DeviceError> {
        self.count("copy_pageable");
        Ok(())
    }
    fn launch(&mut self, _: StreamKind, _: &Launch<'_>) -> Result<(), DeviceError> {
        self.count("launch");
        Ok(())
    }
    fn event_create(&mut self, _: EventUse) -> Result<DrvEvent, DeviceError> {
        self.events += 1;
        Ok(DrvEvent(self.events - 1))
    }
    fn event_record(&mut self, _: StreamKind, _: DrvEvent) -> Result<(), DeviceError> {
        self.count("event_record");
        Ok(())
    }
    fn event_query(&mut self, _: DrvEvent) -> EventState {
        EventState::Done
    }
    fn event_synchronize(&mut self, _: DrvEvent) -> EventState {
        EventState::Done
    }
    fn event_elapsed_ns(&mut self, _: DrvEvent, _: DrvEvent) -> Option<u64> {
        None
    }
    fn stream_wait(&mut self, _: StreamKind, _: DrvEvent) -> Result<(), DeviceError> {
        self.count("stream_wait");
        Ok(())
    }
    fn stream_synchronize(&mut self, _: StreamKind) -> Result<(), DeviceError> {
        Ok(())
    }
    fn context_synchronize(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    fn context_generation(&self) -> u64 {
        0
    }
    fn host_callback(&mut self, _: StreamKind, cb: HostCallback) -> Result<(), DeviceError> {
        self.count("host_callback");
        cb();
        Ok(())
    }
    fn import(&mut self, _: u64, _: u64) -> Result<Mem, DeviceError> {
        Ok(self.mems.insert(Vec::new()))
    }
    fn event_record_foreign(&mut self, _: u64, _: DrvEvent) -> Result<(), DeviceError> {
        Ok(())
    }
    fn observed_by_callback(&mut self, _: DrvEvent) {}
    fn capture_begin(&mut self, _: StreamKind) -> Result<(), DeviceError> {
        self.count("capture_begin");
        Ok(())
    }
    fn capture_end(
        &mut self,
        _: StreamKind,
        into: Option<DrvGraph>,
    ) -> Result<DrvGraph, DeviceError> {
        self.count("capture_end");
        Ok(into.unwrap_or_else(|| {
            self.graphs += 1;
            DrvGraph(self.graphs - 1)
        }))
    }
    fn graph_launch(&mut self, _: StreamKind, _: DrvGraph) -> Result<(), DeviceError> {
        self.count("graph_launch");
        Ok(())
    }
    fn graph_destroy(&mut self, _: DrvGraph) {}
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    replay: ReplayArgs,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let num = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (layers, requests, overlap) = (num(1, 61), num(2, 60), num(3, 0) != 0);
    let graphs = num(4, 1) != 0;
    let cli = Cli::parse_from([
        "host_cost".to_string(),
        format!("--layers={layers}"),
        format!("--requests={requests}"),
    ]);
    let (cfg, work) = match prepare(&cli.replay) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut dev = DrivenDevice::over(NullDriver::default(), CopyStrategy::Gather).expect("device");
    dev.set_graphs(graphs);
    // As `tierkv replay --device cuda` does: every position's RoPE row before the first step.
    let prepared = std::time::Instant::now();
    dev.prepare_rope_for(&cfg).expect("RoPE table");
    let prepared = prepared.elapsed();
    let context = cfg.model.context_tokens_max;
    let options = EngineOptions {
        overlap,
        ..EngineOptions::default()
    };
    let mut engine = Engine::new(cfg, dev, MonotonicClock::new(), options).expect("engine");
    for (_, spec) in work {
        engine.submit(spec).expect("submitted");
    }
    let (mut steps, mut enqueue_ns, mut wall_ns) = (0u64, 0u64, 0u64);
    let mut each: Vec<u64> = Vec::new();
    let started = std::time::Instant::now();
    loop {
        let t = std::time::Instant::now();
        let r = engine.step().expect("step");
        if r.rows > 0 {
            steps += 1;
            enqueue_ns += r.host.enqueue_ns;
            each.push(r.host.enqueue_ns);
            wall_ns += t.elapsed().as_nanos() as u64;
        }
        if r.idle {
            break;
        }
    }
    let d = &engine.dev.driver;
    each.sort_unstable();
    let at = |q: f64| each[((each.len() - 1) as f64 * q) as usize] as f64 / 1e6;
    if !each.is_empty() {
        println!(
            "host enqueue a step: median {:.3} ms, p90 {:.3} ms, max {:.3} ms; the RoPE table of {} positions made before the first step in {:.1} ms",
            at(0.5),
            at(0.9),
            at(1.0),
            context,
            prepared.as_secs_f64() * 1e3,
        );
    }
    println!(
        "{layers} layers, {requests} requests, overlap {overlap}, graphs {graphs}: {steps} computing steps in {:.2} s; per step: host enqueue {:.3} ms, whole step {:.3} ms; {:.1} driver calls, {:.1} launches and {:.1} graph launches a step (all steps)",
        started.elapsed().as_secs_f64(),
        enqueue_ns as f64 / steps.max(1) as f64 / 1e6,
        wall_ns as f64 / steps.max(1) as f64 / 1e6,
        d.by_call.values().sum::<u64>() as f64 / steps.max(1) as f64,
        d.calls("launch") as f64 / steps.max(1) as f64,
        d.calls("graph_launch") as f64 / steps.max(1) as f64,
    );
    let by_call: Vec<String> = d
        .by_call
        .iter()
        .map(|(call, n)| format!("{call} {:.1}", *n as f64 / steps.max(1) as f64))
        .collect();
    println!("driver calls a step by call: {}", by_call.join(", "));
    ExitCode::SUCCESS
}
