//! What each CUDA driver call the runtime makes costs the host, and what CUDA graphs would cost
//! in their place: the measure that decides how the runtime takes its enqueue off the critical
//! path (kernels/GPU.md records each run).
//!
//! `cargo run --release -p tierkv-engine --features cuda --example launch_costs [-- NODES]`
//!
//! A kernel that does almost nothing, with eight parameters (as the indexer's kernels have), on
//! one stream of device 0. Each host figure is the mean over batches of 256 calls, the stream
//! synchronised between batches and outside the clock, so that a full launch queue never
//! blocks a call: it is the host's own cost. Graph figures are for a straight line of NODES
//! kernel nodes (default 16, about one layer of the engine's step), captured from the stream.
//! The device figures are the GPU time per kernel of 4,096 launches in a row, plain and from
//! graphs (event to event): what the launch gaps cost the device.

use cudarc::driver::{sys, CudaContext};
use std::ffi::c_void;
use std::time::Instant;

const KERNEL: &str = r#"
extern "C" __global__ void touch(float* p, int a, float* q, int b, float* r, int c, float* s, int layer) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && layer < 0) { p[0] = (float)(a + b + c); q[0] = 0; r[0] = 0; s[0] = 0; }
}
"#;

/// Calls per timed batch; batches per figure.
const BATCH: usize = 256;
const BATCHES: usize = 40;

fn ok(r: sys::CUresult, what: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// The kernel's eight parameters, as `cuLaunchKernel` takes them.
struct Params {
    ptrs: [u64; 4],
    ints: [i32; 4],
}

impl Params {
    fn array(&mut self) -> [*mut c_void; 8] {
        let p = &mut self.ptrs as *mut u64;
        let i = &mut self.ints as *mut i32;
        // SAFETY: offsets inside the two arrays.
        unsafe {
            [
                p as _,
                i as _,
                p.add(1) as _,
                i.add(1) as _,
                p.add(2) as _,
                i.add(2) as _,
                p.add(3) as _,
                i.add(3) as _,
            ]
        }
    }
}

/// Mean host nanoseconds of `call`, over `BATCHES` batches of `BATCH` calls, with `between`
/// (untimed) after each batch.
fn per_call(mut call: impl FnMut(usize), mut between: impl FnMut()) -> f64 {
    let mut ns = 0u128;
    for b in 0..BATCHES {
        let t = Instant::now();
        for i in 0..BATCH {
            call(b * BATCH + i);
        }
        ns += t.elapsed().as_nanos();
        between();
    }
    ns as f64 / (BATCHES * BATCH) as f64
}

fn main() {
    let nodes: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    let ctx = CudaContext::new(0).expect("a CUDA device");
    let stream = ctx.new_stream().expect("a stream");
    let st = stream.cu_stream();
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL).expect("NVRTC compiles the kernel");
    let module = ctx.load_module(ptx).expect("module");
    let f = module
        .load_function("touch")
        .expect("function")
        .cu_function();
    let buf = stream.alloc_zeros::<f32>(1024).expect("buffer");
    let base = {
        use cudarc::driver::DevicePtr;
        let (p, _g) = buf.device_ptr(&stream);
        p
    };
    let mut params = Params {
        ptrs: [base; 4],
        ints: [1, 2, 3, 7],
    };
    let sync = || stream.synchronize().expect("synchronise");
    let launch = |params: &mut Params| {
        let mut a = params.array();
        // SAFETY: a live function and stream; the parameters match the kernel's.
        let r = unsafe {
            sys::cuLaunchKernel(
                f,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                st,
                a.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        ok(r, "cuLaunchKernel");
    };
    println!("device: {}", ctx.name().unwrap_or_default());

    // Plain launches.
    for _ in 0..BATCH {
        launch(&mut params);
    }
    sync();
    let launch_ns = per_call(|_| launch(&mut params), sync);
    println!("cuLaunchKernel: {launch_ns:.0} ns a call");

    // Events.
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: plain event creation.
    ok(
        unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) },
        "cuEventCreate",
    );
    let record_ns = per_call(
        |_| ok(unsafe { sys::cuEventRecord(ev, st) }, "cuEventRecord"),
        sync,
    );
    println!("cuEventRecord (no timing): {record_ns:.0} ns a call");
    let mut tev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: plain event creation.
    ok(
        unsafe { sys::cuEventCreate(&mut tev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) },
        "cuEventCreate",
    );
    let timed_ns = per_call(
        |_| ok(unsafe { sys::cuEventRecord(tev, st) }, "cuEventRecord"),
        sync,
    );
    println!("cuEventRecord (timing): {timed_ns:.0} ns a call");
    let wait_ns = per_call(
        |_| {
            ok(
                unsafe { sys::cuStreamWaitEvent(st, ev, 0) },
                "cuStreamWaitEvent",
            )
        },
        sync,
    );
    println!("cuStreamWaitEvent: {wait_ns:.0} ns a call");

    // Stream-ordered allocation and free (one pair a call).
    let alloc_ns = per_call(
        |_| {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: a stream-ordered allocation, freed on the same stream at once.
            ok(
                unsafe { sys::cuMemAllocAsync(&mut p, 4096, st) },
                "cuMemAllocAsync",
            );
            ok(unsafe { sys::cuMemFreeAsync(p, st) }, "cuMemFreeAsync");
        },
        sync,
    );
    println!("cuMemAllocAsync + cuMemFreeAsync: {alloc_ns:.0} ns a pair");

    // A graph of `nodes` launches captured from the stream.
    let capture = |params: &mut Params| -> sys::CUgraph {
        let mut g: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: capture of this thread's launches on a live stream.
        unsafe {
            ok(
                sys::cuStreamBeginCapture_v2(
                    st,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "cuStreamBeginCapture",
            );
            for n in 0..nodes {
                params.ints[3] = n as i32;
                launch(params);
            }
            ok(sys::cuStreamEndCapture(st, &mut g), "cuStreamEndCapture");
        }
        g
    };
    let t = Instant::now();
    let mut graphs = Vec::new();
    for _ in 0..BATCH {
        graphs.push(capture(&mut params));
    }
    let capture_ns = t.elapsed().as_nanos() as f64 / BATCH as f64;
    println!(
        "capture of {nodes} launches: {capture_ns:.0} ns a graph ({:.0} ns a node)",
        capture_ns / nodes as f64
    );
    let instantiate = |g: sys::CUgraph| -> sys::CUgraphExec {
        let mut e: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a complete graph.
        ok(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut e, g, 0) },
            "instantiate",
        );
        e
    };
    let t = Instant::now();
    let execs: Vec<sys::CUgraphExec> = graphs.iter().map(|&g| instantiate(g)).collect();
    let inst_ns = t.elapsed().as_nanos() as f64 / BATCH as f64;
    println!("cuGraphInstantiate of {nodes} nodes: {inst_ns:.0} ns a graph");
    let exec = execs[0];
    let t = Instant::now();
    for &g in &graphs[1..] {
        // SAFETY: graphs of the same topology as the exec's.
        let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
        ok(
            unsafe { sys::cuGraphExecUpdate_v2(exec, g, &mut info) },
            "update",
        );
    }
    let update_ns = t.elapsed().as_nanos() as f64 / (BATCH - 1) as f64;
    println!("cuGraphExecUpdate of {nodes} nodes: {update_ns:.0} ns a graph");

    // Node parameters set one by one in the exec.
    let mut count = nodes;
    let mut handles = vec![std::ptr::null_mut(); nodes];
    // SAFETY: the graph the exec was made from; room for every node.
    ok(
        unsafe { sys::cuGraphGetNodes(graphs[0], handles.as_mut_ptr(), &mut count) },
        "cuGraphGetNodes",
    );
    assert_eq!(count, nodes);
    let set_ns = per_call(
        |i| {
            params.ints[3] = (i % 61) as i32;
            let mut a = params.array();
            let p = sys::CUDA_KERNEL_NODE_PARAMS {
                func: f,
                gridDimX: 1,
                gridDimY: 1,
                gridDimZ: 1,
                blockDimX: 32,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: 0,
                kernelParams: a.as_mut_ptr(),
                extra: std::ptr::null_mut(),
                kern: std::ptr::null_mut(),
                ctx: std::ptr::null_mut(),
            };
            // SAFETY: a kernel node of the graph the exec was made from.
            let r = unsafe { sys::cuGraphExecKernelNodeSetParams_v2(exec, handles[i % nodes], &p) };
            ok(r, "cuGraphExecKernelNodeSetParams");
        },
        || {},
    );
    println!("cuGraphExecKernelNodeSetParams: {set_ns:.0} ns a node");
    let glaunch_ns = per_call(
        |_| ok(unsafe { sys::cuGraphLaunch(exec, st) }, "cuGraphLaunch"),
        sync,
    );
    println!(
        "cuGraphLaunch of {nodes} nodes: {glaunch_ns:.0} ns a graph ({:.0} ns a node)",
        glaunch_ns / nodes as f64
    );

    // The device's time per kernel, plain and from graphs.
    let mut t0: sys::CUevent = std::ptr::null_mut();
    // SAFETY: plain event creation.
    ok(
        unsafe { sys::cuEventCreate(&mut t0, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) },
        "cuEventCreate",
    );
    let device_us = |work: &mut dyn FnMut()| -> f64 {
        sync();
        ok(unsafe { sys::cuEventRecord(t0, st) }, "record");
        work();
        ok(unsafe { sys::cuEventRecord(tev, st) }, "record");
        sync();
        let mut ms = 0f32;
        ok(
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, t0, tev) },
            "elapsed",
        );
        ms as f64 * 1e3
    };
    let kernels = 4096usize;
    let plain = device_us(&mut || {
        for _ in 0..kernels {
            launch(&mut params);
        }
    });
    let graphed = device_us(&mut || {
        for _ in 0..kernels / nodes {
            ok(unsafe { sys::cuGraphLaunch(exec, st) }, "cuGraphLaunch");
        }
    });
    println!(
        "device time per kernel, {kernels} in a row: plain launches {:.2} us, from graphs of {nodes} {:.2} us",
        plain / kernels as f64,
        graphed / (kernels / nodes * nodes) as f64
    );
    for (e, g) in execs.into_iter().zip(graphs) {
        // SAFETY: nothing queued uses them after the synchronisation.
        unsafe {
            sys::cuGraphExecDestroy(e);
            sys::cuGraphDestroy(g);
        }
    }
}
