//! Trace replay through the prefix cache: the whole Mooncake conversation trace (12,031 requests)
//! with a finite device tier and an unbounded host tier (write-through), against separate,
//! simple computations written here: the total hit rate (a page hits when it and every page before
//! it were seen), and the split between the tiers (an LRU model of the device tier over the trace's
//! own block ids, independent of the radix tree and of the token contents).

use std::collections::{BTreeSet, HashMap, HashSet};
use tierkv_engine::engine::page_keys;
use tierkv_engine::synth::Synth;
use tierkv_engine::trace::cache_replay::{prompt_page_keys, CacheReplay, CacheReplayError};
use tierkv_engine::trace::{self, TraceRecord, BLOCK_TOKENS};

/// The full Mooncake conversation trace: `TIERKV_MOONCAKE_TRACE` (set and unreadable is a test
/// failure, never a quiet fallback), else the copy kept beside the checkout in tierkv's
/// development setup when it is there, else the repository's excerpt. The test prints which
/// trace it replayed.
const TRACE_BESIDE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/data/mooncake/conversation_trace.jsonl"
);

/// The first 1,000 requests of the conversation trace, shipped with the repository.
const EXCERPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../data/mooncake/conversation_trace_excerpt.jsonl"
);

fn records() -> Vec<TraceRecord> {
    if let Some(path) = std::env::var_os("TIERKV_MOONCAKE_TRACE") {
        let path = std::path::PathBuf::from(path);
        let r = trace::read_trace(&path).unwrap_or_else(|e| {
            panic!(
                "TIERKV_MOONCAKE_TRACE={}: {e} (unset it to replay the repository's excerpt)",
                path.display()
            )
        });
        eprintln!("replaying the {} requests of {}", r.len(), path.display());
        return r;
    }
    let path = TRACE_BESIDE;
    match trace::read_trace(std::path::Path::new(&path)) {
        Ok(r) => {
            eprintln!("replaying the {} requests of {path}", r.len());
            r
        }
        Err(e) => {
            eprintln!("{e}: replaying the repository's excerpt of the Mooncake trace, {EXCERPT}");
            trace::read_trace(std::path::Path::new(EXCERPT)).expect("the excerpt reads")
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

/// The device tier's policy, modelled on the trace's block ids: a tree of pages keyed by
/// (parent, block id, page in block); a request matches its device-resident prefix, then its
/// host-resident pages (every page ever inserted is on the unbounded host tier), stamps its whole
/// path as most recently used, evicts least-recently-used device leaves outside its path until its
/// new pages fit, and makes its whole path device-resident. Returns (device, host) hits per request.
fn lru_model_hits(recs: &[TraceRecord], device_pages: usize) -> Vec<(u64, u64)> {
    struct N {
        parent: usize,
        device: bool,
        device_children: u32,
        last: u64,
    }
    let per_block = (BLOCK_TOKENS / 64) as usize;
    // Node 0 is the root.
    let mut nodes = vec![N {
        parent: 0,
        device: false,
        device_children: 0,
        last: 0,
    }];
    let mut child: HashMap<(usize, u64, usize), usize> = HashMap::new();
    // Device leaves by (last use, node id): the eviction order.
    let mut leaves: BTreeSet<(u64, usize)> = BTreeSet::new();
    let mut used = 0usize;
    let mut out = Vec::new();
    for (tick, r) in (1u64..).zip(recs) {
        let pages = r.input_length as usize / 64;
        let ids: Vec<(u64, usize)> = (0..pages)
            .map(|p| (r.hash_ids[p / per_block], p % per_block))
            .collect();
        let mut path = Vec::new();
        let mut cur = 0;
        for &(b, i) in &ids {
            match child.get(&(cur, b, i)) {
                Some(&n) => {
                    path.push(n);
                    cur = n;
                }
                None => break,
            }
        }
        let dev = path.iter().take_while(|&&n| nodes[n].device).count();
        out.push((dev as u64, (path.len() - dev) as u64));
        for &n in &path {
            if nodes[n].device && nodes[n].device_children == 0 {
                leaves.remove(&(nodes[n].last, n));
                leaves.insert((tick, n));
            }
            nodes[n].last = tick;
        }
        // Make room, sparing this request's path (its nodes are the newest, so they come last).
        let need = pages - dev;
        let on_path: HashSet<usize> = path.iter().copied().collect();
        while used + need > device_pages {
            let &(last, n) = leaves
                .iter()
                .find(|(_, n)| !on_path.contains(n))
                .expect("the device tier cannot make room");
            leaves.remove(&(last, n));
            nodes[n].device = false;
            used -= 1;
            let p = nodes[n].parent;
            if p != 0 {
                nodes[p].device_children -= 1;
                if nodes[p].device && nodes[p].device_children == 0 {
                    leaves.insert((nodes[p].last, p));
                }
            }
        }
        // The host part is loaded and the rest inserted: the whole path is device-resident.
        let mut parent = 0;
        for (k, &(b, i)) in ids.iter().enumerate() {
            let n = if k < path.len() {
                path[k]
            } else {
                nodes.push(N {
                    parent,
                    device: false,
                    device_children: 0,
                    last: tick,
                });
                child.insert((parent, b, i), nodes.len() - 1);
                nodes.len() - 1
            };
            if !nodes[n].device {
                nodes[n].device = true;
                used += 1;
                if parent != 0 {
                    if nodes[parent].device_children == 0 {
                        leaves.remove(&(nodes[parent].last, parent));
                    }
                    nodes[parent].device_children += 1;
                }
                if nodes[n].device_children == 0 {
                    leaves.insert((tick, n));
                }
            }
            parent = n;
        }
    }
    out
}

/// The device tier of the replay: small enough that the conversation trace evicts.
const DEVICE_PAGES: u32 = 16_384;

#[test]
fn hit_rate_matches_a_simple_computation() {
    let recs = records();
    let synth = Synth::new(0);
    let mut replay = CacheReplay::new(DEVICE_PAGES, 1 << 22);
    let (mut dev_hits, mut host_hits, mut total) = (0u64, 0u64, 0u64);
    let mut per_request = Vec::new();
    for (i, r) in recs.iter().enumerate() {
        let keys = prompt_page_keys(r, &synth);
        let h = replay.request(&keys).expect("the trace fits the tiers");
        dev_hits += h.device;
        host_hits += h.host;
        per_request.push((h.device, h.host));
        total += keys.len() as u64;
        if i % 997 == 0 {
            replay.cache().check_invariants();
        }
    }
    assert_eq!(
        (replay.host_evicted, replay.backups_skipped),
        (0, 0),
        "the host tier must hold the whole trace for the models below (give a shorter trace)"
    );
    let cache = replay.cache();
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
    assert!(
        replay.evictions > 0 && replay.evicted >= replay.evictions,
        "a device tier the trace outgrows evicts: {} evictions of {} pages",
        replay.evictions,
        replay.evicted
    );
    // The split between the tiers, request by request, against the LRU model.
    let model = lru_model_hits(&recs, DEVICE_PAGES as usize);
    if let Some(i) = (0..recs.len()).find(|&i| per_request[i] != model[i]) {
        panic!(
            "request {i}: the cache hit (device, host) = {:?}, the LRU model {:?}",
            per_request[i], model[i]
        );
    }
    eprintln!(
        "per-tier hits equal the LRU model for all {} requests (device {dev_hits}, host {host_hits})",
        recs.len()
    );
}

#[test]
fn prompt_page_keys_are_the_prompts_full_pages() {
    let synth = Synth::new(7);
    for r in trace::generate(50, 3) {
        let tokens = trace::prompt_tokens(&r, &synth, usize::MAX);
        assert_eq!(
            prompt_page_keys(&r, &synth),
            page_keys(&tokens, tokens.len() / 64)
        );
    }
}

#[test]
fn a_replay_refuses_a_request_over_the_device_tier_and_evicts_a_small_host_tier() {
    let synth = Synth::new(0);
    let recs = trace::generate(20, 5);
    let mut replay = CacheReplay::new(4, 1 << 10);
    let big = recs
        .iter()
        .find(|r| r.input_length / 64 > 4)
        .expect("a long prompt");
    let e = replay.request(&prompt_page_keys(big, &synth)).unwrap_err();
    assert!(
        matches!(
            e,
            CacheReplayError::RequestTooLarge {
                device_pages: 4,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("device tier of 4 pages"), "{e}");
    replay.cache().check_invariants();
    assert_eq!(replay.cache().device_pages().len(), 0);
    // A request of exactly the tier's pages fits.
    let whole = &prompt_page_keys(big, &synth)[..4];
    replay.request(whole).expect("4 pages in a tier of 4");
    assert_eq!(replay.cache().device_pages().len(), 4);
    // A host tier of a few pages: the replay evicts host copies to back new pages up, and
    // skips a backup that eviction cannot make room for.
    let mut small_host = CacheReplay::new(1 << 10, 32);
    for r in &recs {
        let keys = prompt_page_keys(r, &synth);
        if keys.len() <= 1 << 10 {
            small_host
                .request(&keys)
                .expect("a request that fits the device tier");
        }
    }
    small_host.cache().check_invariants();
    assert_eq!(
        small_host.cache().host_pages().len(),
        32,
        "a full host tier"
    );
    assert!(
        small_host.host_evicted > 0 && small_host.backups_skipped > 0,
        "a 32-page host tier evicted {} pages and skipped {} backups",
        small_host.host_evicted,
        small_host.backups_skipped
    );
}

#[test]
fn malformed_traces_name_the_line() {
    let cases = [
        ("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{bad", "line 2"),
        ("{\"timestamp\": -5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}", "-5 is negative"),
        ("{\"timestamp\": 0.5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}", "expected a non-negative integer, found 0.5"),
        ("{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}", "missing field `timestamp`"),
        ("{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2, 3]}", "hash_ids"),
        ("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [-1]}", "hash_ids"),
        ("[1, 2]", "line 1"),
        (
            "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\n{\"timestamp\": 4, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}",
            "line 3: timestamp 4 ms is earlier than line 1's 5 ms",
        ),
    ];
    for (text, needle) in cases {
        let e = trace::parse_jsonl(text).unwrap_err().to_string();
        assert!(e.contains(needle), "{text:?}: {e}");
    }
}

/// `trace::generate`, the stand-in for a real trace: every record is one the parser accepts
/// (written as a JSON line and read back, equal), asks for at least one token, and its block ids
/// form one tree (an id has the same parent wherever it appears); most requests share a prefix
/// with an earlier one, as the conversation trace's do.
#[test]
fn a_generated_trace_is_a_valid_tree_of_shared_prefixes() {
    let recs = trace::generate(300, 9);
    let mut parent: HashMap<u64, Option<u64>> = HashMap::new();
    let mut first_blocks = HashSet::new();
    let mut sharing = 0;
    for (i, r) in recs.iter().enumerate() {
        let line = format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": {:?}}}",
            r.timestamp_ms, r.input_length, r.output_length, r.hash_ids
        );
        let back = trace::parse_line(&line, r.line).unwrap_or_else(|e| panic!("record {i}: {e}"));
        assert_eq!(&back, r, "record {i}");
        assert!(r.output_length >= 1, "record {i} generates nothing");
        for (j, &id) in r.hash_ids.iter().enumerate() {
            let p = j.checked_sub(1).map(|k| r.hash_ids[k]);
            let was = *parent.entry(id).or_insert(p);
            assert_eq!(
                was, p,
                "record {i}: block {id} under {p:?}, before under {was:?}"
            );
        }
        sharing += !first_blocks.insert(r.hash_ids[0]) as usize;
    }
    // Two in three, drawn: more than half, fewer than four in five.
    assert!(
        sharing * 2 > recs.len() && sharing * 5 < recs.len() * 4,
        "{sharing} of {} share a prefix",
        recs.len()
    );
}

/// A replay evicts exactly what a request lacks: on a device tier of 8 pages holding a 6-page
/// prompt, a new 4-page prompt evicts 2 pages; on a host tier of 4 pages holding one prompt's
/// copies, a new 4-page prompt's backup evicts all 4 (exactly enough) rather than skipping.
#[test]
fn a_replay_evicts_exactly_what_a_request_lacks() {
    let synth = Synth::new(2);
    let keys = |stream: u64, pages: usize| {
        let tokens: Vec<u32> = (0..pages as u64 * 64)
            .map(|i| synth.token(stream, i))
            .collect();
        page_keys(&tokens, pages)
    };
    let mut device = CacheReplay::new(8, 1 << 10);
    device.request(&keys(1, 6)).expect("6 pages of 8");
    device.request(&keys(2, 4)).expect("4 more: 2 evicted");
    assert_eq!(device.evicted, 2);
    let mut host = CacheReplay::new(1 << 10, 4);
    host.request(&keys(3, 4)).expect("backed up whole");
    assert_eq!(host.cache().host_pages().len(), 4);
    host.request(&keys(4, 4)).expect("another prompt");
    assert_eq!((host.host_evicted, host.backups_skipped), (4, 0));
}

/// The fuzz body holds every record under 2^16 input tokens to the format's rules (the ones it
/// builds prompts for) and checks nothing of input that does not parse.
#[test]
fn the_fuzz_body_checks_each_record_it_parses() {
    let line = |ts: u64, input: u32, ids: usize| {
        format!(
            "{{\"timestamp\": {ts}, \"input_length\": {input}, \"output_length\": 1, \"hash_ids\": [{}]}}",
            (1..=ids).map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
        )
    };
    let text = [line(0, 10, 1), line(5, 1025, 3), line(9, 70_000, 137)].join("\n");
    assert_eq!(
        trace::fuzz_trace(text.as_bytes()),
        2,
        "the two under 2^16 tokens"
    );
    assert_eq!(trace::fuzz_trace(b"{bad"), 0);
    assert_eq!(trace::fuzz_trace(&[0xff, 0xfe]), 0, "not UTF-8");
}
