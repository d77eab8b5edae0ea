//! The offload index against a reference model written apart from it: a list scanned in full
//! for every decision (no ordered set, no free list), over random call sequences.

use super::*;
use proptest::prelude::*;

fn k(i: u8) -> Vec<u8> {
    // 36 bytes, like vLLM's keys: a hash and a group index.
    let mut key = vec![i; 32];
    key.extend_from_slice(&[0, 0, 0, u32::from(i % 2) as u8]);
    key
}

fn refs(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(|k| k.as_slice()).collect()
}

#[test]
fn a_store_then_a_load_round_trip() {
    let mut ix = OffloadIndex::new(4, WritePolicy::WriteThrough, true).unwrap();
    let keys = vec![k(1), k(2)];
    assert_eq!(ix.lookup(&k(1)), Lookup::Miss);
    let store = ix.prepare_store(&refs(&keys)).unwrap().unwrap();
    assert_eq!(store.keys.len(), 2);
    assert!(store.evicted.is_empty());
    assert_eq!(ix.lookup(&k(1)), Lookup::Pending);
    assert_eq!(
        ix.prepare_load(&refs(&keys)),
        Err(OffloadError::NotReady {
            key: key_text(&k(1))
        })
    );
    ix.complete_store(&refs(&keys), true).unwrap();
    assert_eq!(ix.lookup(&k(2)), Lookup::Hit);
    let chunks = ix.prepare_load(&refs(&keys)).unwrap();
    assert_eq!(chunks, store.chunks);
    assert_eq!(ix.evictable(), 0);
    ix.complete_load(&refs(&keys)).unwrap();
    assert_eq!(ix.evictable(), 2);
    assert_eq!(
        ix.complete_load(&refs(&keys[..1])),
        Err(OffloadError::NotLoading {
            key: key_text(&k(1))
        })
    );
    let events = ix.take_events();
    assert_eq!(events.len(), 1);
    assert!(!events[0].removed);
    ix.check_invariants();
}

#[test]
fn eviction_takes_the_least_recently_used_and_spares_pins_and_the_offer() {
    let mut ix = OffloadIndex::new(3, WritePolicy::WriteThrough, false).unwrap();
    for i in 1..=3 {
        ix.prepare_store(&[&k(i)]).unwrap().unwrap();
        ix.complete_store(&[&k(i)], true).unwrap();
    }
    // 1 is pinned by a load; 2 is re-offered (a use); so 3 is the one to go.
    ix.prepare_load(&[&k(1)]).unwrap();
    let store = ix.prepare_store(&[&k(2), &k(4)]).unwrap().unwrap();
    assert_eq!(store.keys, vec![Box::from(k(4).as_slice())]);
    assert_eq!(store.evicted, vec![Box::from(k(3).as_slice())]);
    // Nothing left to evict for 5 when 2 is offered beside it: 1 pinned, 4 pending.
    assert_eq!(ix.prepare_store(&[&k(2), &k(5)]).unwrap(), None);
    // Alone, 5 takes 2's chunk.
    let store = ix.prepare_store(&[&k(5)]).unwrap().unwrap();
    assert_eq!(store.evicted, vec![Box::from(k(2).as_slice())]);
    ix.check_invariants();
}

#[test]
fn a_failed_store_frees_its_chunk_and_a_late_completion_is_passed_over() {
    let mut ix = OffloadIndex::new(1, WritePolicy::WriteThrough, true).unwrap();
    ix.prepare_store(&[&k(1)]).unwrap().unwrap();
    ix.complete_store(&[&k(1)], false).unwrap();
    assert_eq!(ix.lookup(&k(1)), Lookup::Miss);
    assert_eq!(ix.free_chunks(), 1);
    ix.complete_store(&[&k(1)], true).unwrap();
    assert_eq!(ix.lookup(&k(1)), Lookup::Miss);
    let events = ix.take_events();
    assert_eq!(events.len(), 1);
    assert!(events[0].removed && events[0].store_failed);
    ix.check_invariants();
}

#[test]
fn the_selective_policy_stores_on_the_second_offer() {
    let mut ix = OffloadIndex::new(4, WritePolicy::WriteThroughSelective, false).unwrap();
    let first = ix.prepare_store(&[&k(1)]).unwrap().unwrap();
    assert!(first.keys.is_empty());
    let second = ix.prepare_store(&[&k(1)]).unwrap().unwrap();
    assert_eq!(second.keys.len(), 1);
    ix.check_invariants();
}

#[test]
fn write_back_and_oversized_pools_and_keys_are_refused() {
    assert!(matches!(
        OffloadIndex::new(4, WritePolicy::WriteBack, false),
        Err(OffloadError::Policy {
            policy: "write_back"
        })
    ));
    assert!(matches!(
        OffloadIndex::new(1 << 40, WritePolicy::WriteThrough, false),
        Err(OffloadError::Capacity { .. })
    ));
    let mut ix = OffloadIndex::new(4, WritePolicy::WriteThrough, false).unwrap();
    let long = vec![7u8; KEY_BYTES_MAX + 1];
    assert!(matches!(
        ix.prepare_store(&[&long]),
        Err(OffloadError::KeyTooLong { .. })
    ));
    assert!(matches!(
        ix.prepare_store(&[&[]]),
        Err(OffloadError::EmptyKey { .. })
    ));
    assert!(matches!(
        ix.prepare_store(&[&k(1), &k(1)]),
        Err(OffloadError::Repeated { .. })
    ));
    assert!(matches!(
        ix.prepare_load(&[&k(1)]),
        Err(OffloadError::NotHeld { .. })
    ));
    assert!(ix.is_empty());
    ix.check_invariants();
}

#[test]
fn the_selective_policys_memory_is_bounded() {
    let mut ix = OffloadIndex::new(1, WritePolicy::WriteThroughSelective, false).unwrap();
    for i in 0..(OFFERS_REMEMBERED_MAX as u32 + 10) {
        ix.prepare_store(&[&i.to_le_bytes()]).unwrap().unwrap();
    }
    ix.check_invariants();
    // The oldest offers were forgotten: offering key 0 again is a first offer.
    let again = ix.prepare_store(&[&0u32.to_le_bytes()]).unwrap().unwrap();
    assert!(again.keys.is_empty());
    // A recent one is remembered: its second offer stores it.
    let recent = (OFFERS_REMEMBERED_MAX as u32 + 5).to_le_bytes();
    assert_eq!(ix.prepare_store(&[&recent]).unwrap().unwrap().keys.len(), 1);
    ix.check_invariants();
}

type Keys = Vec<Vec<u8>>;

/// The reference: each held key with its state and last use, in a plain list.
#[derive(Default, Debug)]
struct Model {
    capacity: usize,
    selective: bool,
    held: Vec<(Vec<u8>, Option<u32>, u64)>, // key, pins (None: pending), last use
    offered: Vec<Vec<u8>>,
    clock: u64,
}

impl Model {
    fn find(&self, key: &[u8]) -> Option<usize> {
        self.held.iter().position(|(k, _, _)| k == key)
    }
    fn lookup(&self, key: &[u8]) -> Lookup {
        match self.find(key).map(|i| self.held[i].1) {
            None => Lookup::Miss,
            Some(None) => Lookup::Pending,
            Some(Some(_)) => Lookup::Hit,
        }
    }
    fn prepare_load(&mut self, keys: &[Vec<u8>]) -> bool {
        if keys
            .iter()
            .any(|k| !matches!(self.find(k).map(|i| self.held[i].1), Some(Some(_))))
        {
            return false;
        }
        for key in keys {
            self.clock += 1;
            let i = self.find(key).unwrap();
            self.held[i].1 = Some(self.held[i].1.unwrap() + 1);
            self.held[i].2 = self.clock;
        }
        true
    }
    fn complete_load(&mut self, keys: &[Vec<u8>]) -> bool {
        if keys
            .iter()
            .any(|k| !matches!(self.find(k).map(|i| self.held[i].1), Some(Some(p)) if p > 0))
        {
            return false;
        }
        for key in keys {
            let i = self.find(key).unwrap();
            self.held[i].1 = Some(self.held[i].1.unwrap() - 1);
        }
        true
    }
    /// The keys stored and the keys evicted, or `None`.
    fn prepare_store(&mut self, keys: &[Vec<u8>]) -> Option<(Keys, Keys)> {
        let wanted: Vec<Vec<u8>> = keys
            .iter()
            .filter(|k| self.find(k).is_none())
            .cloned()
            .collect();
        let admitted: Vec<Vec<u8>> = if self.selective {
            wanted
                .iter()
                .filter(|k| self.offered.contains(k))
                .cloned()
                .collect()
        } else {
            wanted.clone()
        };
        let free = self.capacity - self.held.len();
        let evict = admitted.len().saturating_sub(free);
        let mut candidates: Vec<(u64, Vec<u8>)> = self
            .held
            .iter()
            .filter(|(k, pins, _)| *pins == Some(0) && !keys.contains(k))
            .map(|(k, _, t)| (*t, k.clone()))
            .collect();
        candidates.sort();
        if candidates.len() < evict {
            return None;
        }
        for key in keys {
            self.clock += 1;
            if let Some(i) = self.find(key) {
                if self.held[i].1.is_some() {
                    self.held[i].2 = self.clock;
                }
            }
        }
        let evicted: Vec<Vec<u8>> = candidates[..evict].iter().map(|(_, k)| k.clone()).collect();
        self.held.retain(|(k, _, _)| !evicted.contains(k));
        for key in &admitted {
            self.clock += 1;
            self.held.push((key.clone(), None, self.clock));
            self.offered.retain(|k| k != key);
        }
        if self.selective {
            for key in &wanted {
                if !admitted.contains(key) && !self.offered.contains(key) {
                    self.offered.push(key.clone());
                }
            }
        }
        Some((admitted, evicted))
    }
    fn complete_store(&mut self, keys: &[Vec<u8>], ok: bool) {
        for key in keys {
            if let Some(i) = self.find(key) {
                if self.held[i].1.is_none() {
                    if ok {
                        self.held[i].1 = Some(0);
                    } else {
                        self.held.remove(i);
                    }
                }
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Call {
    Lookup(u8),
    Load(Vec<u8>),
    LoadDone(Vec<u8>),
    Store(Vec<u8>),
    StoreDone(Vec<u8>, bool),
    Reset,
}

fn call() -> impl Strategy<Value = Call> {
    let keys = || {
        proptest::collection::btree_set(0u8..12, 1..5)
            .prop_map(|s| s.into_iter().collect::<Vec<u8>>())
    };
    prop_oneof![
        1 => (0u8..12).prop_map(Call::Lookup),
        1 => keys().prop_map(Call::Load),
        1 => keys().prop_map(Call::LoadDone),
        3 => keys().prop_map(Call::Store),
        2 => (keys(), proptest::bool::weighted(0.85)).prop_map(|(k, ok)| Call::StoreDone(k, ok)),
        1 => Just(Call::Reset),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn the_index_decides_as_the_reference_model(
        capacity in 1usize..7,
        selective in proptest::bool::ANY,
        calls in proptest::collection::vec(call(), 1..80),
    ) {
        let policy = if selective { WritePolicy::WriteThroughSelective } else { WritePolicy::WriteThrough };
        let mut ix = OffloadIndex::new(capacity as u64, policy, true).unwrap();
        let mut model = Model { capacity, selective, ..Model::default() };
        for c in calls {
            match c {
                Call::Lookup(i) => prop_assert_eq!(ix.lookup(&k(i)), model.lookup(&k(i))),
                Call::Load(ids) => {
                    let keys: Vec<Vec<u8>> = ids.iter().map(|&i| k(i)).collect();
                    let got = ix.prepare_load(&refs(&keys));
                    prop_assert_eq!(got.is_ok(), model.prepare_load(&keys));
                    if let Ok(chunks) = got {
                        for (key, chunk) in keys.iter().zip(chunks) {
                            prop_assert_eq!(ix.chunk_of(key), Some(chunk));
                        }
                    }
                }
                Call::LoadDone(ids) => {
                    let keys: Vec<Vec<u8>> = ids.iter().map(|&i| k(i)).collect();
                    prop_assert_eq!(ix.complete_load(&refs(&keys)).is_ok(), model.complete_load(&keys));
                }
                Call::Store(ids) => {
                    let keys: Vec<Vec<u8>> = ids.iter().map(|&i| k(i)).collect();
                    let got = ix.prepare_store(&refs(&keys)).unwrap();
                    let want = model.prepare_store(&keys);
                    match (got, want) {
                        (None, None) => {}
                        (Some(store), Some((stored, evicted))) => {
                            let got_keys: Vec<Vec<u8>> = store.keys.iter().map(|k| k.to_vec()).collect();
                            let got_evicted: Vec<Vec<u8>> = store.evicted.iter().map(|k| k.to_vec()).collect();
                            prop_assert_eq!(got_keys, stored);
                            prop_assert_eq!(got_evicted, evicted);
                            let mut chunks = store.chunks.clone();
                            chunks.sort_unstable();
                            chunks.dedup();
                            prop_assert_eq!(chunks.len(), store.chunks.len(), "a chunk reserved twice");
                            prop_assert!(store.chunks.iter().all(|&c| u64::from(c) < capacity as u64));
                        }
                        (got, want) => prop_assert!(false, "index {:?}, model {:?}", got, want),
                    }
                }
                Call::StoreDone(ids, ok) => {
                    let keys: Vec<Vec<u8>> = ids.iter().map(|&i| k(i)).collect();
                    ix.complete_store(&refs(&keys), ok).unwrap();
                    model.complete_store(&keys, ok);
                }
                Call::Reset => {
                    ix.reset();
                    model = Model { capacity, selective, ..Model::default() };
                }
            }
            ix.check_invariants();
            prop_assert_eq!(ix.len(), model.held.len());
        }
    }
}

#[test]
fn a_key_of_exactly_the_longest_length_is_taken() {
    let mut ix = OffloadIndex::new(2, WritePolicy::WriteThrough, false).unwrap();
    let longest = vec![7u8; KEY_BYTES_MAX];
    assert_eq!(
        ix.prepare_store(&[&longest]).unwrap().unwrap().keys.len(),
        1
    );
    let longer = vec![7u8; KEY_BYTES_MAX + 1];
    assert!(ix.prepare_store(&[&longer]).is_err());
}

#[test]
fn the_selective_policy_remembers_exactly_its_bound() {
    let mut ix = OffloadIndex::new(1, WritePolicy::WriteThroughSelective, false).unwrap();
    for i in 0..OFFERS_REMEMBERED_MAX as u32 {
        ix.prepare_store(&[&i.to_le_bytes()]).unwrap().unwrap();
    }
    // OFFERS_REMEMBERED_MAX offers are all remembered: the oldest one's second offer stores it.
    assert_eq!(
        ix.prepare_store(&[&0u32.to_le_bytes()])
            .unwrap()
            .unwrap()
            .keys
            .len(),
        1
    );
}

#[test]
fn an_index_is_empty_until_a_store_and_a_key_shows_as_hex() {
    let mut ix = OffloadIndex::new(4, WritePolicy::WriteThrough, false).unwrap();
    assert!(ix.is_empty());
    ix.prepare_store(&refs(&[k(3)])).unwrap().unwrap();
    assert!(!ix.is_empty(), "a pending store holds its key");
    assert_eq!(ix.len(), 1);
    // Up to 20 bytes in full; longer keys by their first 16 and last 4 bytes, and their length.
    assert_eq!(key_text(&[0x0a, 0xff]), "0aff");
    let long = k(0xab);
    assert_eq!(
        key_text(&long),
        format!("{}…00000001 (36 bytes)", "ab".repeat(16))
    );
}

/// The index's self-check refuses a count that disagrees with its entries: the check the
/// simulator and the tests above lean on is not a check that passes whatever it sees.
#[test]
fn the_invariant_check_refuses_a_count_that_disagrees() {
    let ix = OffloadIndex::new(4, WritePolicy::WriteThrough, true).unwrap();
    ix.check_invariants();
    let mut broken = OffloadIndex::new(4, WritePolicy::WriteThrough, true).unwrap();
    broken.pending += 1;
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| broken.check_invariants()))
        .expect_err("a pending count with no pending entry");
    let text = e.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(text.contains("pending count"), "{text}");
}

/// The index reports the capacity it was built with and the chunks its stores have reserved
/// until they complete.
#[test]
fn the_index_reports_its_capacity_and_its_pending_stores() {
    let mut ix = OffloadIndex::new(5, WritePolicy::WriteThrough, false).unwrap();
    assert_eq!((ix.capacity(), ix.pending()), (5, 0));
    let keys = vec![k(1), k(2), k(3)];
    ix.prepare_store(&refs(&keys)).unwrap().unwrap();
    assert_eq!(ix.pending(), 3);
    ix.complete_store(&refs(&keys[..2]), true).unwrap();
    assert_eq!(ix.pending(), 1);
    ix.complete_store(&refs(&keys[2..]), false).unwrap();
    assert_eq!((ix.capacity(), ix.pending()), (5, 0));
}
