//! The fault and timing model (`FaultModel`): how long each op runs and whether it is slow,
//! fails, hangs, tears or is refused, each drawn for the call's identity (its stream and call
//! number there, `FaultModel::keyed`) rather than in sequence, and the driver's own refusals
//! (keyed by the call's kind, its stream or entity, and its number among such calls); and the
//! `SimGpu` calls around it: a side in error, the faults' end, how long the schedule holds an op
//! (the `Decider`'s decision, in jitters).

use super::*;

/// What each keyed draw decides (`FaultModel::keyed`).
pub(super) const KEY_COPY_FAILS: u64 = 1;

pub(super) const KEY_KERNEL_FAILS: u64 = 2;

pub(super) const KEY_HANGS: u64 = 3;

pub(super) const KEY_LAUNCH_REFUSED: u64 = 4;

pub(super) const KEY_TORN: u64 = 5;

pub(super) const KEY_ENQUEUE_REFUSED: u64 = 6;

pub(super) const KEY_DURATION: u64 = 7;

pub(super) const KEY_SLOW: u64 = 8;

pub(super) const KEY_GARBAGE: u64 = 9;

/// Driver calls' own faults: this plus the call's kind (`driver.rs`).
pub(super) const KEY_DRIVER_CALL: u64 = 0x100;

/// The fault and timing model: every draw of how long an op runs and whether it is slow, fails,
/// hangs, tears or is refused, and of the simulated driver's own refusals. It holds its rates,
/// latencies and bandwidths (copied from `GpuOptions` when the GPU is made; `stop` zeroes the
/// rates for a run's liveness phase) and the key of its draws, and nothing of the streams: each
/// answer is a function of the call's identity (its stream and its number there), so a schedule
/// that reorders calls across streams draws the same fault for the same call.
#[derive(Clone, Debug)]
pub(super) struct FaultModel {
    /// The seed of the keyed draws.
    key: u64,
    /// The simulated driver's own faults are drawn (`SimGpu::arm_driver_faults`).
    driver_armed: bool,
    kernel_ns: u64,
    kernel_bytes_per_ns: f64,
    copy_latency_ns: u64,
    copy_bytes_per_ns: f64,
    slow_copy_rate: f64,
    slow_copy_factor: u64,
    failed_copy_rate: f64,
    failed_enqueue_rate: f64,
    failed_kernel_rate: f64,
    refused_launch_rate: f64,
    hang_rate: f64,
    torn_copy_rate: f64,
    driver_fault_rate: f64,
}

impl FaultModel {
    /// The model of `o`, its draws keyed by `seed`.
    pub(super) fn new(seed: u64, o: &GpuOptions) -> FaultModel {
        FaultModel {
            key: tierkv_kernels::cpu::numerics::mix64(seed ^ 0xFA17_0000),
            driver_armed: false,
            kernel_ns: o.kernel_ns,
            kernel_bytes_per_ns: o.kernel_bytes_per_ns,
            copy_latency_ns: o.copy_latency_ns,
            copy_bytes_per_ns: o.copy_bytes_per_ns,
            slow_copy_rate: o.slow_copy_rate,
            slow_copy_factor: o.slow_copy_factor,
            failed_copy_rate: o.failed_copy_rate,
            failed_enqueue_rate: o.failed_enqueue_rate,
            failed_kernel_rate: o.failed_kernel_rate,
            refused_launch_rate: o.refused_launch_rate,
            hang_rate: o.hang_rate,
            torn_copy_rate: o.torn_copy_rate,
            driver_fault_rate: o.driver_fault_rate,
        }
    }

    /// A uniform draw in [0, 1) for deciding `what` about the call numbered `n` on stream `s`.
    fn keyed(&self, what: u64, s: usize, n: u64) -> f64 {
        (self.keyed_bits(what, s, n) >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(super) fn keyed_bits(&self, what: u64, s: usize, n: u64) -> u64 {
        use tierkv_kernels::cpu::numerics::mix64;
        mix64(mix64(mix64(self.key ^ what) ^ s as u64) ^ n)
    }

    /// A keyed draw uniform in `0..=max`.
    fn keyed_below(&self, what: u64, s: usize, n: u64, max: u64) -> u64 {
        ((self.keyed(what, s, n) * (max + 1) as f64) as u64).min(max)
    }

    /// Whether the keyed draw of `what` for call `n` on `s` falls under `rate`.
    fn chance(&self, what: u64, s: usize, n: u64, rate: f64) -> bool {
        rate > 0.0 && self.keyed(what, s, n) < rate
    }

    /// Ops may still hang (a side in error may then appear without a call failing).
    pub(super) fn hangs(&self) -> bool {
        self.hang_rate > 0.0
    }

    /// The op's duration, whether it fails, and whether it hangs (then it fails too, and lasts
    /// until the watchdog). `s` and `n`: its stream and its key there (`push_op`).
    pub(super) fn duration(&self, op: &Op, s: usize, n: u64) -> (u64, bool, bool) {
        let bytes = op.bytes_touched().0;
        if self.chance(KEY_HANGS, s, n, self.hang_rate) {
            probes::hit(SimProbe::FaultHung);
            return (WATCHDOG_NS, true, true);
        }
        let (d, fail) = match op.spec().class() {
            OpClass::PageCopy | OpClass::LinearCopy => {
                let base =
                    self.copy_latency_ns + (bytes as f64 / 2.0 / self.copy_bytes_per_ns) as u64;
                let mut d = base + self.keyed_below(KEY_DURATION, s, n, base / 4);
                if self.chance(KEY_SLOW, s, n, self.slow_copy_rate) {
                    probes::hit(SimProbe::FaultCopySlow);
                    d *= self.slow_copy_factor;
                }
                let fail = op.spec().class() == OpClass::PageCopy
                    && self.chance(KEY_COPY_FAILS, s, n, self.failed_copy_rate);
                probes::hit_if(SimProbe::FaultCopyFailed, fail);
                (d, fail)
            }
            OpClass::Kernel => {
                let base = self.kernel_ns + (bytes as f64 / self.kernel_bytes_per_ns) as u64;
                let d = base + self.keyed_below(KEY_DURATION, s, n, base / 2);
                let fail = self.chance(KEY_KERNEL_FAILS, s, n, self.failed_kernel_rate);
                (d, fail)
            }
        };
        (d, fail, false)
    }

    /// Whether enqueue call `n` on `s`, a kernel's, is refused with out-of-memory.
    pub(super) fn launch_refused(&self, s: usize, n: u64) -> bool {
        self.chance(KEY_LAUNCH_REFUSED, s, n, self.refused_launch_rate)
    }

    /// Whether enqueue call `n` on `s`, a page copy's, is refused by the backend.
    pub(super) fn enqueue_refused(&self, s: usize, n: u64) -> bool {
        self.chance(KEY_ENQUEUE_REFUSED, s, n, self.failed_enqueue_rate)
    }

    /// A torn copy (`torn_copy_rate`): the op as two page copies, the first half of its pages
    /// first. `None`: the op stays whole.
    pub(super) fn tear(&self, op: &Op, s: usize, n: u64) -> Option<(Op, Op)> {
        let Op::PageCopy(c) = op else {
            return None;
        };
        let pages: u32 = c.runs.iter().map(|r| r.count).sum();
        if pages < 2 || !self.chance(KEY_TORN, s, n, self.torn_copy_rate) {
            return None;
        }
        probes::hit(SimProbe::FaultCopyTorn);
        let (mut first, mut second) = (Vec::new(), Vec::new());
        let mut left = pages / 2;
        for r in &c.runs {
            let take = r.count.min(left);
            left -= take;
            if take > 0 {
                first.push(PageRun { count: take, ..*r });
            }
            if take < r.count {
                second.push(PageRun {
                    src: PageId(r.src.0 + take),
                    dst: PageId(r.dst.0 + take),
                    count: r.count - take,
                });
            }
        }
        let half = |runs| Op::PageCopy(PageCopy { runs, ..c.clone() });
        Some((half(first), half(second)))
    }

    /// Whether the simulated driver's call number `n` of kind `call` by entity `e` is refused
    /// by a fault of its own (`GpuOptions::driver_fault_rate`, times `factor`, at most one call
    /// in four: the engine repeats a refused call a few times, and a call refused every time
    /// would stop it). Never before `arm_driver`.
    pub(super) fn driver_refuses(&self, call: u64, e: usize, n: u64, factor: f64) -> bool {
        let rate = (self.driver_fault_rate * factor).min(0.25);
        self.driver_armed && self.chance(KEY_DRIVER_CALL + call, e, n, rate)
    }

    /// The driver's calls may fail by faults of their own from now on.
    pub(super) fn arm_driver(&mut self) {
        self.driver_armed = true;
    }

    /// No more slow, torn or failed copies, failed or refused launches, hangs or driver faults.
    pub(super) fn stop(&mut self) {
        self.slow_copy_rate = 0.0;
        self.failed_copy_rate = 0.0;
        self.failed_enqueue_rate = 0.0;
        self.failed_kernel_rate = 0.0;
        self.torn_copy_rate = 0.0;
        self.refused_launch_rate = 0.0;
        self.hang_rate = 0.0;
        self.driver_fault_rate = 0.0;
    }
}

impl SimGpu {
    /// The calls of a side in error fail (`GpuOptions::context_faults`, a hang). The device
    /// first runs up to the host's time, so a fault that happened by now is seen.
    pub(super) fn refuse_in_error(&mut self, what: u64) -> Result<(), DeviceError> {
        if self.opts.context_faults || self.faults.hangs() {
            let now = self.host.get();
            self.pump(now);
        }
        match self.contexts.in_error[self.side] {
            Some(cause) => {
                probes::hit(SimProbe::FaultCallInError);
                self.log(&[16, self.side as u64, what]);
                Err(DeviceError::InError { cause })
            }
            None => Ok(()),
        }
    }

    /// When the op that could start on `stream` at `at` starts: when the schedule's decision
    /// holds it to, made knowing the ops running then on the other streams that it may wait
    /// behind (not a hung one, which only the watchdog ends).
    pub(super) fn start_at(&mut self, stream: usize, at: u64) -> u64 {
        let mut running = [(0, 0); STREAMS];
        let mut n = 0;
        for (j, st) in self.streams.iter().enumerate() {
            if let Some((op, _, end)) = &st.running {
                if j != stream && !op.hung && *end > at {
                    running[n] = (j, *end);
                    n += 1;
                }
            }
        }
        match schedule::hold(self.sched.decide(stream, &running[..n])) {
            Hold::Quarters(q) => at + q as u64 * self.opts.jitter_ns / 4,
            // Not a hung op, as above: only a replayed hold can name one.
            Hold::Behind(j) => match &self.streams[j].running {
                Some((op, _, end)) if !op.hung => at.max(*end),
                _ => at,
            },
        }
    }

    /// Faults stop (the liveness phase of a run): no more slow, torn or failed copies, failed
    /// or refused launches, hangs or late completions. A stream or side already in error stays
    /// so until the engine recovers the device.
    pub fn stop_faults(&mut self) {
        self.faults.stop();
        self.opts.completion_delay_ns = 0;
    }

    /// The simulated driver's calls may fail by faults of their own from now on (the engine is
    /// built: its construction meets the allocation faults of `fail_alloc_nth` alone).
    pub fn arm_driver_faults(&mut self) {
        self.faults.arm_driver();
    }

    /// Whether the simulated driver's call number `n` of kind `call` by entity `e` (the
    /// driver's own numbering of a side's streams and its calls of no stream) is refused by a
    /// fault of its own (`FaultModel::driver_refuses`). Logged when it is.
    pub(crate) fn driver_refuses(&mut self, call: u64, e: usize, n: u64, factor: f64) -> bool {
        let refused = self.faults.driver_refuses(call, e, n, factor);
        if refused {
            self.log(&[31, call, e as u64, n]);
        }
        refused
    }

    /// Fails a call of a side in error (`what` numbers the call kind in the log).
    pub(crate) fn refuse(&mut self, what: u64) -> Result<(), DeviceError> {
        self.refuse_in_error(what)
    }
}
