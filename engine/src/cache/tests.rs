//! Random operation sequences on the prefix cache keep every invariant of the module.

use super::*;
use crate::pools::PageAllocator;
use proptest::prelude::*;

fn key(i: u8) -> PageKey {
    [i as u32; PAGE_TOKENS as usize]
}

#[derive(Clone, Debug)]
enum Step {
    /// Match a path (prefix of one of a few fixed "documents"), lock it, and keep it.
    MatchLock(u8, u8),
    /// Unlock the oldest held path.
    Unlock,
    /// Insert a document prefix as a finished request would.
    Insert(u8, u8),
    EvictDevice(u8, bool),
    EvictHost(u8),
    /// Back up the path of a document prefix; finish the oldest backup ok / failed.
    Backup(u8, u8),
    FinishBackup(bool),
    /// Load the host part of a matched path; finish the oldest load ok / failed.
    Load(u8, u8),
    FinishLoad(bool),
}

fn doc(d: u8, len: u8) -> Vec<PageKey> {
    // Four documents sharing their first pages pairwise, up to 6 pages each.
    let base = [
        [1, 2, 3, 4, 5, 6],
        [1, 2, 7, 8, 9, 10],
        [11, 12, 13, 14, 15, 16],
        [11, 17, 18, 19, 20, 21],
    ];
    base[(d % 4) as usize][..(1 + len % 6) as usize]
        .iter()
        .map(|&k| key(k))
        .collect()
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Step::MatchLock(a, b)),
        Just(Step::Unlock),
        (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Step::Insert(a, b)),
        (1u8..6, any::<bool>()).prop_map(|(n, wb)| Step::EvictDevice(n, wb)),
        (1u8..6).prop_map(Step::EvictHost),
        (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Step::Backup(a, b)),
        any::<bool>().prop_map(Step::FinishBackup),
        (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Step::Load(a, b)),
        any::<bool>().prop_map(Step::FinishLoad),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn random_operations_keep_the_invariants(steps in prop::collection::vec(step(), 1..80)) {
        let mut c = PrefixCache::new();
        let mut dev = PageAllocator::new(16);
        let mut host = PageAllocator::new(24);
        let mut held: Vec<Vec<NodeId>> = Vec::new();
        let mut backups: Vec<(Vec<NodeId>, Vec<PageId>)> = Vec::new();
        let mut loads: Vec<(Vec<NodeId>, Vec<PageId>)> = Vec::new();
        for s in steps {
            match s {
                Step::MatchLock(d, l) => {
                    let m = c.match_prefix(&doc(d, l));
                    c.touch(&m.nodes);
                    let path = m.nodes[..m.device].to_vec();
                    c.lock(&path);
                    held.push(path);
                }
                Step::Unlock => if !held.is_empty() { let p = held.remove(0); c.unlock(&p); },
                Step::Insert(d, l) => {
                    let keys = doc(d, l);
                    let m = c.match_prefix(&keys);
                    c.touch(&m.nodes);
                    c.lock(&m.nodes[..m.device]);
                    let mut pages: Vec<PageId> = m.nodes[..m.device].iter().map(|&n| c.node(n).device.unwrap()).collect();
                    let need = keys.len() - m.device;
                    let Some(own) = dev.alloc(need) else { c.unlock(&m.nodes[..m.device]); continue };
                    pages.extend(own);
                    let ins = c.insert(&keys, &pages);
                    dev.free(&ins.duplicates);
                    c.unlock(&m.nodes[..m.device]);
                }
                Step::EvictDevice(n, wb) => {
                    let policy = if wb { WritePolicy::WriteBack } else { WritePolicy::WriteThrough };
                    let ev = c.evict_device(n as usize, policy);
                    dev.free(&ev.freed);
                    for node in ev.write_back {
                        let path = c.needs_backup(node);
                        match host.alloc(path.len()) {
                            Some(hp) if !path.is_empty() => { c.begin_backup(&path, &hp); backups.push((path, hp)); }
                            Some(hp) => { host.free(&hp); c.cancel_write_back(node); }
                            None => c.cancel_write_back(node),
                        }
                    }
                }
                Step::EvictHost(n) => { let f = c.evict_host(n as usize, ROOT); host.free(&f); }
                Step::Backup(d, l) => {
                    let keys = doc(d, l);
                    let m = c.match_prefix(&keys);
                    c.touch(&m.nodes);
                    if m.device == 0 { continue; }
                    let path = c.needs_backup(m.nodes[m.device - 1]);
                    if path.is_empty() { continue; }
                    if let Some(hp) = host.alloc(path.len()) { c.begin_backup(&path, &hp); backups.push((path, hp)); }
                }
                Step::FinishBackup(ok) => if !backups.is_empty() {
                    let (nodes, _) = backups.remove(0);
                    let (hf, df) = c.finish_backup(&nodes, ok);
                    host.free(&hf);
                    dev.free(&df);
                }
                Step::Load(d, l) => {
                    let m = c.match_prefix(&doc(d, l));
                    c.touch(&m.nodes);
                    if m.host == 0 { continue; }
                    let nodes = m.nodes[m.device..].to_vec();
                    let Some(pages) = dev.alloc(nodes.len()) else { continue };
                    c.lock(&m.nodes);
                    c.pin_host(&nodes);
                    c.begin_load(&nodes, &pages);
                    loads.push((m.nodes.clone(), pages));
                }
                Step::FinishLoad(ok) => if !loads.is_empty() {
                    let (all, _) = loads.remove(0);
                    let host_part: Vec<NodeId> = all.iter().copied().filter(|&n| c.node(n).loading.is_some()).collect();
                    let back = c.finish_load(&host_part, ok);
                    dev.free(&back);
                    c.unlock(&all);
                }
            }
            c.check_invariants();
            // Conservation: every allocated page is held by the tree or by an operation in flight.
            let loading: usize = loads.iter().map(|(_, p)| p.len()).sum();
            prop_assert_eq!(dev.used_count() as usize, c.device_pages().len() + loading);
            prop_assert_eq!(host.used_count() as usize, c.host_pages().len());
        }
    }
}
