//! Trace replay through the prefix cache: the first 2,000 requests of the Mooncake conversation
//! trace with a finite device tier and an unbounded host tier (write-through), against a separate,
//! simple computation of the same hit rate written here.

use std::collections::HashSet;
use tierkv_engine::cache::PrefixCache;
use tierkv_engine::config::WritePolicy;
use tierkv_engine::engine::page_keys;
use tierkv_engine::pools::PageAllocator;
use tierkv_engine::synth::Synth;
use tierkv_engine::trace::{self, TraceRecord, BLOCK_TOKENS};

const TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/data/mooncake/conversation_trace.jsonl"
);

fn records() -> Vec<TraceRecord> {
    match trace::read_trace(std::path::Path::new(TRACE)) {
        Ok(mut r) => {
            r.truncate(2000);
            eprintln!("replaying the first {} requests of {TRACE}", r.len());
            r
        }
        Err(e) => {
            eprintln!(
                "{e}: the Mooncake trace is absent; using a generated trace of the same format"
            );
            trace::generate(2000, 5)
        }
    }
}

/// Pages hit per request by the simple computation: a page is its (block id, page in block); it
/// hits when it and every page before it were seen in an earlier request.
fn simple_hits(recs: &[TraceRecord]) -> (u64, u64) {
    let per_block = (BLOCK_TOKENS / 64) as usize;
    let mut seen: HashSet<(u64, usize)> = HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for r in recs {
        let pages = r.input_length as usize / 64;
        let ids: Vec<(u64, usize)> = (0..pages)
            .map(|p| (r.hash_ids[p / per_block], p % per_block))
            .collect();
        hits += ids.iter().take_while(|id| seen.contains(id)).count() as u64;
        total += pages as u64;
        seen.extend(ids);
    }
    (hits, total)
}

#[test]
fn hit_rate_matches_a_simple_computation() {
    let recs = records();
    let synth = Synth::new(0);
    let mut cache = PrefixCache::new();
    let mut device = PageAllocator::new(16_384);
    let mut host = PageAllocator::new(1 << 22);
    let (mut dev_hits, mut host_hits, mut total) = (0u64, 0u64, 0u64);
    for r in &recs {
        let tokens = trace::prompt_tokens(r, &synth);
        let keys = page_keys(&tokens, tokens.len() / 64);
        let m = cache.match_prefix(&keys);
        cache.touch(&m.nodes);
        dev_hits += m.device as u64;
        host_hits += m.host as u64;
        total += keys.len() as u64;
        // The request holds its matched device pages and takes fresh ones for the rest (host hits
        // are loaded into fresh pages: here the load is immediate).
        cache.lock(&m.nodes);
        let need = keys.len() - m.device;
        let pages = loop {
            if let Some(p) = device.alloc(need) {
                break p;
            }
            let ev = cache.evict_device(
                need - device.free_count() as usize,
                WritePolicy::WriteThrough,
            );
            assert!(!ev.freed.is_empty(), "device tier cannot make room");
            device.free(&ev.freed);
        };
        let host_part = &m.nodes[m.device..];
        cache.pin_host(host_part);
        cache.begin_load(host_part, &pages[..m.host]);
        cache.finish_load(host_part, true);
        let mut table: Vec<_> = m.nodes[..m.device]
            .iter()
            .map(|&n| cache.node(n).device.unwrap())
            .collect();
        table.extend_from_slice(&pages);
        let ins = cache.insert(&keys, &table);
        device.free(&ins.duplicates);
        cache.unlock(&m.nodes);
        // Write-through to an unbounded host tier.
        if let Some(&last) = ins.nodes.last() {
            let path = cache.needs_backup(last);
            let hp = host.alloc(path.len()).unwrap();
            cache.begin_backup(&path, &hp);
            cache.finish_backup(&path, true);
        }
        if dev_hits % 97 == 0 {
            cache.check_invariants();
        }
    }
    cache.check_invariants();
    let (simple, simple_total) = simple_hits(&recs);
    assert_eq!(total, simple_total);
    let rate = |h: u64| h as f64 / total as f64;
    eprintln!(
        "page hit rate {:.4} (device {:.4}, host {:.4}) over {total} pages; simple computation {:.4}",
        rate(dev_hits + host_hits),
        rate(dev_hits),
        rate(host_hits),
        rate(simple)
    );
    assert_eq!(
        dev_hits + host_hits,
        simple,
        "the cache's hits equal the simple computation"
    );
    assert!(
        host_hits > 0,
        "the finite device tier sends some hits to the host tier"
    );
}

#[test]
fn malformed_traces_name_the_line() {
    let cases = [
        ("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{bad", "line 2"),
        ("{\"timestamp\": -5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}", "timestamp"),
        ("{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}", "missing field `timestamp`"),
        ("{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2, 3]}", "hash_ids"),
        ("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [-1]}", "hash_ids"),
        ("[1, 2]", "line 1"),
    ];
    for (text, needle) in cases {
        let e = trace::parse_jsonl(text).unwrap_err().to_string();
        assert!(e.contains(needle), "{text:?}: {e}");
    }
}
