//! `tierkv sim --profile vllm --calls FILE`: a recorded call sequence of vLLM's offloading
//! interface (`record_calls` of `tierkv.vllm`, JSON lines) replayed through the same host tier
//! as the drawn server of the parent module, under each seed's schedule and driver faults.
//!
//! The recording fixes what vLLM asked (lookups, offers, loads, the device blocks and keys of
//! every job, when it polled and waited); each seed decides how the GPU interleaves it and
//! which driver calls fail. Keys are the recording's (hex), numbered in order of first
//! appearance; a KV group's key lives in that group's cache only (vLLM keys each group's
//! block apart). The server's forward pass is modelled as in the drawn profile: it writes a
//! block's keys' bytes on the compute stream just before the block is offered for storing (the
//! store right after the compute of vllm#45704), and reads every block it holds at each poll;
//! a block it loads into is one it stopped reading only then (vllm#47282's pattern).
//!
//! The replay keeps its own index: where a fault failed a store, a later load of those keys
//! is refused by the index and skipped, and a recorded answer the replay's index does not
//! give is counted as a divergence, not a finding.
//!
//! Oracles: the race detector, the contents of every stored chunk and loaded block, the
//! index's invariants, every job reported exactly once.

use std::collections::BTreeMap;

use serde_json::Value;
use tierkv_engine::device::StreamKind;
use tierkv_engine::layout::Bytes;
use tierkv_engine::offload::plan::Job;
use tierkv_engine::offload::transfer::TransferMutant;
use tierkv_engine::runtime::driver::{Driver, Ptr};

use super::{key_bytes, page_of, retry, Outcome, Server, Shape, PAGES};

/// The largest call file read.
pub const CALLS_BYTES_MAX: u64 = 64 << 20;

/// A recorded call, keys numbered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Lookup(u64),
    PrepareStore {
        keys: Vec<u64>,
        stored: Option<Vec<u64>>,
    },
    CompleteStore(Vec<u64>),
    PrepareLoad(Vec<u64>),
    CompleteLoad(Vec<u64>),
    /// A job: per KV group (cache), its keys and device blocks.
    Submit {
        store: bool,
        groups: [Vec<(u64, u64)>; 2],
    },
    GetFinished,
    Wait,
}

/// A recording: the registration and the calls.
#[derive(Clone, Debug)]
pub struct Calls {
    pub blocks: u64,
    pub chunks: u64,
    pub selective: bool,
    pub calls: Vec<Call>,
    /// Distinct keys.
    pub keys: u64,
}

/// Why a call file was refused: the line (1-based; 0 for the file itself) and what was wrong.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {}{detail}", if *line == 0 { String::new() } else { format!("line {line}: ") })]
pub struct CallsError {
    pub path: String,
    pub line: usize,
    pub detail: String,
}

struct Parser {
    ids: BTreeMap<String, u64>,
}

impl Parser {
    fn key(&mut self, v: &Value) -> Result<u64, String> {
        let s = v
            .as_str()
            .filter(|s| !s.is_empty() && s.len() <= 2048)
            .ok_or_else(|| format!("a key is {v}, not a hex string"))?;
        let next = self.ids.len() as u64;
        Ok(*self.ids.entry(s.to_string()).or_insert(next))
    }

    fn keys(&mut self, v: &Value, field: &str) -> Result<Vec<u64>, String> {
        let list = v
            .get(field)
            .and_then(Value::as_array)
            .ok_or_else(|| format!("no `{field}` list"))?;
        list.iter().map(|k| self.key(k)).collect()
    }

    fn groups(&mut self, v: &Value, blocks: u64) -> Result<[Vec<(u64, u64)>; 2], String> {
        let list = v
            .get("groups")
            .and_then(Value::as_array)
            .ok_or("no `groups` list")?;
        if list.len() != 2 {
            return Err(format!(
                "a job of {} KV groups; the replay's server has 2",
                list.len()
            ));
        }
        let mut out: [Vec<(u64, u64)>; 2] = [Vec::new(), Vec::new()];
        for (g, group) in list.iter().enumerate() {
            let keys = self.keys(group, "keys")?;
            let bl = group
                .get("blocks")
                .and_then(Value::as_array)
                .ok_or("a group without `blocks`")?;
            if bl.len() != keys.len() {
                return Err(format!(
                    "group {g} has {} blocks and {} keys",
                    bl.len(),
                    keys.len()
                ));
            }
            for (k, b) in keys.into_iter().zip(bl) {
                let b = b.as_u64().filter(|&b| b < blocks).ok_or_else(|| {
                    format!("group {g}: block {b} is not one of the {blocks} registered")
                })?;
                out[g].push((k, b));
            }
        }
        Ok(out)
    }

    fn call(&mut self, v: &Value, blocks: u64) -> Result<Call, String> {
        let name = v
            .get("call")
            .and_then(Value::as_str)
            .ok_or("no `call` name")?;
        Ok(match name {
            "lookup" => Call::Lookup(self.key(v.get("key").unwrap_or(&Value::Null))?),
            "prepare_store" => {
                let keys = self.keys(v, "keys")?;
                let stored = match v.get("stored") {
                    Some(Value::Null) | None => None,
                    Some(_) => Some(self.keys(v, "stored")?),
                };
                Call::PrepareStore { keys, stored }
            }
            "complete_store" => Call::CompleteStore(self.keys(v, "keys")?),
            "prepare_load" => Call::PrepareLoad(self.keys(v, "keys")?),
            "complete_load" => Call::CompleteLoad(self.keys(v, "keys")?),
            "submit_store" | "submit_load" => Call::Submit {
                store: name == "submit_store",
                groups: self.groups(v, blocks)?,
            },
            "get_finished" => Call::GetFinished,
            "wait" => Call::Wait,
            other => return Err(format!("unknown call `{other}`")),
        })
    }
}

/// The registration line: one block a chunk, the drawn server's two formats.
fn register(v: &Value) -> Result<(u64, u64, bool), String> {
    if v.get("call").and_then(Value::as_str) != Some("register") {
        return Err("the first line must be the registration (`\"call\":\"register\"`)".into());
    }
    let num = |f: &str, max: u64| {
        v.get(f)
            .and_then(Value::as_u64)
            .filter(|&n| (1..=max).contains(&n))
            .ok_or_else(|| format!("`{f}` must be an integer in 1..={max}"))
    };
    let (blocks, chunks) = (num("blocks", 1 << 16)?, num("chunks", 1 << 16)?);
    if num("blocks_per_chunk", 1)? != 1 {
        return Err("`blocks_per_chunk` must be 1 (the replay's server)".into());
    }
    let formats: Vec<&str> = v
        .get("formats")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if formats != ["kv/fp8_packed", "index_k/fp8"] {
        return Err(format!(
            "`formats` {formats:?}: the replay's server has [\"kv/fp8_packed\", \"index_k/fp8\"]"
        ));
    }
    let selective = match v.get("write_policy").and_then(Value::as_str) {
        Some("write_through") | None => false,
        Some("write_through_selective") => true,
        Some(other) => return Err(format!("write policy `{other}`")),
    };
    Ok((blocks, chunks, selective))
}

/// Parses a call file (`record_calls`' JSON lines).
pub fn parse(path: &std::path::Path) -> Result<Calls, CallsError> {
    let fail = |line: usize, detail: String| CallsError {
        path: path.display().to_string(),
        line,
        detail,
    };
    let text = tierkv_engine::input::read_text(path, CALLS_BYTES_MAX)
        .map_err(|e| fail(0, e.to_string()))?;
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let json = |i: usize, l: &str| {
        serde_json::from_str::<Value>(l).map_err(|e| fail(i + 1, e.to_string()))
    };
    let (i, first) = lines
        .next()
        .ok_or_else(|| fail(1, "an empty file".into()))?;
    let (blocks, chunks, selective) = register(&json(i, first)?).map_err(|d| fail(i + 1, d))?;
    let mut p = Parser {
        ids: BTreeMap::new(),
    };
    let mut calls = Vec::new();
    for (i, l) in lines {
        calls.push(p.call(&json(i, l)?, blocks).map_err(|d| fail(i + 1, d))?);
    }
    Ok(Calls {
        blocks,
        chunks,
        selective,
        calls,
        keys: p.ids.len() as u64,
    })
}

/// A replayed job in flight: its store flag and, per cache, its keys and blocks.
struct Flight {
    store: bool,
    groups: [Vec<(u64, u64)>; 2],
}

/// What one seed's replay does beside the drawn server's state.
struct Replay {
    server: Server,
    flights: BTreeMap<u64, Flight>,
    /// Keys the replay's index answered a prepare with, and the chunk it gave them.
    prepared: BTreeMap<u64, u32>,
    divergences: u64,
}

/// Replays `calls` under seed `seed` (`mutant`: a planted mistake, or none).
pub fn run(seed: u64, calls: &Calls, mutant: Option<TransferMutant>) -> Outcome {
    let drawn = Shape::draw(seed);
    let shape = Shape {
        device_blocks: calls.blocks,
        chunks: calls.chunks,
        keys: calls.keys,
        steps: 0,
        selective: calls.selective,
        driver_fault_rate: drawn.driver_fault_rate,
    };
    let server = match Server::new(seed, &shape, mutant) {
        Ok(s) => s,
        Err(e) => {
            return Outcome {
                findings: vec![format!("setup: {e}")],
                ..Outcome::default()
            }
        }
    };
    let mut r = Replay {
        server,
        flights: BTreeMap::new(),
        prepared: BTreeMap::new(),
        divergences: 0,
    };
    for call in &calls.calls {
        r.call(call);
    }
    r.wait_all();
    r.collect();
    r.finish()
}

impl Replay {
    fn call(&mut self, call: &Call) {
        let names = |keys: &[u64]| -> Vec<[u8; 8]> { keys.iter().map(|&k| key_bytes(k)).collect() };
        match call {
            Call::Lookup(k) => {
                self.server.index.lookup(&key_bytes(*k));
            }
            Call::PrepareStore { keys, stored } => self.prepare_store(keys, stored.as_deref()),
            Call::PrepareLoad(keys) => {
                let n = names(keys);
                let refs: Vec<&[u8]> = n.iter().map(|k| k.as_slice()).collect();
                match self.server.index.prepare_load(&refs) {
                    Ok(chunks) => {
                        self.server.out.hits += keys.len() as u64;
                        self.prepared.extend(keys.iter().copied().zip(chunks));
                    }
                    Err(_) => self.divergences += 1,
                }
            }
            Call::CompleteStore(keys) => self.release(keys, true),
            Call::CompleteLoad(keys) => self.release(keys, false),
            Call::Submit { store, groups } => self.submit(*store, groups),
            Call::GetFinished => {
                self.server.read_held();
                self.collect();
            }
            Call::Wait => self.wait_all(),
        }
        self.server.index.check_invariants();
    }

    fn prepare_store(&mut self, keys: &[u64], stored: Option<&[u64]>) {
        let n: Vec<[u8; 8]> = keys.iter().map(|&k| key_bytes(k)).collect();
        let refs: Vec<&[u8]> = n.iter().map(|k| k.as_slice()).collect();
        match self.server.index.prepare_store(&refs) {
            Ok(Some(out)) => {
                let got: Vec<u64> = out
                    .keys
                    .iter()
                    .map(|k| u64::from_be_bytes(k[..8].try_into().expect("8 bytes")))
                    .collect();
                self.server.out.evictions += out.evicted.len() as u64;
                if stored != Some(got.as_slice()) {
                    self.divergences += 1;
                }
                self.prepared.extend(got.into_iter().zip(out.chunks));
            }
            Ok(None) => self.divergences += u64::from(stored.is_some()),
            Err(e) => self
                .server
                .out
                .findings
                .push(format!("prepare_store refused a recorded offer: {e}")),
        }
    }

    /// A recorded completion of keys the replay prepared but gave no job (its answers
    /// diverged): completed as failed, so that the index does not keep them pending.
    fn release(&mut self, keys: &[u64], store: bool) {
        let in_flight = |k: &u64| {
            self.flights
                .values()
                .any(|f| f.groups.iter().flatten().any(|e| e.0 == *k))
        };
        let orphans: Vec<u64> = keys
            .iter()
            .copied()
            .filter(|k| self.prepared.contains_key(k) && !in_flight(k))
            .collect();
        if orphans.is_empty() {
            return;
        }
        for k in &orphans {
            self.prepared.remove(k);
        }
        let n: Vec<[u8; 8]> = orphans.iter().map(|&k| key_bytes(k)).collect();
        let refs: Vec<&[u8]> = n.iter().map(|k| k.as_slice()).collect();
        let done = if store {
            self.server.index.complete_store(&refs, false)
        } else {
            self.server.index.complete_load(&refs)
        };
        if let Err(e) = done {
            self.server
                .out
                .findings
                .push(format!("releasing keys the replay never moved: {e}"));
        }
    }
}

impl Replay {
    /// The server's forward pass wrote key `key`'s bytes into block `block` of cache `c`.
    fn compute(&mut self, c: usize, key: u64, block: u64) {
        let (dst, bytes) = (self.server.page(c, block), page_of(key, c));
        let Server { tier, out, .. } = &mut self.server;
        retry(out, || {
            tier.driver()
                .copy_pageable(StreamKind::Compute, dst, &bytes)
        });
        self.server.held.insert(block, key);
    }

    /// A job of the keys the replay's index prepared (a recorded key it did not is skipped and
    /// counted as a divergence). A store's blocks are written by the server first; a load's
    /// blocks are ones the server stops reading now.
    fn submit(&mut self, store: bool, groups: &[Vec<(u64, u64)>; 2]) {
        let mut take: [Vec<(u64, u64, u32)>; 2] = [Vec::new(), Vec::new()];
        for (c, g) in groups.iter().enumerate() {
            for &(k, b) in g {
                if store {
                    self.compute(c, k, b);
                }
                match self.prepared.remove(&k) {
                    Some(chunk) => take[c].push((k, b, chunk)),
                    None => self.divergences += 1,
                }
            }
        }
        if !store {
            for &(_, b, _) in take.iter().flatten() {
                self.server.held.remove(&b);
            }
        }
        if take.iter().all(Vec::is_empty) {
            return;
        }
        let (mut ptrs, mut sizes, mut chunks) = (Vec::new(), Vec::new(), Vec::new());
        for (c, g) in take.iter().enumerate() {
            for &(_, b, chunk) in g {
                ptrs.push(self.server.caches[c].1 + b * PAGES[c]);
                sizes.push(PAGES[c]);
                chunks.push(u64::from(chunk));
            }
        }
        let counts = [take[0].len() as u64, take[1].len() as u64];
        let job = Job {
            ptrs: &ptrs,
            sizes: &sizes,
            group_blocks: &counts,
            group_refs: &[1, 1],
            block_indices: &[0, 0],
            chunks: &chunks,
        };
        let plan = match self.server.tier.registration().plan(&job) {
            Ok(p) => p,
            Err(e) => {
                self.server
                    .out
                    .findings
                    .push(format!("a recorded job was refused by the plan: {e}"));
                return;
            }
        };
        let id = self.server.next_job;
        self.server.next_job += 1;
        // A refused call fails the job: `finished` reports it.
        let _ = self.server.tier.submit(store, id, &plan, 0);
        let groups = take.map(|g| g.into_iter().map(|(k, b, _)| (k, b)).collect());
        self.flights.insert(id, Flight { store, groups });
    }

    fn wait_all(&mut self) {
        let ids: Vec<u64> = self.flights.keys().copied().collect();
        self.server.tier.wait(&ids);
    }

    /// Block `block` of cache `c` as the compute stream sees it after the jobs so far.
    fn device_page(&mut self, c: usize, block: u64) -> Vec<u8> {
        let (src, dst) = (
            self.server.page(c, block),
            Ptr::whole(self.server.probe[c], Bytes(PAGES[c])),
        );
        let Server { tier, out, .. } = &mut self.server;
        retry(out, || {
            tier.driver().copy_async(StreamKind::Compute, dst, src)
        });
        retry(out, || {
            tier.driver().stream_synchronize(StreamKind::Compute)
        });
        let mut bytes = vec![0u8; PAGES[c] as usize];
        retry(out, || {
            tier.driver().read_pinned(dst.mem, Bytes(0), &mut bytes)
        });
        bytes
    }

    /// Ends the jobs the host tier reports done, checking what they moved.
    fn collect(&mut self) {
        for (id, ok, _, _) in self.server.tier.finished() {
            let Some(f) = self.flights.remove(&id) else {
                self.server
                    .out
                    .findings
                    .push(format!("job {id} reported done twice, or never submitted"));
                continue;
            };
            self.server.out.failed_jobs += u64::from(!ok);
            let names: Vec<[u8; 8]> = f.groups.iter().flatten().map(|e| key_bytes(e.0)).collect();
            let refs: Vec<&[u8]> = names.iter().map(|k| k.as_slice()).collect();
            for (c, g) in f.groups.iter().enumerate() {
                for &(k, b) in g {
                    self.check(f.store, ok, c, k, b);
                }
            }
            let done = if f.store {
                self.server.out.stores += 1;
                self.server.index.complete_store(&refs, ok)
            } else {
                self.server.out.loads += 1;
                self.server.index.complete_load(&refs)
            };
            if let Err(e) = done {
                self.server
                    .out
                    .findings
                    .push(format!("completing job {id} was refused: {e}"));
            }
        }
    }

    /// A stored chunk holds its key's bytes; a loaded block holds its key's bytes (and the
    /// server holds it now), or, after a failed load, is recomputed as vLLM does.
    fn check(&mut self, store: bool, ok: bool, c: usize, k: u64, b: u64) {
        let want = page_of(k, c);
        if store {
            let chunk = self.server.index.chunk_of(&key_bytes(k));
            if let (true, Some(chunk)) = (ok, chunk) {
                match self.server.tier.read_host(c, u64::from(chunk)) {
                    Ok(bytes) if bytes == want => {}
                    Ok(_) => self.server.out.findings.push(format!("content: host chunk {chunk} of cache {c} does not hold key {k}'s bytes after its store")),
                    Err(e) => self.server.out.findings.push(format!("a host chunk could not be read: {e}")),
                }
            }
        } else if ok {
            if self.device_page(c, b) != want {
                self.server.out.findings.push(format!("content: device block {b} of cache {c} does not hold key {k}'s bytes after its load"));
            }
            self.server.held.insert(b, k);
        } else {
            self.compute(c, k, b);
        }
    }

    fn finish(mut self) -> Outcome {
        if !self.flights.is_empty() {
            let n = self.flights.len();
            self.server.out.findings.push(format!(
                "{n} jobs never reported done after waiting for them"
            ));
        }
        let races = self.server.gpu.borrow().races.clone();
        if let Some(race) = races.first() {
            self.server.out.findings.push(format!(
                "race: {} race(s), first {:?}",
                races.len(),
                race
            ));
        }
        self.server.out.divergences = self.divergences;
        self.server.out
    }
}
