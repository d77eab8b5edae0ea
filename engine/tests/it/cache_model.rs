//! State-machine test of the tiered prefix cache: a reference model — a flat map from page paths to
//! {resident, backed up} with LRU clocks, written independently of the radix tree — drives the
//! real `PrefixCache` through insert, match, backup, load-back and eviction in both tiers, and after
//! every step the two must hold exactly the same pages in the same tiers. proptest-state-machine
//! shrinks failing sequences.

use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};
use std::collections::BTreeMap;
use tierkv_engine::cache::{PageKey, PrefixCache, ROOT};
use tierkv_engine::config::WritePolicy;
use tierkv_engine::pools::PageAllocator;

const DEVICE_PAGES: usize = 12;
const HOST_PAGES: u32 = 1024;

/// Four documents sharing prefixes pairwise, up to 6 pages each (page key ids).
const DOCS: [[u8; 6]; 4] = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 7, 8, 9, 10],
    [11, 12, 13, 14, 15, 16],
    [11, 17, 18, 19, 20, 21],
];

fn doc(d: u8, len: u8) -> Vec<u8> {
    DOCS[(d % 4) as usize][..(1 + len % 6) as usize].to_vec()
}

fn keys(path: &[u8]) -> Vec<PageKey> {
    path.iter().map(|&k| [k as u32; 64]).collect()
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct MNode {
    device: bool,
    host: bool,
    last: u64,
    host_last: u64,
}

#[derive(Clone, Debug, Default)]
struct Model {
    nodes: BTreeMap<Vec<u8>, MNode>,
    tick: u64,
    device_used: usize,
}

#[derive(Clone, Debug)]
enum T {
    Insert(u8, u8),
    Match(u8, u8),
    Backup(u8, u8),
    LoadBack(u8, u8),
    EvictDevice(u8),
    EvictHost(u8),
}

impl Model {
    /// (device, host) counts a match of `path` finds.
    fn predict(&self, path: &[u8]) -> (usize, usize) {
        let (mut d, mut h) = (0, 0);
        for i in 1..=path.len() {
            match self.nodes.get(&path[..i]) {
                Some(n) if n.device && h == 0 => d += 1,
                Some(n) if !n.device && n.host => h += 1,
                _ => break,
            }
        }
        (d, h)
    }
    fn touch(&mut self, path: &[u8], n: usize) {
        self.tick += 1;
        for i in 1..=n {
            self.nodes.get_mut(&path[..i]).unwrap().last = self.tick;
        }
    }
    fn children(&self, p: &[u8]) -> impl Iterator<Item = (&Vec<u8>, &MNode)> {
        let p = p.to_vec();
        self.nodes
            .iter()
            .filter(move |(k, _)| k.len() == p.len() + 1 && k.starts_with(&p))
    }
}

struct CacheMachine;

impl ReferenceStateMachine for CacheMachine {
    type State = Model;
    type Transition = T;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<T> {
        prop_oneof![
            3 => (any::<u8>(), any::<u8>()).prop_map(|(d, l)| T::Insert(d, l)),
            1 => (any::<u8>(), any::<u8>()).prop_map(|(d, l)| T::Match(d, l)),
            2 => (any::<u8>(), any::<u8>()).prop_map(|(d, l)| T::Backup(d, l)),
            2 => (any::<u8>(), any::<u8>()).prop_map(|(d, l)| T::LoadBack(d, l)),
            2 => (1u8..6).prop_map(T::EvictDevice),
            1 => (1u8..6).prop_map(T::EvictHost),
        ]
        .boxed()
    }

    fn preconditions(m: &Model, t: &T) -> bool {
        let free = DEVICE_PAGES - m.device_used;
        match t {
            T::Insert(d, l) => {
                let p = doc(*d, *l);
                p.len() - m.predict(&p).0 <= free
            }
            T::LoadBack(d, l) => m.predict(&doc(*d, *l)).1 <= free,
            _ => true,
        }
    }

    fn apply(mut m: Model, t: &T) -> Model {
        match *t {
            T::Insert(d, l) => {
                let p = doc(d, l);
                let (dev, host) = m.predict(&p);
                m.touch(&p, dev + host); // match
                m.tick += 1; // insert
                for i in 1..=p.len() {
                    let n = m.nodes.entry(p[..i].to_vec()).or_default();
                    n.device = true;
                    n.last = m.tick;
                }
                m.device_used += p.len() - dev;
                m.touch(&p, dev + host); // unlock
            }
            T::Match(d, l) => {
                let p = doc(d, l);
                let (dev, host) = m.predict(&p);
                m.touch(&p, dev + host);
            }
            T::Backup(d, l) => {
                let p = doc(d, l);
                let (dev, host) = m.predict(&p);
                m.touch(&p, dev + host);
                if dev > 0 {
                    // Backed-up nodes are a prefix of the resident ones: back up the rest.
                    let first = (1..=dev).find(|&i| !m.nodes[&p[..i]].host);
                    if let Some(first) = first {
                        m.tick += 1;
                        for i in first..=dev {
                            let n = m.nodes.get_mut(&p[..i]).unwrap();
                            n.host = true;
                            n.host_last = m.tick;
                        }
                    }
                }
            }
            T::LoadBack(d, l) => {
                let p = doc(d, l);
                let (dev, host) = m.predict(&p);
                m.touch(&p, dev + host);
                if host > 0 {
                    m.tick += 1;
                    for i in dev + 1..=dev + host {
                        let n = m.nodes.get_mut(&p[..i]).unwrap();
                        n.device = true;
                        n.host_last = m.tick;
                    }
                    m.device_used += host;
                    m.touch(&p, dev + host); // unlock
                }
            }
            T::EvictDevice(want) => {
                let mut freed = 0;
                while freed < want as usize {
                    let cand = m
                        .nodes
                        .iter()
                        .filter(|(k, n)| n.device && !m.children(k).any(|(_, c)| c.device))
                        .min_by_key(|(_, n)| n.last)
                        .map(|(k, _)| k.clone());
                    let Some(k) = cand else { break };
                    let n = m.nodes.get_mut(&k).unwrap();
                    n.device = false;
                    if !n.host {
                        m.nodes.remove(&k);
                    }
                    m.device_used -= 1;
                    freed += 1;
                }
            }
            T::EvictHost(want) => {
                let mut freed = 0;
                loop {
                    // One round: the current candidates, oldest host use first.
                    let mut cands: Vec<(u64, Vec<u8>)> = m
                        .nodes
                        .iter()
                        .filter(|(k, n)| n.host && !m.children(k).any(|(_, c)| c.host))
                        .map(|(k, n)| (n.host_last, k.clone()))
                        .collect();
                    if cands.is_empty() || freed >= want as usize {
                        break;
                    }
                    cands.sort();
                    for (_, k) in cands {
                        if freed >= want as usize {
                            break;
                        }
                        let n = m.nodes.get_mut(&k).unwrap();
                        n.host = false;
                        freed += 1;
                        if !n.device && m.children(&k).next().is_none() {
                            m.nodes.remove(&k);
                        }
                    }
                }
            }
        }
        m
    }
}

struct Sut {
    cache: PrefixCache,
    device: PageAllocator,
    host: PageAllocator,
}

impl StateMachineTest for CacheMachine {
    type SystemUnderTest = Sut;
    type Reference = CacheMachine;

    fn init_test(_: &Model) -> Sut {
        Sut {
            cache: PrefixCache::new(),
            device: PageAllocator::new(DEVICE_PAGES as u32),
            host: PageAllocator::new(HOST_PAGES),
        }
    }

    fn apply(mut s: Sut, _after: &Model, t: T) -> Sut {
        match t {
            T::Insert(d, l) => {
                let k = keys(&doc(d, l));
                let m = s.cache.match_prefix(&k);
                s.cache.touch(&m.nodes);
                s.cache.lock(&m.nodes);
                let mut table: Vec<_> = m.nodes[..m.device]
                    .iter()
                    .map(|&n| s.cache.node(n).device.unwrap())
                    .collect();
                table.extend(
                    s.device
                        .alloc(k.len() - m.device)
                        .expect("precondition: room"),
                );
                let ins = s.cache.insert(&k, &table);
                assert!(ins.duplicates.is_empty());
                s.cache.unlock(&m.nodes);
            }
            T::Match(d, l) => {
                let p = doc(d, l);
                let m = s.cache.match_prefix(&keys(&p));
                s.cache.touch(&m.nodes);
                let _ = m;
            }
            T::Backup(d, l) => {
                let m = s.cache.match_prefix(&keys(&doc(d, l)));
                s.cache.touch(&m.nodes);
                if m.device > 0 {
                    let path = s.cache.needs_backup(m.nodes[m.device - 1]);
                    if !path.is_empty() {
                        let hp = s.host.alloc(path.len()).unwrap();
                        s.cache.begin_backup(&path, &hp);
                        let (hf, df) = s.cache.finish_backup(&path, true);
                        assert!(hf.is_empty() && df.is_empty());
                    }
                }
            }
            T::LoadBack(d, l) => {
                let m = s.cache.match_prefix(&keys(&doc(d, l)));
                s.cache.touch(&m.nodes);
                if m.host > 0 {
                    let host_part = m.nodes[m.device..].to_vec();
                    s.cache.lock(&m.nodes);
                    s.cache.pin_host(&host_part);
                    let pages = s.device.alloc(m.host).expect("precondition: room");
                    s.cache.begin_load(&host_part, &pages);
                    assert!(s.cache.finish_load(&host_part, true).is_empty());
                    s.cache.unlock(&m.nodes);
                }
            }
            T::EvictDevice(n) => {
                let ev = s.cache.evict_device(n as usize, WritePolicy::WriteThrough);
                assert!(ev.write_back.is_empty());
                s.device.free(&ev.freed);
            }
            T::EvictHost(n) => {
                let freed = s.cache.evict_host(n as usize, ROOT);
                s.host.free(&freed);
            }
        }
        s
    }

    fn check_invariants(s: &Sut, m: &Model) {
        s.cache.check_invariants();
        let mut seen: BTreeMap<Vec<u8>, (bool, bool)> = BTreeMap::new();
        for id in s.cache.live_nodes() {
            let mut path = Vec::new();
            let mut cur = id;
            while cur != ROOT {
                let n = s.cache.node(cur);
                path.push(n.key[0] as u8);
                cur = n.parent;
            }
            path.reverse();
            let n = s.cache.node(id);
            seen.insert(path, (n.device.is_some(), n.host.is_some()));
        }
        let want: BTreeMap<Vec<u8>, (bool, bool)> = m
            .nodes
            .iter()
            .map(|(k, n)| (k.clone(), (n.device, n.host)))
            .collect();
        assert_eq!(seen, want, "the cache and the model hold different pages");
        assert_eq!(
            s.device.used_count() as usize,
            m.device_used,
            "device pages in use"
        );
        assert_eq!(
            s.host.used_count() as usize,
            s.cache.host_pages().len(),
            "host pages in use"
        );
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn prefix_cache_matches_its_reference_model(sequential 1..60 => CacheMachine);
}
