//! Chrome trace JSON (opens in Perfetto and chrome://tracing): one track per stream and one for
//! the host, one slice per op, failed ops, skipped ops and the racing pair marked; event records, the
//! stream waits and host synchronisations they release, joined by flow arrows.

use crate::gpu::{Mark, Slice};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The host's track (after the first side's three streams; a pair's decode streams follow it).
const HOST_TID: usize = 3;

/// A stream's track: the first side's at 0..3, the decode side's after the host's.
fn tid(stream: usize) -> usize {
    if stream < HOST_TID {
        stream
    } else {
        stream + 1
    }
}
/// How long a record, wait or instant host call is drawn, µs (long enough to click).
const MARK_US: f64 = 0.05;

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

pub fn chrome_trace(slices: &[Slice], marks: &[Mark], racing_ops: &[u64], title: &str) -> String {
    let mut events: Vec<Value> = Vec::new();
    events.push(
        json!({"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": title}}),
    );
    let pair = slices.iter().any(|s| s.stream >= HOST_TID);
    let decode = [
        (4, "decode compute stream"),
        (5, "decode load stream"),
        (6, "decode write stream"),
    ];
    for (tid, name) in [
        (0, "compute stream"),
        (1, "load stream"),
        (2, "write stream"),
        (HOST_TID, "host"),
    ]
    .into_iter()
    .chain(decode.into_iter().filter(|_| pair))
    {
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
            "ts": us(s.start_ns),
            "dur": (s.end_ns - s.start_ns).max(1) as f64 / 1000.0,
            "pid": 1,
            "tid": tid(s.stream),
            "args": {"op": s.op_id, "detail": s.detail, "failed": s.failed, "skipped": s.skipped, "racing": racing},
        });
        if racing {
            e["cname"] = json!("terrible");
        } else if s.failed {
            e["cname"] = json!("bad");
        } else if s.skipped {
            e["cname"] = json!("grey");
        }
        events.push(e);
        if racing {
            events.push(json!({
                "name": format!("race: op {}", s.op_id), "ph": "i", "s": "g",
                "ts": us(s.start_ns), "pid": 1, "tid": tid(s.stream),
            }));
        }
    }
    // Where and when each record completed: the tail of its arrows.
    let records: BTreeMap<u64, (usize, u64)> = marks
        .iter()
        .filter_map(|m| match *m {
            Mark::Record { stream, rec, at } => Some((rec, (tid(stream), at))),
            _ => None,
        })
        .collect();
    let mut flow = 0u64;
    let mut arrow = |events: &mut Vec<Value>, rec: u64, tid: usize, at: u64| {
        if let Some(&(from, done)) = records.get(&rec) {
            flow += 1;
            events.push(
                json!({"name": format!("record {rec}"), "cat": "event", "ph": "s",
                "id": flow, "ts": us(done), "pid": 1, "tid": from}),
            );
            events.push(
                json!({"name": format!("record {rec}"), "cat": "event", "ph": "f",
                "bp": "e", "id": flow, "ts": us(at), "pid": 1, "tid": tid}),
            );
        }
    };
    for m in marks {
        match *m {
            Mark::Record { stream, rec, at } => events.push(json!({
                "name": format!("record {rec}"), "cat": "event", "ph": "X", "ts": us(at),
                "dur": MARK_US, "pid": 1, "tid": tid(stream), "args": {"record": rec},
            })),
            Mark::Wait { stream, rec, at } => {
                events.push(json!({
                    "name": format!("wait {rec}"), "cat": "event", "ph": "X", "ts": us(at),
                    "dur": MARK_US, "pid": 1, "tid": tid(stream), "args": {"record": rec},
                }));
                arrow(&mut events, rec, tid(stream), at);
            }
            Mark::Host {
                what,
                start,
                end,
                rec,
            } => {
                events.push(json!({
                    "name": what, "cat": "host", "ph": "X", "ts": us(start),
                    "dur": ((end - start) as f64 / 1000.0).max(MARK_US), "pid": 1,
                    "tid": HOST_TID, "args": {"record": rec},
                }));
                if let Some(rec) = rec {
                    arrow(&mut events, rec, HOST_TID, end);
                }
            }
        }
    }
    serde_json::to_string(&json!({"traceEvents": events, "displayTimeUnit": "ns"})).expect("json")
}
