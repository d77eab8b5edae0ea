//! `tierkv sim --profile vllm --calls FILE`: a recorded call sequence of vLLM's offloading
//! interface (`record_calls` of `tierkv.vllm`, JSON lines) replayed through the same host tier
//! as the drawn server of the parent module, under each seed's schedule and driver faults.
//!
//! The recording fixes what vLLM asked (lookups, offers, loads, the device blocks and host
//! chunks of every job, when it polled and which jobs each poll reported done, what it waited
//! for); each seed decides how the GPU interleaves it and which driver calls fail. Keys are the
//! recording's (hex), numbered in order of first appearance; a job's chunks name its keys
//! through the manager's lines; a KV group's key lives in that group's cache only (vLLM keys
//! each group's block apart). The server's forward pass is modelled as in the drawn profile:
//! it writes a block's keys' bytes on the compute stream just before the block is offered for
//! storing (the store right after the compute of vllm#45704), and reads every block it holds at
//! each poll; a block it loads into is one it stops reading only then (vllm#47282's pattern).
//!
//! The replay keeps its own index and completes each job at the poll where the recording
//! reported it (waiting for it there), so that its index moves in step with the recorded one.
//! Where a fault failed a job, the indexes part (a failed store frees its chunk, a later load
//! of the key is refused and skipped); a recorded answer the replay's index does not give is
//! counted then, and is a finding before any job failed.
//!
//! Oracles: the race detector, the contents of every stored chunk (the one the job was planned
//! with) and loaded block, the index's invariants, every job reported exactly once, and the
//! recorded answers until a job fails. A recording that contradicts itself (a block two jobs
//! move at once, a completion nothing prepared) is refused when parsed, not blamed on the tier.

use std::collections::BTreeMap;

use serde_json::Value;
use tierkv_engine::device::StreamKind;
use tierkv_engine::layout::Bytes;
use tierkv_engine::offload::plan::Job;
use tierkv_engine::offload::transfer::TransferMutant;
use tierkv_engine::offload::{Lookup, KEY_BYTES_MAX};
use tierkv_engine::runtime::driver::{Driver, Ptr};

use super::{key_bytes, page_of, retry, Outcome, Server, Shape, PAGES};

/// The largest call file read.
pub const CALLS_BYTES_MAX: u64 = 64 << 20;
/// The most calls a file may hold.
pub const CALLS_MAX: usize = 100_000;
/// The most device blocks and host chunks a recording may register (each block is a page of
/// both simulated caches, 50 KB, held in memory per seed).
pub const REPLAY_BLOCKS_MAX: u64 = 1024;
pub const REPLAY_CHUNKS_MAX: u64 = 1024;
/// The most (key, block) entries all jobs of a file may name together: each becomes a page
/// copy and its race-detector history in every seed (about 56 KB).
pub const REPLAY_JOB_ENTRIES_MAX: usize = 10_000;

/// A recorded call, keys numbered; the recorded answers the replay compares with its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Lookup {
        key: u64,
        found: Option<Lookup>,
    },
    PrepareStore {
        keys: Vec<u64>,
        stored: Option<Vec<u64>>,
    },
    CompleteStore(Vec<u64>),
    PrepareLoad(Vec<u64>),
    CompleteLoad(Vec<u64>),
    /// A job (the recording's id): per KV group (cache), its keys and device blocks.
    Submit {
        store: bool,
        job: u64,
        groups: [Vec<(u64, u64)>; 2],
    },
    /// A poll, and the recorded jobs it reported done.
    GetFinished(Vec<u64>),
    /// The recording's ids of the jobs waited for.
    Wait(Vec<u64>),
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
    /// Jobs submitted.
    pub jobs: u64,
}

/// Why a call file was refused: the line (1-based; 0 for the file itself) and what was wrong.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {}{detail}", if *line == 0 { String::new() } else { format!("line {line}: ") })]
pub struct CallsError {
    pub path: String,
    pub line: usize,
    pub detail: String,
}

/// The parser's state: keys numbered, which key each host chunk holds (the manager's answers
/// say it; a worker in another process records only chunks), which recorded jobs are in
/// flight and the device blocks they move.
#[derive(Default)]
struct Parser {
    ids: BTreeMap<String, u64>,
    chunk_key: BTreeMap<u64, u64>,
    in_flight: BTreeMap<u64, Vec<(usize, u64)>>,
    register: Option<(u64, u64, bool)>,
    /// Keys a prepare left pending (stores, loads), by how many prepares.
    pending: [BTreeMap<u64, u32>; 2],
    entries: usize,
}

fn list<'a>(v: &'a Value, field: &str) -> Result<&'a Vec<Value>, String> {
    v.get(field)
        .and_then(Value::as_array)
        .ok_or_else(|| format!("no `{field}` list"))
}

fn number(v: &Value, what: &str) -> Result<u64, String> {
    v.as_u64()
        .ok_or_else(|| format!("{what} {v} is not a non-negative integer"))
}

impl Parser {
    /// Keys a prepare (`load`: a load's, else a store's) leaves pending.
    fn prepared(&mut self, load: bool, keys: &[u64]) {
        for &k in keys {
            *self.pending[usize::from(load)].entry(k).or_default() += 1;
        }
    }

    /// Keys a completion ends: each must be pending from a prepare of the same kind.
    fn completed(&mut self, load: bool, keys: &[u64]) -> Result<(), String> {
        let what = if load {
            "complete_load"
        } else {
            "complete_store"
        };
        for &k in keys {
            let pending = &mut self.pending[usize::from(load)];
            match pending.get_mut(&k) {
                Some(n) if *n > 1 => *n -= 1,
                Some(_) => {
                    pending.remove(&k);
                }
                None => return Err(format!("{what} of key {k}, which no earlier prepare left pending (the recording is inconsistent)")),
            }
        }
        Ok(())
    }

    fn key(&mut self, v: &Value) -> Result<u64, String> {
        let s = v
            .as_str()
            .filter(|s| !s.is_empty() && s.len() <= 2 * KEY_BYTES_MAX && s.len() % 2 == 0)
            .filter(|s| s.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| format!("a key is {v}, not the hex of 1..={KEY_BYTES_MAX} bytes"))?;
        let next = self.ids.len() as u64;
        Ok(*self.ids.entry(s.to_ascii_lowercase()).or_insert(next))
    }

    fn keys(&mut self, v: &Value, field: &str) -> Result<Vec<u64>, String> {
        list(v, field)?.iter().map(|k| self.key(k)).collect()
    }

    /// Keys and the chunks the manager gave them (`chunks`, when recorded).
    fn placed(&mut self, v: &Value, field: &str) -> Result<Vec<u64>, String> {
        let keys = self.keys(v, field)?;
        if let Some(chunks) = v.get("chunks").and_then(Value::as_array) {
            if chunks.len() != keys.len() {
                return Err(format!("{} chunks for {} keys", chunks.len(), keys.len()));
            }
            let registered = self.register.map(|r| r.1);
            for (k, c) in keys.iter().zip(chunks) {
                let c = number(c, "a chunk")?;
                if let Some(n) = registered.filter(|&n| c >= n) {
                    return Err(format!("host chunk {c} is not one of the {n} registered"));
                }
                self.chunk_key.insert(c, *k);
            }
        }
        Ok(keys)
    }
}
impl Parser {
    /// A job's groups: blocks and chunks (keys where the worker knew them), every chunk one a
    /// manager line gave a key, no key twice, no block twice in a group, and no block that a
    /// job the recording has not reported done still moves (vLLM fences those).
    fn job(&mut self, v: &Value, job: u64) -> Result<[Vec<(u64, u64)>; 2], String> {
        let (blocks, chunks_max, _) = self.register.ok_or("a job before the registration line")?;
        let groups = list(v, "groups")?;
        if groups.len() != 2 {
            return Err(format!(
                "a job of {} KV groups; the replay's server has 2",
                groups.len()
            ));
        }
        let mut out: [Vec<(u64, u64)>; 2] = [Vec::new(), Vec::new()];
        let mut seen_keys = Vec::new();
        for (g, group) in groups.iter().enumerate() {
            let bl = list(group, "blocks")?;
            let chunks = list(group, "chunks")?;
            if bl.len() != chunks.len() {
                return Err(format!(
                    "group {g} has {} blocks and {} chunks",
                    bl.len(),
                    chunks.len()
                ));
            }
            for (b, c) in bl.iter().zip(chunks) {
                let b = number(b, "a block").and_then(|b| {
                    (b < blocks).then_some(b).ok_or(format!(
                        "group {g}: block {b} is not one of the {blocks} registered"
                    ))
                })?;
                let c = number(c, "a chunk").and_then(|c| {
                    (c < chunks_max).then_some(c).ok_or(format!(
                        "group {g}: host chunk {c} is not one of the {chunks_max} registered"
                    ))
                })?;
                let key = *self.chunk_key.get(&c).ok_or_else(|| {
                    format!("group {g}: host chunk {c} was given to no key by an earlier prepare_store or prepare_load line")
                })?;
                if seen_keys.contains(&key) || out[g].iter().any(|e| e.1 == b) {
                    return Err(format!("group {g}: a key or block named twice in one job"));
                }
                if let Some((j, _)) = self.in_flight.iter().find(|(_, bs)| bs.contains(&(g, b))) {
                    return Err(format!("job {job} names block {b} of group {g}, which job {j} still moves (the recording is inconsistent: vLLM fences such blocks)"));
                }
                self.entries += 1;
                if self.entries > REPLAY_JOB_ENTRIES_MAX {
                    return Err(format!(
                        "the jobs name more than {REPLAY_JOB_ENTRIES_MAX} blocks together"
                    ));
                }
                seen_keys.push(key);
                out[g].push((key, b));
            }
        }
        if self.in_flight.contains_key(&job) {
            return Err(format!("job {job} submitted twice"));
        }
        let moved = out
            .iter()
            .enumerate()
            .flat_map(|(g, e)| e.iter().map(move |&(_, b)| (g, b)))
            .collect();
        self.in_flight.insert(job, moved);
        Ok(out)
    }

    /// A call of the manager that prepares or completes keys.
    fn manager(&mut self, name: &str, v: &Value) -> Result<Call, String> {
        Ok(match name {
            "prepare_store" => {
                let keys = self.keys(v, "keys")?;
                let stored = match v.get("stored") {
                    Some(Value::Null) | None => None,
                    Some(_) => Some(self.placed(v, "stored")?),
                };
                self.prepared(false, stored.as_deref().unwrap_or_default());
                Call::PrepareStore { keys, stored }
            }
            "complete_store" => {
                let keys = self.keys(v, "keys")?;
                self.completed(false, &keys)?;
                Call::CompleteStore(keys)
            }
            "prepare_load" => {
                let keys = self.placed(v, "keys")?;
                self.prepared(true, &keys);
                Call::PrepareLoad(keys)
            }
            "complete_load" => {
                let keys = self.keys(v, "keys")?;
                self.completed(true, &keys)?;
                Call::CompleteLoad(keys)
            }
            _ => unreachable!("only the manager's four calls come here"),
        })
    }

    fn call(&mut self, v: &Value) -> Result<Option<Call>, String> {
        let name = v
            .get("call")
            .and_then(Value::as_str)
            .ok_or("no `call` name")?;
        Ok(Some(match name {
            "register" => {
                if self.register.is_some() {
                    return Err("a second registration (one worker's recording only: tensor parallel size 1)".into());
                }
                self.register = Some(register(v)?);
                return Ok(None);
            }
            "lookup" => {
                let key = self.key(v.get("key").unwrap_or(&Value::Null))?;
                let found = match v.get("found").map(|f| f.as_str()) {
                    None => None,
                    Some(Some("miss")) => Some(Lookup::Miss),
                    Some(Some("hit")) => Some(Lookup::Hit),
                    Some(Some("pending")) => Some(Lookup::Pending),
                    Some(_) => return Err("`found` is not \"miss\", \"hit\" or \"pending\"".into()),
                };
                Call::Lookup { key, found }
            }
            "prepare_store" | "complete_store" | "prepare_load" | "complete_load" => {
                self.manager(name, v)?
            }
            "submit_store" | "submit_load" => {
                let job = number(v.get("job").unwrap_or(&Value::Null), "the job id")?;
                Call::Submit {
                    store: name == "submit_store",
                    job,
                    groups: self.job(v, job)?,
                }
            }
            "get_finished" => {
                let mut done = Vec::new();
                for d in list(v, "done")? {
                    let j = d
                        .get(0)
                        .map_or(Err("a `done` entry without a job id".to_string()), |j| {
                            number(j, "a job id")
                        })?;
                    if self.in_flight.remove(&j).is_none() {
                        return Err(format!("job {j} reported done, but not in flight"));
                    }
                    done.push(j);
                }
                Call::GetFinished(done)
            }
            "wait" => Call::Wait(
                list(v, "jobs")?
                    .iter()
                    .map(|j| number(j, "a job id"))
                    .collect::<Result<_, _>>()?,
            ),
            other => return Err(format!("unknown call `{other}`")),
        }))
    }
}

/// The registration line: one block a chunk, the replay server's two formats, bounded sizes.
fn register(v: &Value) -> Result<(u64, u64, bool), String> {
    let num = |f: &str, max: u64| {
        v.get(f)
            .and_then(Value::as_u64)
            .filter(|&n| (1..=max).contains(&n))
            .ok_or_else(|| format!("`{f}` must be an integer in 1..={max}"))
    };
    let (blocks, chunks) = (
        num("blocks", REPLAY_BLOCKS_MAX)?,
        num("chunks", REPLAY_CHUNKS_MAX)?,
    );
    if num("blocks_per_chunk", 1)? != 1 {
        return Err("`blocks_per_chunk` must be 1 (the replay's server)".into());
    }
    let formats = list(v, "formats")?;
    let names: Vec<Option<&str>> = formats.iter().map(Value::as_str).collect();
    if names != [Some("kv/fp8_packed"), Some("index_k/fp8")] {
        return Err(format!(
            "`formats` {}: the replay's server has [\"kv/fp8_packed\", \"index_k/fp8\"]",
            Value::Array(formats.clone())
        ));
    }
    let selective = match v.get("write_policy").map(Value::as_str) {
        None | Some(Some("write_through")) => false,
        Some(Some("write_through_selective")) => true,
        Some(_) => {
            return Err(format!(
                "`write_policy` {} is not \"write_through\" or \"write_through_selective\"",
                v["write_policy"]
            ))
        }
    };
    Ok((blocks, chunks, selective))
}

/// Parses a call file (`record_calls`' JSON lines; the manager's and the worker's lines may
/// come from two processes appending to one file).
pub fn parse(path: &std::path::Path) -> Result<Calls, CallsError> {
    let fail = |line: usize, detail: String| CallsError {
        path: path.display().to_string(),
        line,
        detail,
    };
    let text = tierkv_engine::input::read_text(path, CALLS_BYTES_MAX)
        .map_err(|e| fail(0, e.to_string()))?;
    let mut p = Parser::default();
    let mut calls = Vec::new();
    for (i, l) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        if calls.len() >= CALLS_MAX {
            return Err(fail(i + 1, format!("more than {CALLS_MAX} calls")));
        }
        let v = serde_json::from_str::<Value>(l).map_err(|e| fail(i + 1, e.to_string()))?;
        calls.extend(p.call(&v).map_err(|d| fail(i + 1, d))?);
    }
    let Some((blocks, chunks, selective)) = p.register else {
        return Err(fail(
            0,
            "no registration line (`\"call\":\"register\"`)".into(),
        ));
    };
    let jobs = calls
        .iter()
        .filter(|c| matches!(c, Call::Submit { .. }))
        .count() as u64;
    Ok(Calls {
        blocks,
        chunks,
        selective,
        calls,
        keys: p.ids.len() as u64,
        jobs,
    })
}

/// A replayed job in flight: per cache, its keys, device blocks and the host chunks the
/// replay's index gave them.
struct Flight {
    store: bool,
    groups: [Vec<(u64, u64, u32)>; 2],
}

/// What one seed's replay keeps beside the drawn server's state.
struct Replay {
    server: Server,
    flights: BTreeMap<u64, Flight>,
    /// The recording's job ids → the replay's.
    jobs: BTreeMap<u64, u64>,
    /// The chunks the replay's index gave each key's prepares not yet submitted, oldest first
    /// (vLLM may load one key twice at once).
    prepared: BTreeMap<u64, Vec<u32>>,
    /// Jobs the host tier reported done that the recording had not reported yet, and whether
    /// each succeeded: completed at the poll where the recording reports them, so that the
    /// replay's index moves in step with the recorded one.
    finished: BTreeMap<u64, bool>,
    /// A job failed (a driver fault): from then on the replay's index may answer otherwise.
    failed: bool,
    divergences: u64,
    /// The call being replayed (0-based, not counting the registration).
    at: usize,
}

/// Replays `calls` under seed `seed` (`mutant`: a planted mistake, or none).
pub fn run(seed: u64, calls: &Calls, mutant: Option<TransferMutant>) -> Outcome {
    let shape = Shape {
        device_blocks: calls.blocks,
        chunks: calls.chunks,
        keys: calls.keys,
        steps: 0,
        selective: calls.selective,
        driver_fault_rate: Shape::draw(seed).driver_fault_rate,
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
        jobs: BTreeMap::new(),
        prepared: BTreeMap::new(),
        finished: BTreeMap::new(),
        failed: false,
        divergences: 0,
        at: 0,
    };
    for (at, call) in calls.calls.iter().enumerate() {
        r.at = at;
        r.call(call);
    }
    r.wait(None);
    r.collect(None);
    r.finish()
}

fn names(keys: &[u64]) -> Vec<[u8; 8]> {
    keys.iter().map(|&k| key_bytes(k)).collect()
}

impl Replay {
    /// A recorded answer the replay's index did not give: expected after a job failed (the
    /// index then holds other keys), a finding before.
    fn diverged(&mut self, what: String) {
        self.divergences += 1;
        if !self.failed {
            self.server.out.findings.push(format!(
                "call {}: {what}, with no job failed before it",
                self.at + 1
            ));
        }
    }

    fn call(&mut self, call: &Call) {
        match call {
            Call::Lookup { key, found } => {
                let got = self.server.index.lookup(&key_bytes(*key));
                if found.is_some_and(|f| f != got) {
                    self.diverged(format!(
                        "lookup of key {key} answered {got:?}, recorded {found:?}"
                    ));
                }
            }
            Call::PrepareStore { keys, stored } => self.prepare_store(keys, stored.as_deref()),
            Call::PrepareLoad(keys) => {
                let n = names(keys);
                let refs: Vec<&[u8]> = n.iter().map(|k| k.as_slice()).collect();
                match self.server.index.prepare_load(&refs) {
                    Ok(chunks) => {
                        self.server.out.hits += keys.len() as u64;
                        for (&k, c) in keys.iter().zip(chunks) {
                            self.prepared.entry(k).or_default().push(c);
                        }
                    }
                    Err(e) => self.diverged(format!("prepare_load refused: {e}")),
                }
            }
            Call::CompleteStore(keys) => self.release(keys, true),
            Call::CompleteLoad(keys) => self.release(keys, false),
            Call::Submit { store, job, groups } => self.submit(*store, *job, groups),
            Call::GetFinished(done) => {
                self.server.read_held();
                self.wait(Some(done));
                self.collect(Some(done));
            }
            Call::Wait(jobs) => self.wait(Some(jobs)),
        }
        self.server.index.check_invariants();
    }

    fn prepare_store(&mut self, keys: &[u64], stored: Option<&[u64]>) {
        let n = names(keys);
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
                    self.diverged(format!("prepare_store stored {got:?}, recorded {stored:?}"));
                }
                for (k, c) in got.into_iter().zip(out.chunks) {
                    self.prepared.entry(k).or_default().push(c);
                }
            }
            Ok(None) if stored.is_some() => {
                self.diverged(format!("prepare_store stored nothing, recorded {stored:?}"))
            }
            Ok(None) => {}
            Err(e) => self.server.out.findings.push(format!(
                "call {}: prepare_store refused a recorded offer: {e}",
                self.at + 1
            )),
        }
    }

    /// Completions are the replay's own (at its polls); a recorded completion of keys the
    /// replay prepared but gave no job (its answers diverged) completes them as failed, so that
    /// the index does not keep them pending.
    fn release(&mut self, keys: &[u64], store: bool) {
        let orphans: Vec<u64> = keys
            .iter()
            .copied()
            .filter(|k| self.prepared.get(k).is_some_and(|c| !c.is_empty()))
            .collect();
        if orphans.is_empty() {
            return;
        }
        for k in &orphans {
            if let Some(c) = self.prepared.get_mut(k) {
                c.remove(0);
            }
        }
        let n = names(&orphans);
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
    fn submit(&mut self, store: bool, recorded: u64, groups: &[Vec<(u64, u64)>; 2]) {
        let mut take: [Vec<(u64, u64, u32)>; 2] = [Vec::new(), Vec::new()];
        for (c, g) in groups.iter().enumerate() {
            for &(k, b) in g {
                if store {
                    self.compute(c, k, b);
                }
                let chunk = self
                    .prepared
                    .get_mut(&k)
                    .filter(|q| !q.is_empty())
                    .map(|q| q.remove(0));
                match chunk {
                    Some(chunk) => take[c].push((k, b, chunk)),
                    None => self.diverged(format!(
                        "job {recorded} moves key {k}, which the replay's index did not prepare"
                    )),
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
                self.server.out.findings.push(format!(
                    "call {}: job {recorded} was refused by the plan: {e}",
                    self.at + 1
                ));
                return;
            }
        };
        let id = self.server.next_job;
        self.server.next_job += 1;
        // A refused call fails the job: `finished` reports it.
        let _ = self.server.tier.submit(store, id, &plan, 0);
        self.jobs.insert(recorded, id);
        self.flights.insert(
            id,
            Flight {
                store,
                groups: take,
            },
        );
    }

    /// Waits for the replay's jobs of the recorded ids named (every job in flight: `None`).
    fn wait(&mut self, recorded: Option<&[u64]>) {
        let ids: Vec<u64> = match recorded {
            Some(jobs) => jobs
                .iter()
                .filter_map(|j| self.jobs.get(j))
                .filter(|id| self.flights.contains_key(id))
                .copied()
                .collect(),
            None => self.flights.keys().copied().collect(),
        };
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

    /// Ends the jobs the recording reported done at this poll (`None`: every job), checking
    /// what they moved; the host tier's other finished jobs wait for their poll.
    fn collect(&mut self, done: Option<&[u64]>) {
        for (id, ok, _, _) in self.server.tier.finished() {
            if self.finished.insert(id, ok).is_some() || !self.flights.contains_key(&id) {
                self.server
                    .out
                    .findings
                    .push(format!("job {id} reported done twice, or never submitted"));
            }
        }
        let ids: Vec<u64> = match done {
            Some(done) => done
                .iter()
                .filter_map(|j| self.jobs.get(j).copied())
                .collect(),
            None => self.finished.keys().copied().collect(),
        };
        for id in ids {
            let Some(ok) = self.finished.remove(&id) else {
                // Waited for above: a job the tier could not finish is a finding at the end.
                continue;
            };
            let Some(f) = self.flights.remove(&id) else {
                continue;
            };
            self.end(id, ok, &f);
        }
    }

    fn end(&mut self, id: u64, ok: bool, f: &Flight) {
        self.failed |= !ok;
        self.server.out.failed_jobs += u64::from(!ok);
        let names: Vec<[u8; 8]> = f.groups.iter().flatten().map(|e| key_bytes(e.0)).collect();
        let refs: Vec<&[u8]> = names.iter().map(|k| k.as_slice()).collect();
        for (c, g) in f.groups.iter().enumerate() {
            for &(k, b, chunk) in g {
                self.check(f.store, ok, c, (k, b, chunk));
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

    /// A stored chunk (the one the job was planned with) holds its key's bytes; a loaded block
    /// holds its key's bytes (and the server holds it now), or, after a failed load, is
    /// recomputed as vLLM does.
    fn check(&mut self, store: bool, ok: bool, c: usize, (k, b, chunk): (u64, u64, u32)) {
        let want = page_of(k, c);
        if store {
            if ok {
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
