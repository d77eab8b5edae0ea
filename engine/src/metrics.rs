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
    pub load_bytes: u64,
    pub load_latency: Latency,
    pub backups: u64,
    pub backup_failures: u64,
    pub backup_bytes: u64,
    pub backup_latency: Latency,
    pub steps: u64,
    pub prefill_tokens: u64,
    pub generated_tokens: u64,
    pub step_latency: Latency,
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

    /// Prometheus text exposition format.
    pub fn render_prometheus(&self) -> String {
        let mut s = String::new();
        let mut g = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(
                s,
                "# HELP tierkv_{name} {help}\n# TYPE tierkv_{name} {kind}\ntierkv_{name} {v}"
            );
        };
        g(
            "queue_depth",
            "gauge",
            "Requests waiting for admission.",
            self.queue_depth.to_string(),
        );
        g(
            "queued_tokens",
            "gauge",
            "Prompt tokens waiting for admission.",
            self.queued_tokens.to_string(),
        );
        g(
            "running_requests",
            "gauge",
            "Requests in the running batch.",
            self.running_requests.to_string(),
        );
        g(
            "device_kv_pages_used",
            "gauge",
            "Device pool pages in use.",
            self.device_pages_used.to_string(),
        );
        g(
            "device_kv_pages_total",
            "gauge",
            "Device pool pages.",
            self.device_pages_total.to_string(),
        );
        g(
            "host_tokens_used",
            "gauge",
            "Host tier tokens in use.",
            self.host_tokens_used.to_string(),
        );
        g(
            "host_tokens_capacity",
            "gauge",
            "Host tier capacity in tokens.",
            self.host_tokens_capacity.to_string(),
        );
        g(
            "requests_submitted_total",
            "counter",
            "Requests accepted by intake.",
            self.requests_submitted.to_string(),
        );
        g(
            "requests_finished_total",
            "counter",
            "Requests completed.",
            self.requests_finished.to_string(),
        );
        g(
            "requests_aborted_total",
            "counter",
            "Requests aborted.",
            self.requests_aborted.to_string(),
        );
        let _ = writeln!(
            s,
            "# HELP tierkv_requests_rejected_total Requests rejected by admission control.\n\
             # TYPE tierkv_requests_rejected_total counter\n\
             tierkv_requests_rejected_total{{reason=\"queue_full\"}} {}\n\
             tierkv_requests_rejected_total{{reason=\"pending_tokens\"}} {}\n\
             tierkv_requests_rejected_total{{reason=\"invalid\"}} {}",
            self.rejected_queue_full, self.rejected_pending_tokens, self.rejected_invalid
        );
        let _ = writeln!(
            s,
            "# HELP tierkv_prefix_hit_rate Prompt pages found in the prefix cache, per tier.\n\
             # TYPE tierkv_prefix_hit_rate gauge\n\
             tierkv_prefix_hit_rate{{tier=\"device\"}} {}\n\
             tierkv_prefix_hit_rate{{tier=\"host\"}} {}",
            self.hit_rate(self.prefix_pages_device_hit),
            self.hit_rate(self.prefix_pages_host_hit)
        );
        let mut g = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(
                s,
                "# HELP tierkv_{name} {help}\n# TYPE tierkv_{name} {kind}\ntierkv_{name} {v}"
            );
        };
        g(
            "prefix_pages_queried_total",
            "counter",
            "Prompt pages looked up.",
            self.prefix_pages_queried.to_string(),
        );
        g(
            "loads_total",
            "counter",
            "Host to device loads.",
            self.loads.to_string(),
        );
        g(
            "load_failures_total",
            "counter",
            "Loads whose copy failed.",
            self.load_failures.to_string(),
        );
        g(
            "load_bytes_total",
            "counter",
            "Bytes loaded host to device.",
            self.load_bytes.to_string(),
        );
        g(
            "backups_total",
            "counter",
            "Device to host backups.",
            self.backups.to_string(),
        );
        g(
            "backup_failures_total",
            "counter",
            "Backups whose copy failed.",
            self.backup_failures.to_string(),
        );
        g(
            "backup_bytes_total",
            "counter",
            "Bytes backed up device to host.",
            self.backup_bytes.to_string(),
        );
        g(
            "steps_total",
            "counter",
            "Model steps.",
            self.steps.to_string(),
        );
        g(
            "prefill_tokens_total",
            "counter",
            "Prompt tokens computed.",
            self.prefill_tokens.to_string(),
        );
        g(
            "generated_tokens_total",
            "counter",
            "Tokens generated.",
            self.generated_tokens.to_string(),
        );
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
