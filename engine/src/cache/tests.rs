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

/// A load whose host pins were dropped while it ran (`unpin`: mutant 40's lease) ends as any
/// other: a failed one hands its device pages back, a successful one publishes them, and
/// neither drops a pin it no longer holds.
/// A two-page prefix (keys 1 and 2) inserted, backed up and evicted from the device: on the
/// host alone. Returns the cache, the device pages' allocator, the keys and their match.
fn on_the_host_alone() -> (PrefixCache, PageAllocator, Vec<PageKey>, Match) {
    use crate::config::WritePolicy;
    let mut c = PrefixCache::new();
    let (mut dev, mut host) = (PageAllocator::new(8), PageAllocator::new(8));
    let keys: Vec<PageKey> = (1..=2).map(key).collect();
    let pages = dev.alloc(2).expect("room");
    c.insert(&keys, &pages);
    let m = c.match_prefix(&keys);
    let path = c.needs_backup(m.nodes[1]);
    let hp = host.alloc(path.len()).expect("room");
    c.begin_backup(&path, &hp);
    let (host_freed, dev_freed) = c.finish_backup(&path, true);
    assert!(host_freed.is_empty() && dev_freed.is_empty());
    let freed = c.evict_device(2, WritePolicy::WriteThrough).freed;
    dev.free(&freed);
    let m = c.match_prefix(&keys);
    assert_eq!((m.device, m.host), (0, 2), "on the host alone");
    (c, dev, keys, m)
}

#[test]
fn a_load_unpinned_while_it_ran_ends_as_any_other() {
    for ok in [false, true] {
        let (mut c, mut dev, keys, m) = on_the_host_alone();
        let load = dev.alloc(2).expect("room");
        c.pin_host(&m.nodes);
        c.begin_load(&m.nodes, &load);
        c.unpin(&m.nodes);
        assert_eq!(c.pinned_nodes(), 0);
        let back = c.finish_load_unpinned(&m.nodes, ok);
        assert_eq!(c.pinned_nodes(), 0);
        c.check_invariants();
        let now = c.match_prefix(&keys);
        if ok {
            assert!(back.is_empty(), "{back:?}");
            assert_eq!(now.device, 2, "published");
        } else {
            assert_eq!(back, load, "handed back");
            assert_eq!((now.device, now.host), (0, 2), "still on the host alone");
        }
    }
}

/// A host eviction passes over the host copies loads pin, and counts each it passed over
/// (`keep`'s aside: the caller keeps it anyway) in its coverage probe.
#[test]
fn a_host_eviction_counts_the_pinned_copies_it_passes_over() {
    use crate::config::WritePolicy;
    let mut c = PrefixCache::new();
    let (mut dev, mut host) = (PageAllocator::new(8), PageAllocator::new(8));
    // Three one-page documents, each backed up and then evicted from the device.
    let mut nodes = Vec::new();
    for k in 1..=3 {
        let keys = [key(k)];
        c.insert(&keys, &dev.alloc(1).expect("room"));
        let n = c.match_prefix(&keys).nodes[0];
        let hp = host.alloc(1).expect("room");
        c.begin_backup(&[n], &hp);
        assert_eq!(c.finish_backup(&[n], true), (vec![], vec![]));
        nodes.push((n, hp[0]));
    }
    let freed = c.evict_device(3, WritePolicy::WriteThrough).freed;
    assert_eq!(freed.len(), 3, "all three on the host alone");
    let (x, y, z_page) = (nodes[0].0, nodes[1].0, nodes[2].1);
    c.pin_host(&[x, y]);
    probe::take();
    assert_eq!(c.evict_host(1, x), [z_page], "the one unpinned copy");
    let h = probe::take();
    assert_eq!(
        h.get("host.evict_skipped_pinned"),
        Some(&1),
        "y's, not x's: {h:?}"
    );
    c.check_invariants();
}

/// The cache's policies, each pinned by a test (the invariants above hold for any policy).
mod policy {
    use super::*;

    /// A cache holding one-page documents `keys`, inserted in order, on device pages 0, 1, ...
    fn with_pages(keys: &[u8]) -> (PrefixCache, Vec<NodeId>) {
        let mut c = PrefixCache::new();
        let nodes = keys
            .iter()
            .enumerate()
            .map(|(i, &k)| c.insert(&[key(k)], &[PageId(i as u32)]).nodes[0])
            .collect();
        (c, nodes)
    }

    /// Backs up `nodes` one after the other onto host pages `first`, `first + 1`, ...
    fn backed_up(c: &mut PrefixCache, nodes: &[NodeId], first: u32) {
        for (i, &n) in nodes.iter().enumerate() {
            c.begin_backup(&[n], &[PageId(first + i as u32)]);
            c.finish_backup(&[n], true);
        }
    }

    #[test]
    fn device_eviction_takes_the_least_recently_used_leaf() {
        let (mut c, nodes) = with_pages(&[1, 2, 3]);
        // The oldest document is used again: the second is now the least recent.
        let m = c.match_prefix(&[key(1)]);
        c.touch(&m.nodes);
        let ev = c.evict_device(1, WritePolicy::WriteThrough);
        assert_eq!(ev.freed, vec![PageId(1)]);
        assert!(!c.is_live(nodes[1]));
        c.check_invariants();
    }

    #[test]
    fn host_eviction_takes_the_oldest_copy_and_spares_a_pinned_one() {
        let (mut c, nodes) = with_pages(&[1, 2, 3]);
        backed_up(&mut c, &nodes, 100);
        // The copies were written in order: the first is the oldest.
        assert_eq!(c.clone().evict_host(1, ROOT), vec![PageId(100)]);
        // A load reads the first one: it stays, the next oldest goes.
        c.pin_host(&nodes[..1]);
        assert_eq!(c.evict_host(1, ROOT), vec![PageId(101)]);
        c.check_invariants();
    }

    #[test]
    fn host_evictable_counts_what_host_eviction_frees() {
        // Two documents sharing a first page, all backed up; one copy pinned.
        let mut c = PrefixCache::new();
        let a = c.insert(
            &[key(1), key(2), key(3)],
            &[PageId(0), PageId(1), PageId(2)],
        );
        let b = c.insert(&[key(1), key(4)], &[PageId(0), PageId(3)]);
        backed_up(&mut c, &a.nodes, 100);
        backed_up(&mut c, &b.nodes[1..], 200);
        for pinned in [None, Some(a.nodes[2]), Some(b.nodes[1])] {
            for keep in [ROOT, a.nodes[0], a.nodes[1], b.nodes[1]] {
                let mut c = c.clone();
                if let Some(p) = pinned {
                    c.pin_host(&[p]);
                }
                let n = c.host_evictable(keep);
                assert_eq!(
                    c.evict_host(usize::MAX, keep).len(),
                    n,
                    "pinned {pinned:?}, keep {keep}"
                );
            }
        }
        assert_eq!(c.host_evictable(ROOT), 4, "every copy, leaves first");
    }

    /// Write-back takes as many unbacked leaves as it was asked for pages, oldest first, each
    /// queued for its backup; no more.
    #[test]
    fn write_back_queues_exactly_the_pages_asked_for() {
        let (mut c, nodes) = with_pages(&[1, 2, 3, 4]);
        let ev = c.evict_device(2, WritePolicy::WriteBack);
        assert!(
            ev.freed.is_empty(),
            "nothing is backed up: nothing freed yet"
        );
        assert_eq!(ev.write_back, nodes[..2].to_vec());
        c.check_invariants();
    }

    /// Host eviction in rounds (a parent joins once its last backed-up child went) frees what
    /// was asked for and no more: the second round takes only what the first left to free.
    #[test]
    fn host_eviction_across_rounds_frees_no_more_than_asked() {
        let mut c = PrefixCache::new();
        // Two two-page documents: each first page is a parent until its child's copy goes.
        let x = c.insert(&[key(1), key(2)], &[PageId(0), PageId(1)]);
        let y = c.insert(&[key(3), key(4)], &[PageId(2), PageId(3)]);
        backed_up(&mut c, &x.nodes, 100);
        backed_up(&mut c, &y.nodes, 102);
        // Round one frees both leaves (2 of the 3 asked for); round two, where both parents
        // are candidates, takes one of them.
        let freed = c.evict_host(3, ROOT);
        assert_eq!(freed.len(), 3, "{freed:?}");
        let left = [x.nodes[0], y.nodes[0]]
            .iter()
            .filter(|&&n| c.node(n).host.is_some())
            .count();
        assert_eq!(left, 1, "one parent's copy stays");
        c.check_invariants();
    }

    #[test]
    fn a_backup_is_deferred_only_behind_one_in_flight() {
        let mut c = PrefixCache::new();
        let a = c.insert(&[key(1), key(2)], &[PageId(0), PageId(1)]);
        assert!(!c.backup_deferred(a.nodes[1]), "nothing in flight");
        c.begin_backup(&a.nodes[..1], &[PageId(100)]);
        assert!(
            c.backup_deferred(a.nodes[1]),
            "its parent's backup is in flight"
        );
        c.finish_backup(&a.nodes[..1], true);
        assert!(!c.backup_deferred(a.nodes[1]), "its parent is backed up");
    }

    /// A lost device: every device page comes back, the backed-up prefix stays (host-only), the
    /// rest of the tree goes, and a match then finds the host copies alone.
    #[test]
    fn forgetting_the_device_keeps_the_host_copies_alone() {
        let mut c = PrefixCache::new();
        let a = c.insert(
            &[key(1), key(2), key(3)],
            &[PageId(0), PageId(1), PageId(2)],
        );
        let b = c.insert(&[key(1), key(4)], &[PageId(0), PageId(3)]);
        backed_up(&mut c, &a.nodes[..2], 100);
        let mut freed = c.forget_device();
        freed.sort();
        assert_eq!(freed, vec![PageId(0), PageId(1), PageId(2), PageId(3)]);
        assert!(c.device_pages().is_empty());
        assert!(!c.is_live(a.nodes[2]) && !c.is_live(b.nodes[1]));
        assert_eq!(c.host_pages(), vec![PageId(100), PageId(101)]);
        let m = c.match_prefix(&[key(1), key(2), key(3)]);
        assert_eq!((m.device, m.host), (0, 2));
        c.check_invariants();
    }

    /// Host eviction's order is the order the copies were written in, not the nodes' order:
    /// backups that end one after the other are each more recent than the one before.
    #[test]
    fn host_eviction_follows_the_order_backups_ended_in() {
        let (mut c, nodes) = with_pages(&[1, 2, 3]);
        // All three begin, then end last node first: the last node's copy is the oldest.
        for (i, &n) in nodes.iter().rev().enumerate() {
            c.begin_backup(&[n], &[PageId(100 + i as u32)]);
        }
        for &n in nodes.iter().rev() {
            c.finish_backup(&[n], true);
        }
        assert_eq!(c.clone().evict_host(1, ROOT), vec![PageId(100)]);
        assert_eq!(c.evict_host(2, ROOT), vec![PageId(100), PageId(101)]);
        c.check_invariants();
    }

    /// A load's end makes its nodes' host copies the most recent: of two loads, the copy whose
    /// load ended first is evicted first, whatever the nodes' order.
    #[test]
    fn host_eviction_follows_the_order_loads_ended_in() {
        let (mut c, nodes) = with_pages(&[1, 2]);
        backed_up(&mut c, &nodes, 100);
        let freed = c.evict_device(2, WritePolicy::WriteThrough).freed;
        assert_eq!(freed.len(), 2, "both on the host alone");
        // The second node's load ends first.
        for (i, &n) in nodes.iter().rev().enumerate() {
            c.pin_host(&[n]);
            c.begin_load(&[n], &[PageId(10 + i as u32)]);
            assert!(c.finish_load(&[n], true).is_empty());
        }
        assert_eq!(c.evict_host(1, ROOT), vec![PageId(101)]);
        c.check_invariants();
    }

    /// A node written back for a device eviction gives its device page up once its backup ends.
    #[test]
    fn a_write_back_eviction_frees_the_device_page_when_its_backup_ends() {
        let (mut c, nodes) = with_pages(&[1, 2]);
        let ev = c.evict_device(1, WritePolicy::WriteBack);
        assert_eq!(ev.write_back, vec![nodes[0]]);
        c.begin_backup(&nodes[..1], &[PageId(100)]);
        assert_eq!(
            c.finish_backup(&nodes[..1], true),
            (vec![], vec![PageId(0)]),
            "the device page is freed, the host copy kept"
        );
        assert!(c.node(nodes[0]).device.is_none());
        c.check_invariants();
    }

    /// A lost device drops a path no host copy backs leaf first, even where a slot reused by
    /// the leaf gives it a lower id than its parent: nothing of the path is left.
    #[test]
    fn forgetting_the_device_drops_a_path_whose_leaf_has_the_lower_id() {
        let mut c = PrefixCache::new();
        let a = c.insert(&[key(1)], &[PageId(0)]);
        let b = c.insert(&[key(5), key(6)], &[PageId(1), PageId(2)]);
        // The oldest leaf (key 1) goes, and its slot is reused by the next node made.
        assert_eq!(
            c.evict_device(1, WritePolicy::WriteThrough).freed,
            vec![PageId(0)]
        );
        let longer = c.insert(
            &[key(5), key(6), key(7)],
            &[PageId(1), PageId(2), PageId(3)],
        );
        let leaf = longer.nodes[2];
        assert_eq!(leaf, a.nodes[0], "the slot is reused");
        assert!(
            leaf < b.nodes[1] && leaf < b.nodes[0],
            "the leaf's id is the lowest"
        );
        let mut freed = c.forget_device();
        freed.sort();
        assert_eq!(freed, vec![PageId(1), PageId(2), PageId(3)]);
        assert_eq!(c.live_nodes().count(), 0, "the whole path went");
        c.check_invariants();
    }

    #[test]
    #[should_panic(expected = "is backed up but its parent")]
    fn the_invariants_catch_a_backed_up_node_under_a_parent_that_is_not() {
        let mut c = PrefixCache::new();
        let a = c.insert(&[key(1), key(2)], &[PageId(0), PageId(1)]);
        backed_up(&mut c, &a.nodes, 100);
        // Drop the parent's host copy behind the policies' back (its device page stays).
        c.update(a.nodes[0], |n| n.host = None);
        c.check_invariants();
    }

    #[test]
    #[should_panic(expected = "is resident but its parent")]
    fn the_invariants_catch_a_resident_node_under_a_dropped_parent() {
        let mut c = PrefixCache::new();
        let a = c.insert(&[key(1), key(2)], &[PageId(0), PageId(1)]);
        backed_up(&mut c, &a.nodes[..1], 100);
        // Drop the parent's device page behind the policies' back (its host copy stays).
        c.update(a.nodes[0], |n| n.device = None);
        c.check_invariants();
    }
}

/// A load published early (mutant 6's bug, `publish_early`) puts its pages on the device at
/// once: the match finds them resident, nothing is loading, and `unpin` then ends the load.
#[test]
fn a_load_published_early_is_resident_at_once() {
    let (mut c, mut dev, keys, m) = on_the_host_alone();
    let load = dev.alloc(2).expect("room");
    c.pin_host(&m.nodes);
    c.begin_load(&m.nodes, &load);
    assert_eq!(
        c.match_prefix(&keys).nodes.len(),
        0,
        "a load in flight stops the match"
    );
    c.publish_early(&m.nodes);
    let now = c.match_prefix(&keys);
    assert_eq!((now.device, now.host), (2, 0), "published at once");
    let table: Vec<PageId> = now
        .nodes
        .iter()
        .map(|&n| c.node(n).device.unwrap())
        .collect();
    assert_eq!(table, load);
    c.unpin(&m.nodes);
    assert_eq!(c.pinned_nodes(), 0);
    c.check_invariants();
}
