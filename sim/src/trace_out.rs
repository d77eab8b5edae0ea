//! Chrome trace JSON (opens in Perfetto and chrome://tracing): one track per stream, one slice per
//! op, failed copies and the racing pair marked.

use crate::gpu::Slice;
use serde_json::{json, Value};

pub fn chrome_trace(slices: &[Slice], racing_ops: &[u64], title: &str) -> String {
    let mut events: Vec<Value> = Vec::new();
    events.push(
        json!({"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": title}}),
    );
    for (tid, name) in [
        (0, "compute stream"),
        (1, "load stream"),
        (2, "write stream"),
    ] {
        events.push(
            json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}),
        );
        events.push(json!({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}}));
    }
    for s in slices {
        let racing = racing_ops.contains(&s.op_id);
        let mut e = json!({
            "name": if racing { format!("RACE {}", s.name) } else { s.name.to_string() },
            "cat": "op",
            "ph": "X",
            "ts": s.start_ns as f64 / 1000.0,
            "dur": (s.end_ns - s.start_ns).max(1) as f64 / 1000.0,
            "pid": 1,
            "tid": s.stream.index(),
            "args": {"op": s.op_id, "detail": s.detail, "failed": s.failed, "racing": racing},
        });
        if racing {
            e["cname"] = json!("terrible");
        } else if s.failed {
            e["cname"] = json!("bad");
        }
        events.push(e);
        if racing {
            events.push(json!({
                "name": format!("race: op {}", s.op_id), "ph": "i", "s": "g",
                "ts": s.start_ns as f64 / 1000.0, "pid": 1, "tid": s.stream.index(),
            }));
        }
    }
    serde_json::to_string(&json!({"traceEvents": events, "displayTimeUnit": "ns"})).expect("json")
}
