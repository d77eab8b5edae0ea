//! The fault and timing model: how long each op runs and whether it is slow, fails, hangs,
//! tears or is refused, each drawn for the call's identity (its stream and call number there,
//! `keyed`) rather than in sequence; how long the schedule holds an op; the driver's own refusals.

use super::*;

/// What each keyed draw decides (`SimGpu::keyed`).
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

impl SimGpu {
    /// A uniform draw in [0, 1) for deciding `what` about the call numbered `n` on stream `s`:
    /// keyed by the call's identity rather than taken in sequence, so that a schedule which
    /// reorders calls across streams draws the same fault for the same call.
    pub(super) fn keyed(&self, what: u64, s: usize, n: u64) -> f64 {
        (self.keyed_bits(what, s, n) >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(super) fn keyed_bits(&self, what: u64, s: usize, n: u64) -> u64 {
        use tierkv_kernels::cpu::numerics::mix64;
        mix64(mix64(mix64(self.fault_key ^ what) ^ s as u64) ^ n)
    }

    /// A keyed draw uniform in `0..=max`.
    pub(super) fn keyed_below(&self, what: u64, s: usize, n: u64, max: u64) -> u64 {
        ((self.keyed(what, s, n) * (max + 1) as f64) as u64).min(max)
    }

    /// The calls of a side in error fail (`GpuOptions::context_faults`, a hang). The device
    /// first runs up to the host's time, so a fault that happened by now is seen.
    pub(super) fn refuse_in_error(&mut self, what: u64) -> Result<(), DeviceError> {
        if self.opts.context_faults || self.opts.hang_rate > 0.0 {
            let now = self.host.get();
            self.pump(now);
        }
        match self.in_error[self.side] {
            Some(cause) => {
                probes::hit(SimProbe::FaultCallInError);
                self.log(&[16, self.side as u64, what]);
                Err(DeviceError::InError { cause })
            }
            None => Ok(()),
        }
    }

    /// The op's duration, whether it fails, and whether it hangs (then it fails too, and lasts
    /// until the watchdog). `s` and `n`: its stream and its key there (`push_op`).
    pub(super) fn duration(&mut self, op: &Op, s: usize, n: u64) -> (u64, bool, bool) {
        let bytes = op.bytes_touched().0;
        if self.opts.hang_rate > 0.0 && self.keyed(KEY_HANGS, s, n) < self.opts.hang_rate {
            probes::hit(SimProbe::FaultHung);
            return (WATCHDOG_NS, true, true);
        }
        let (d, fail) = match op.spec().class() {
            OpClass::PageCopy | OpClass::LinearCopy => {
                let base = self.opts.copy_latency_ns
                    + (bytes as f64 / 2.0 / self.opts.copy_bytes_per_ns) as u64;
                let mut d = base + self.keyed_below(KEY_DURATION, s, n, base / 4);
                if self.opts.slow_copy_rate > 0.0
                    && self.keyed(KEY_SLOW, s, n) < self.opts.slow_copy_rate
                {
                    probes::hit(SimProbe::FaultCopySlow);
                    d *= self.opts.slow_copy_factor;
                }
                let fail = op.spec().class() == OpClass::PageCopy
                    && self.opts.failed_copy_rate > 0.0
                    && self.keyed(KEY_COPY_FAILS, s, n) < self.opts.failed_copy_rate;
                probes::hit_if(SimProbe::FaultCopyFailed, fail);
                (d, fail)
            }
            OpClass::Kernel => {
                let base =
                    self.opts.kernel_ns + (bytes as f64 / self.opts.kernel_bytes_per_ns) as u64;
                let d = base + self.keyed_below(KEY_DURATION, s, n, base / 2);
                let fail = self.opts.failed_kernel_rate > 0.0
                    && self.keyed(KEY_KERNEL_FAILS, s, n) < self.opts.failed_kernel_rate;
                (d, fail)
            }
        };
        (d, fail, false)
    }

    /// How long the op that could start on `stream` now is held: the schedule's decision.
    pub(super) fn start_delay(&mut self, stream: usize) -> u64 {
        self.sched.decide(stream) as u64 * self.opts.jitter_ns / 4
    }

    /// A torn copy (`torn_copy_rate`): the op as two page copies, the first half of its pages
    /// first. `None`: the op stays whole.
    pub(super) fn tear(&mut self, op: &Op, s: usize, n: u64) -> Option<(Op, Op)> {
        let Op::PageCopy(c) = op else {
            return None;
        };
        let pages: u32 = c.runs.iter().map(|r| r.count).sum();
        if pages < 2
            || self.opts.torn_copy_rate <= 0.0
            || self.keyed(KEY_TORN, s, n) >= self.opts.torn_copy_rate
        {
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

    /// Faults stop (the liveness phase of a run): no more slow, torn or failed copies, failed
    /// or refused launches, hangs or late completions. A stream or side already in error stays
    /// so until the engine recovers the device.
    pub fn stop_faults(&mut self) {
        self.opts.slow_copy_rate = 0.0;
        self.opts.failed_copy_rate = 0.0;
        self.opts.failed_enqueue_rate = 0.0;
        self.opts.failed_kernel_rate = 0.0;
        self.opts.torn_copy_rate = 0.0;
        self.opts.completion_delay_ns = 0;
        self.opts.refused_launch_rate = 0.0;
        self.opts.hang_rate = 0.0;
        self.opts.driver_fault_rate = 0.0;
    }

    /// The simulated driver's calls may fail by faults of their own from now on (the engine is
    /// built: its construction meets the allocation faults of `fail_alloc_nth` alone).
    pub fn arm_driver_faults(&mut self) {
        self.driver_armed = true;
    }

    /// Whether the simulated driver's call number `n` of kind `call` by entity `e` (the
    /// driver's own numbering of a side's streams and its calls of no stream) is refused by a fault of its own
    /// (`GpuOptions::driver_fault_rate`, times `factor`, at most one call in four: the engine
    /// repeats a refused call a few times, and a call refused every time would stop it).
    /// Logged when it is.
    pub(crate) fn driver_refuses(&mut self, call: u64, e: usize, n: u64, factor: f64) -> bool {
        let rate = (self.opts.driver_fault_rate * factor).min(0.25);
        let refused =
            self.driver_armed && rate > 0.0 && self.keyed(KEY_DRIVER_CALL + call, e, n) < rate;
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
