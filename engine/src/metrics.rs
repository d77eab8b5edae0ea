//! The metrics registry (DESIGN §5): counters and gauges the engine updates as it works, rendered
//! as Prometheus text. Production serves it at `/metrics`; the simulator reads it directly.

use std::fmt::Write;

/// Sum, count and maximum of a latency, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Latency {
    pub count: u64,
    pub sum_ns: u64,
    pub max_ns: u64,
}

impl Latency {
    pub fn observe(&mut self, ns: u64) {
        self.count += 1;
        self.sum_ns += ns;
        self.max_ns = self.max_ns.max(ns);
    }
}

/// Where the host's time in steps went, in nanoseconds of the engine's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepTimes {
    /// Polling copies, admitting requests and building the batch.
    pub schedule_ns: u64,
    /// Building the step's ops and enqueueing them (their launches included).
    pub enqueue_ns: u64,
    /// Blocked on the step's event and reading its digests back; in a step with nothing to
    /// compute, blocked on the oldest copy in flight.
    pub wait_ns: u64,
    /// Acknowledging loads, recording outputs and completing requests (their backups issued).
    pub finish_ns: u64,
}

impl StepTimes {
    pub fn add(&mut self, o: &StepTimes) {
        self.schedule_ns += o.schedule_ns;
        self.enqueue_ns += o.enqueue_ns;
        self.wait_ns += o.wait_ns;
        self.finish_ns += o.finish_ns;
    }
    pub fn total_ns(&self) -> u64 {
        self.schedule_ns + self.enqueue_ns + self.wait_ns + self.finish_ns
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics {
    pub queue_depth: u64,
    pub queued_tokens: u64,
    pub running_requests: u64,
    pub device_pages_used: u64,
    pub device_pages_total: u64,
    pub host_tokens_used: u64,
    pub host_tokens_capacity: u64,
    pub requests_submitted: u64,
    pub rejected_queue_full: u64,
    pub rejected_pending_tokens: u64,
    pub rejected_invalid: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    /// Prompt pages looked up in the prefix cache, and how many hit each tier.
    pub prefix_pages_queried: u64,
    pub prefix_pages_device_hit: u64,
    pub prefix_pages_host_hit: u64,
    pub loads: u64,
    pub load_failures: u64,
    /// Loads whose copy completed, dropped because the device's memory was lost before their
    /// acknowledgement (not failures: no copy failed).
    pub loads_lost: u64,
    pub load_bytes: u64,
    pub load_latency: Latency,
    pub backups: u64,
    pub backup_failures: u64,
    /// Backups dropped because the device's memory was lost under them, their copies unfailed.
    pub backups_lost: u64,
    pub backup_bytes: u64,
    pub backup_latency: Latency,
    pub steps: u64,
    /// Steps whose work the device failed (dropped and run again).
    pub steps_failed: u64,
    /// Steps dropped unfailed: running one step ahead, because the step they were built on
    /// failed (run again as well); and any step in flight when the device's context was
    /// recreated (its requests recompute).
    pub steps_discarded: u64,
    /// Times the device's context was recreated under the engine (its device tier dropped).
    pub context_recreations: u64,
    /// Running requests sent back to the queue to recompute their KV after a recreation.
    pub requests_requeued: u64,
    pub prefill_tokens: u64,
    pub generated_tokens: u64,
    pub step_latency: Latency,
    /// The host's time in steps, summed.
    pub step_host: StepTimes,
    /// The device's compute-stream time in steps, summed (devices that time their work).
    pub step_device: crate::device::DeviceTiming,
}

impl Metrics {
    /// Hit rate of a tier over all prompt pages looked up.
    pub fn hit_rate(&self, hits: u64) -> f64 {
        if self.prefix_pages_queried == 0 {
            0.0
        } else {
            hits as f64 / self.prefix_pages_queried as f64
        }
    }

    /// The plain series: (name, type, help, value).
    fn series(&self) -> [(&'static str, &'static str, &'static str, u64); 26] {
        [
            (
                "queue_depth",
                "gauge",
                "Requests waiting for admission.",
                self.queue_depth,
            ),
            (
                "queued_tokens",
                "gauge",
                "Prompt tokens waiting for admission.",
                self.queued_tokens,
            ),
            (
                "running_requests",
                "gauge",
                "Requests in the running batch.",
                self.running_requests,
            ),
            (
                "device_kv_pages_used",
                "gauge",
                "Device pool pages in use.",
                self.device_pages_used,
            ),
            (
                "device_kv_pages_total",
                "gauge",
                "Device pool pages.",
                self.device_pages_total,
            ),
            (
                "host_tokens_used",
                "gauge",
                "Host tier tokens in use.",
                self.host_tokens_used,
            ),
            (
                "host_tokens_capacity",
                "gauge",
                "Host tier capacity in tokens.",
                self.host_tokens_capacity,
            ),
            (
                "requests_submitted_total",
                "counter",
                "Requests accepted by intake.",
                self.requests_submitted,
            ),
            (
                "requests_finished_total",
                "counter",
                "Requests completed.",
                self.requests_finished,
            ),
            (
                "requests_aborted_total",
                "counter",
                "Requests aborted.",
                self.requests_aborted,
            ),
            (
                "prefix_pages_queried_total",
                "counter",
                "Prompt pages looked up.",
                self.prefix_pages_queried,
            ),
            (
                "loads_total",
                "counter",
                "Host to device loads.",
                self.loads,
            ),
            (
                "load_failures_total",
                "counter",
                "Loads whose copy failed.",
                self.load_failures,
            ),
            (
                "load_bytes_total",
                "counter",
                "Bytes loaded host to device.",
                self.load_bytes,
            ),
            (
                "backups_total",
                "counter",
                "Device to host backups.",
                self.backups,
            ),
            (
                "backup_failures_total",
                "counter",
                "Backups whose copy failed.",
                self.backup_failures,
            ),
            (
                "backup_bytes_total",
                "counter",
                "Bytes backed up device to host.",
                self.backup_bytes,
            ),
            ("steps_total", "counter", "Model steps.", self.steps),
            (
                "steps_failed_total",
                "counter",
                "Steps whose work the device failed, dropped and run again.",
                self.steps_failed,
            ),
            (
                "steps_discarded_total",
                "counter",
                "Steps dropped unfailed: built on a failed step (running one step ahead), or in flight when the device context was recreated.",
                self.steps_discarded,
            ),
            (
                "loads_lost_total",
                "counter",
                "Loads whose copy completed, dropped because the device memory was lost before their acknowledgement.",
                self.loads_lost,
            ),
            (
                "backups_lost_total",
                "counter",
                "Backups dropped unfailed because the device memory was lost under them.",
                self.backups_lost,
            ),
            (
                "context_recreations_total",
                "counter",
                "Times the device context was recreated under the engine, its device tier dropped.",
                self.context_recreations,
            ),
            (
                "requests_requeued_total",
                "counter",
                "Running requests sent back to the queue to recompute their KV after a context recreation.",
                self.requests_requeued,
            ),
            (
                "prefill_tokens_total",
                "counter",
                "Prompt tokens computed.",
                self.prefill_tokens,
            ),
            (
                "generated_tokens_total",
                "counter",
                "Tokens generated.",
                self.generated_tokens,
            ),
        ]
    }

    /// Prometheus text exposition format.
    pub fn render_prometheus(&self) -> String {
        let mut s = String::new();
        for (name, kind, help, v) in self.series() {
            let _ = writeln!(
                s,
                "# HELP tierkv_{name} {help}\n# TYPE tierkv_{name} {kind}\ntierkv_{name} {v}"
            );
        }
        let labelled = [
            (
                "requests_rejected_total",
                "counter",
                "Requests rejected by admission control.",
                "reason",
                [
                    ("queue_full", self.rejected_queue_full as f64),
                    ("pending_tokens", self.rejected_pending_tokens as f64),
                    ("invalid", self.rejected_invalid as f64),
                ]
                .to_vec(),
            ),
            (
                "prefix_hit_rate",
                "gauge",
                "Prompt pages found in the prefix cache, per tier.",
                "tier",
                [
                    ("device", self.hit_rate(self.prefix_pages_device_hit)),
                    ("host", self.hit_rate(self.prefix_pages_host_hit)),
                ]
                .to_vec(),
            ),
            (
                "step_host_seconds_total",
                "counter",
                "Host time in steps, per phase.",
                "phase",
                [
                    ("schedule", self.step_host.schedule_ns as f64 / 1e9),
                    ("enqueue", self.step_host.enqueue_ns as f64 / 1e9),
                    ("wait", self.step_host.wait_ns as f64 / 1e9),
                    ("finish", self.step_host.finish_ns as f64 / 1e9),
                ]
                .to_vec(),
            ),
            (
                "step_device_seconds_total",
                "counter",
                "Compute-stream time in steps (devices that time their work): running ops, and stalled on loads.",
                "part",
                [
                    ("busy", self.step_device.busy_ns as f64 / 1e9),
                    ("stalled", self.step_device.stalled_ns as f64 / 1e9),
                ]
                .to_vec(),
            ),
        ];
        for (name, kind, help, label, values) in labelled {
            let _ = writeln!(
                s,
                "# HELP tierkv_{name} {help}\n# TYPE tierkv_{name} {kind}"
            );
            for (l, v) in values {
                let _ = writeln!(s, "tierkv_{name}{{{label}=\"{l}\"}} {v}");
            }
        }
        for (name, l) in [
            ("load", self.load_latency),
            ("backup", self.backup_latency),
            ("step", self.step_latency),
        ] {
            let _ = writeln!(
                s,
                "# HELP tierkv_{name}_latency_seconds Latency of {name}s.\n\
                 # TYPE tierkv_{name}_latency_seconds summary\n\
                 tierkv_{name}_latency_seconds_sum {}\n\
                 tierkv_{name}_latency_seconds_count {}\n\
                 tierkv_{name}_latency_seconds_max {}",
                l.sum_ns as f64 * 1e-9,
                l.count,
                l.max_ns as f64 * 1e-9
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latency_sums_counts_and_keeps_the_maximum() {
        let mut l = Latency::default();
        for ns in [3, 9, 4] {
            l.observe(ns);
        }
        assert_eq!(
            l,
            Latency {
                count: 3,
                sum_ns: 16,
                max_ns: 9
            }
        );
    }

    #[test]
    fn step_times_add_up_per_phase_and_in_total() {
        let t = StepTimes {
            schedule_ns: 1,
            enqueue_ns: 20,
            wait_ns: 300,
            finish_ns: 4000,
        };
        assert_eq!(t.total_ns(), 4321);
        let mut sum = t;
        sum.add(&t);
        assert_eq!(sum.total_ns(), 8642);
        assert_eq!(sum.wait_ns, 600);
    }

    /// A tier's hit rate is its hits over the prompt pages looked up, and 0 before any.
    #[test]
    fn a_hit_rate_is_hits_over_pages_looked_up() {
        let mut m = Metrics::default();
        assert_eq!(m.hit_rate(0), 0.0);
        m.prefix_pages_queried = 8;
        assert_eq!(m.hit_rate(2), 0.25);
    }

    /// Nanosecond counters are exported in seconds.
    #[test]
    fn host_phases_are_exported_in_seconds() {
        let m = Metrics {
            step_host: StepTimes {
                schedule_ns: 1_500_000_000,
                enqueue_ns: 750_000_000,
                wait_ns: 2_000_000_000,
                finish_ns: 250_000_000,
            },
            step_device: crate::device::DeviceTiming {
                busy_ns: 3_000_000_000,
                stalled_ns: 500_000_000,
                ..Default::default()
            },
            ..Metrics::default()
        };
        let text = m.render_prometheus();
        for line in [
            "tierkv_step_device_seconds_total{part=\"busy\"} 3",
            "tierkv_step_device_seconds_total{part=\"stalled\"} 0.5",
            "tierkv_step_host_seconds_total{phase=\"enqueue\"} 0.75",
            "tierkv_step_host_seconds_total{phase=\"schedule\"} 1.5",
            "tierkv_step_host_seconds_total{phase=\"wait\"} 2",
            "tierkv_step_host_seconds_total{phase=\"finish\"} 0.25",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
        }
    }
}
