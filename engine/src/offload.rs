//! The host tier's index for a server that names its blocks itself: a fixed pool of host chunks
//! keyed by opaque block keys (vLLM's `OffloadKey`: a block hash followed by the KV group's
//! index), with the states a store and a load pass through and least-recently-used eviction in
//! O(log n) per chunk.
//!
//! The engine's own prefix cache ([`crate::cache::PrefixCache`]) keys pages by their tokens and
//! keeps a radix tree, because it decides itself which prefixes exist. A server's offloading
//! interface hands over chained hashes instead: each key already names its whole prefix, so the
//! index is flat. It keeps the prefix cache's eviction structure (an ordered set of
//! `(last use, chunk)` candidates, changed by every transition that moves a chunk in or out of
//! candidacy) and its write policies where the interface can express them.
//!
//! A chunk's life: `prepare_store` reserves it for a key (**pending**: neither loadable nor
//! evictable) → `complete_store(ok)` makes it **ready** (loadable, evictable while no load pins
//! it) or, on failure, frees it → `prepare_load` pins it (a pin count) → `complete_load` unpins
//! it. Recency is the last store, load or re-offer of the key; the keys of one call are used in
//! the call's order. `reset` forgets every key.
//!
//! Misuse (completing a load that was not prepared, loading a key that is not ready, a key too
//! long) is a typed [`OffloadError`] naming the key, and leaves the index unchanged.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::WritePolicy;

pub mod plan;
pub mod transfer;

/// The longest key accepted, in bytes: a block hash of up to 1,020 bytes and a 4-byte group
/// index. vLLM's keys are 36 bytes (SHA-256 and the group).
pub const KEY_BYTES_MAX: usize = 1024;

/// How many offers of keys not stored the selective write policy remembers (the oldest is
/// forgotten first): it bounds the index's memory whatever a caller offers.
pub const OFFERS_REMEMBERED_MAX: usize = 1 << 16;

/// A block's key, as the server gives it.
pub type Key = Box<[u8]>;

/// What [`OffloadIndex::lookup`] finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// No chunk holds the key.
    Miss,
    /// A chunk holds the key and its store completed: it can be loaded.
    Hit,
    /// A chunk is reserved for the key but its store has not completed.
    Pending,
}

/// What [`OffloadIndex::prepare_store`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Store {
    /// The offered keys to store, in offer order (keys already held or pending are not, nor
    /// keys the write policy does not admit yet).
    pub keys: Vec<Key>,
    /// The chunk reserved for each of `keys`.
    pub chunks: Vec<u32>,
    /// Keys evicted to make room, oldest first.
    pub evicted: Vec<Key>,
}

/// A change of what the tier holds, for a server that publishes cache events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub keys: Vec<Key>,
    /// `true`: the keys left the tier (evicted, or their store failed); `false`: stored.
    pub removed: bool,
    /// `true` for keys whose store failed: they were never announced as stored.
    pub store_failed: bool,
}

/// A refused call. The index is unchanged by it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OffloadError {
    #[error("offload index: key {key} is {len} bytes, longer than the {max} accepted")]
    KeyTooLong { key: String, len: usize, max: usize },
    #[error("offload index: key {key} is empty")]
    EmptyKey { key: String },
    #[error("offload index: key {key} is not held (a load of a key that was never stored, or was evicted)")]
    NotHeld { key: String },
    #[error("offload index: key {key} is not ready to load (its store has not completed)")]
    NotReady { key: String },
    #[error("offload index: key {key} completes a load that was not prepared (no load pins it)")]
    NotLoading { key: String },
    #[error("offload index: key {key} appears twice in one call")]
    Repeated { key: String },
    #[error(
        "offload index: write policy {policy} cannot be followed here: the offloading \
         interface does not tell the host tier when the device evicts a block (use \
         write_through or write_through_selective)"
    )]
    Policy { policy: &'static str },
    #[error("offload index: {chunks} chunks is more than the {max} an index can address")]
    Capacity { chunks: u64, max: u64 },
}

/// A key as an error message shows it: its bytes in hex, the first 16 and the last 4 (the group)
/// when it is longer.
pub fn key_text(key: &[u8]) -> String {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    if key.len() <= 20 {
        hex(key)
    } else {
        format!(
            "{}…{} ({} bytes)",
            hex(&key[..16]),
            hex(&key[key.len() - 4..]),
            key.len()
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Pending,
    Ready { pins: u32 },
}

#[derive(Clone, Debug)]
struct Entry {
    chunk: u32,
    state: State,
    last_use: u64,
}

/// The index. See the module comment for the life of a chunk.
#[derive(Clone, Debug)]
pub struct OffloadIndex {
    capacity: u32,
    policy: WritePolicy,
    entries: BTreeMap<Key, Entry>,
    /// The key each reserved or held chunk belongs to (`None`: free or never used).
    chunk_keys: Vec<Option<Key>>,
    /// Chunks freed, reused before a fresh one.
    free: Vec<u32>,
    /// Eviction candidates in LRU order, `(last_use, chunk)`: ready, unpinned chunks.
    candidates: BTreeSet<(u64, u32)>,
    tick: u64,
    /// Selective write policy: the keys offered once and not stored (at most
    /// [`OFFERS_REMEMBERED_MAX`]), each with the number of its offer, and the same by offer
    /// number, so that the oldest is forgotten first.
    offered_set: BTreeMap<Key, u64>,
    offered: BTreeMap<u64, Key>,
    offers: u64,
    pending: u32,
    events: Option<Vec<Event>>,
}

impl OffloadIndex {
    /// The most chunks an index addresses (chunk numbers are `u32`).
    pub const CHUNKS_MAX: u64 = u32::MAX as u64;

    /// An empty index of `chunks` host chunks following `policy`; `events` keeps the events
    /// [`OffloadIndex::take_events`] hands out. Nothing is allocated per chunk until it is used.
    pub fn new(chunks: u64, policy: WritePolicy, events: bool) -> Result<Self, OffloadError> {
        if chunks > Self::CHUNKS_MAX {
            return Err(OffloadError::Capacity {
                chunks,
                max: Self::CHUNKS_MAX,
            });
        }
        if policy == WritePolicy::WriteBack {
            return Err(OffloadError::Policy {
                policy: policy.name(),
            });
        }
        Ok(OffloadIndex {
            capacity: chunks as u32,
            policy,
            entries: BTreeMap::new(),
            chunk_keys: Vec::new(),
            free: Vec::new(),
            candidates: BTreeSet::new(),
            tick: 0,
            offered: BTreeMap::new(),
            offered_set: BTreeMap::new(),
            offers: 0,
            pending: 0,
            events: events.then(Vec::new),
        })
    }

    pub fn capacity(&self) -> u64 {
        u64::from(self.capacity)
    }

    pub fn policy(&self) -> WritePolicy {
        self.policy
    }

    /// Keys held (pending or ready).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Chunks reserved by stores that have not completed.
    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// Ready chunks no load pins (what eviction may take).
    pub fn evictable(&self) -> usize {
        self.candidates.len()
    }

    /// Chunks never used or freed.
    pub fn free_chunks(&self) -> u64 {
        u64::from(self.capacity) - self.chunk_keys.len() as u64 + self.free.len() as u64
    }

    /// The chunk holding `key`, when it is held.
    pub fn chunk_of(&self, key: &[u8]) -> Option<u32> {
        self.entries.get(key).map(|e| e.chunk)
    }

    pub fn lookup(&self, key: &[u8]) -> Lookup {
        match self.entries.get(key).map(|e| e.state) {
            None => Lookup::Miss,
            Some(State::Pending) => Lookup::Pending,
            Some(State::Ready { .. }) => Lookup::Hit,
        }
    }

    /// Pins each key's chunk for a load and returns the chunks, in order. Every key must be
    /// ready; a key may not repeat (each would need its own pin and its own completion).
    pub fn prepare_load(&mut self, keys: &[&[u8]]) -> Result<Vec<u32>, OffloadError> {
        check_keys(keys)?;
        for key in keys {
            match self.entries.get(*key) {
                None => return Err(OffloadError::NotHeld { key: key_text(key) }),
                Some(Entry {
                    state: State::Pending,
                    ..
                }) => return Err(OffloadError::NotReady { key: key_text(key) }),
                Some(_) => {}
            }
        }
        let mut chunks = Vec::with_capacity(keys.len());
        for key in keys {
            let tick = self.next_tick();
            let e = self.entries.get_mut(*key).expect("checked above");
            let State::Ready { pins } = &mut e.state else {
                unreachable!("checked above")
            };
            if *pins == 0 {
                let was = self.candidates.remove(&(e.last_use, e.chunk));
                assert!(was, "an unpinned ready chunk is a candidate");
            }
            *pins = pins.checked_add(1).expect("pin count overflow");
            e.last_use = tick;
            chunks.push(e.chunk);
        }
        Ok(chunks)
    }

    /// Unpins each key's chunk: a load prepared by [`OffloadIndex::prepare_load`] is done.
    pub fn complete_load(&mut self, keys: &[&[u8]]) -> Result<(), OffloadError> {
        check_keys(keys)?;
        for key in keys {
            match self.entries.get(*key).map(|e| e.state) {
                None => return Err(OffloadError::NotHeld { key: key_text(key) }),
                Some(State::Ready { pins }) if pins > 0 => {}
                Some(_) => return Err(OffloadError::NotLoading { key: key_text(key) }),
            }
        }
        for key in keys {
            let e = self.entries.get_mut(*key).expect("checked above");
            let State::Ready { pins } = &mut e.state else {
                unreachable!("checked above")
            };
            *pins -= 1;
            if *pins == 0 {
                self.candidates.insert((e.last_use, e.chunk));
            }
        }
        Ok(())
    }

    /// Reserves chunks for the offered keys that the tier does not hold and the write policy
    /// admits, evicting the least recently used ready, unpinned chunks of keys not offered here
    /// when the free chunks do not suffice. `Ok(None)`: not enough chunks can be freed (nothing
    /// changed, the offer is not remembered). Offered keys the tier already holds ready count as
    /// a use.
    pub fn prepare_store(&mut self, keys: &[&[u8]]) -> Result<Option<Store>, OffloadError> {
        check_keys(keys)?;
        let wanted: Vec<&[u8]> = keys
            .iter()
            .copied()
            .filter(|k| !self.entries.contains_key(*k))
            .collect();
        let admitted: Vec<&[u8]> = match self.policy {
            WritePolicy::WriteThrough => wanted.clone(),
            WritePolicy::WriteThroughSelective => wanted
                .iter()
                .copied()
                .filter(|k| self.offered_set.contains_key(*k))
                .collect(),
            WritePolicy::WriteBack => unreachable!("refused at construction"),
        };
        let evict = (admitted.len() as u64).saturating_sub(self.free_chunks());
        let Some(victims) = self.victims(keys, evict) else {
            return Ok(None);
        };
        self.touch_ready(keys);
        let evicted = self.evict(&victims);
        let mut store = Store {
            keys: Vec::with_capacity(admitted.len()),
            chunks: Vec::with_capacity(admitted.len()),
            evicted,
        };
        for key in &admitted {
            let (key, chunk) = self.reserve(key);
            store.keys.push(key);
            store.chunks.push(chunk);
        }
        // The selective policy remembers the keys it did not admit yet.
        if self.policy == WritePolicy::WriteThroughSelective {
            for key in &wanted {
                if !self.entries.contains_key(*key) {
                    self.remember_offer(key);
                }
            }
        }
        Ok(Some(store))
    }

    /// The `evict` candidates eviction takes, oldest first, passing over the offered `keys`;
    /// `None` when there are fewer.
    fn victims(&self, keys: &[&[u8]], evict: u64) -> Option<Vec<(u64, u32)>> {
        let offered: BTreeSet<&[u8]> = keys.iter().copied().collect();
        let victims: Vec<(u64, u32)> = self
            .candidates
            .iter()
            .filter(|&&(_, chunk)| {
                let key = self.chunk_keys[chunk as usize]
                    .as_deref()
                    .expect("a candidate has a key");
                !offered.contains(key)
            })
            .take(evict as usize)
            .copied()
            .collect();
        (victims.len() as u64 == evict).then_some(victims)
    }

    /// A re-offer of a ready key is a use.
    fn touch_ready(&mut self, keys: &[&[u8]]) {
        for key in keys {
            let tick = self.next_tick();
            if let Some(e) = self.entries.get_mut(*key) {
                if let State::Ready { pins } = e.state {
                    if pins == 0 {
                        self.candidates.remove(&(e.last_use, e.chunk));
                        self.candidates.insert((tick, e.chunk));
                    }
                    e.last_use = tick;
                }
            }
        }
    }

    /// Frees the victims' chunks and forgets their keys, which it returns (and records as an
    /// event).
    fn evict(&mut self, victims: &[(u64, u32)]) -> Vec<Key> {
        let mut evicted = Vec::with_capacity(victims.len());
        for victim in victims {
            self.candidates.remove(victim);
            let key = self.chunk_keys[victim.1 as usize]
                .take()
                .expect("a candidate has a key");
            self.entries.remove(&key);
            self.free.push(victim.1);
            evicted.push(key);
        }
        if !evicted.is_empty() {
            if let Some(events) = &mut self.events {
                events.push(Event {
                    keys: evicted.clone(),
                    removed: true,
                    store_failed: false,
                });
            }
        }
        evicted
    }

    /// A free chunk (a freed one first, else a fresh one) reserved for `key`, pending.
    fn reserve(&mut self, key: &[u8]) -> (Key, u32) {
        let chunk = match self.free.pop() {
            Some(c) => c,
            None => {
                let c = self.chunk_keys.len() as u32;
                assert!(
                    u64::from(c) < u64::from(self.capacity),
                    "a chunk beyond capacity"
                );
                self.chunk_keys.push(None);
                c
            }
        };
        let key: Key = Box::from(key);
        self.chunk_keys[chunk as usize] = Some(key.clone());
        let last_use = self.next_tick();
        self.entries.insert(
            key.clone(),
            Entry {
                chunk,
                state: State::Pending,
                last_use,
            },
        );
        if let Some(n) = self.offered_set.remove(&key) {
            self.offered.remove(&n);
        }
        self.pending += 1;
        (key, chunk)
    }

    /// The next use's time: every key a call touches gets its own, in the call's order, so
    /// eviction's order has no ties.
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// The selective policy's memory of a key offered and not stored.
    fn remember_offer(&mut self, key: &[u8]) {
        if self.offered_set.contains_key(key) {
            return;
        }
        self.offers += 1;
        self.offered_set.insert(Box::from(key), self.offers);
        self.offered.insert(self.offers, Box::from(key));
        if self.offered.len() > OFFERS_REMEMBERED_MAX {
            let (_, oldest) = self.offered.pop_first().expect("not empty");
            self.offered_set.remove(&oldest);
        }
    }

    /// Ends the stores of `keys`: on success their chunks become ready (loadable and
    /// evictable); on failure they are freed. Keys that are not pending (already completed,
    /// evicted, or reset since) are passed over, as a store's completion may arrive late.
    pub fn complete_store(&mut self, keys: &[&[u8]], ok: bool) -> Result<(), OffloadError> {
        check_keys(keys)?;
        let mut done = Vec::new();
        for key in keys {
            let Some(e) = self.entries.get_mut(*key) else {
                continue;
            };
            if e.state != State::Pending {
                continue;
            }
            self.pending -= 1;
            if ok {
                e.state = State::Ready { pins: 0 };
                self.candidates.insert((e.last_use, e.chunk));
            } else {
                let chunk = e.chunk;
                self.entries.remove(*key);
                self.chunk_keys[chunk as usize] = None;
                self.free.push(chunk);
            }
            done.push(Box::from(*key));
        }
        if !done.is_empty() {
            if let Some(events) = &mut self.events {
                events.push(Event {
                    keys: done,
                    removed: !ok,
                    store_failed: !ok,
                });
            }
        }
        Ok(())
    }

    /// Forgets every key (the server's cache reset): every chunk free, nothing pending.
    pub fn reset(&mut self) {
        self.entries.clear();
        self.chunk_keys.clear();
        self.free.clear();
        self.candidates.clear();
        self.offered.clear();
        self.offered_set.clear();
        self.pending = 0;
    }

    /// The events since the last call (none when the index keeps no events).
    pub fn take_events(&mut self) -> Vec<Event> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Panics when the index's structures disagree (tests and the simulator call it).
    pub fn check_invariants(&self) {
        let mut pending = 0;
        let mut candidates = 0;
        for (key, e) in &self.entries {
            assert_eq!(
                self.chunk_keys[e.chunk as usize].as_deref(),
                Some(&**key),
                "chunk {}'s key",
                e.chunk
            );
            match e.state {
                State::Pending => pending += 1,
                State::Ready { pins: 0 } => {
                    assert!(
                        self.candidates.contains(&(e.last_use, e.chunk)),
                        "ready chunk {} not a candidate",
                        e.chunk
                    );
                    candidates += 1;
                }
                State::Ready { .. } => {}
            }
        }
        assert_eq!(pending, self.pending, "pending count");
        assert_eq!(candidates, self.candidates.len(), "candidates");
        let used = self.chunk_keys.iter().filter(|k| k.is_some()).count();
        assert_eq!(used, self.entries.len(), "chunks in use");
        assert_eq!(used + self.free.len(), self.chunk_keys.len(), "free list");
        assert!(
            self.chunk_keys.len() as u64 <= u64::from(self.capacity),
            "chunks beyond capacity"
        );
        for &c in &self.free {
            assert!(
                self.chunk_keys[c as usize].is_none(),
                "free chunk {c} has a key"
            );
        }
        assert!(
            self.offered.len() <= OFFERS_REMEMBERED_MAX,
            "offers remembered"
        );
        assert_eq!(self.offered.len(), self.offered_set.len(), "offer maps");
        for (n, k) in &self.offered {
            assert_eq!(self.offered_set.get(k), Some(n), "offer {n} of a key");
            assert!(
                !self.entries.contains_key(k),
                "a held key remembered as offered"
            );
        }
    }
}

/// Refuses empty, over-long and repeated keys.
fn check_keys(keys: &[&[u8]]) -> Result<(), OffloadError> {
    let mut seen = BTreeSet::new();
    for key in keys {
        if key.is_empty() {
            return Err(OffloadError::EmptyKey {
                key: String::from("(empty)"),
            });
        }
        if key.len() > KEY_BYTES_MAX {
            return Err(OffloadError::KeyTooLong {
                key: key_text(key),
                len: key.len(),
                max: KEY_BYTES_MAX,
            });
        }
        if !seen.insert(*key) {
            return Err(OffloadError::Repeated { key: key_text(key) });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
