//! The prefix cache's locks: what `locked_nodes` counts, and a lock released unused
//! (`unlock_unused`, a reservation that found no room) frees the nodes for eviction and leaves
//! their eviction order as it was.

use tierkv_engine::cache::{PageKey, PrefixCache};
use tierkv_engine::config::WritePolicy;
use tierkv_engine::pools::PageAllocator;

fn keys(ids: &[u32]) -> Vec<PageKey> {
    ids.iter().map(|&k| [k; 64]).collect()
}

/// Two documents of three pages each, inserted `a` first: `a`'s pages are the least recently
/// used.
fn two_documents() -> (PrefixCache, Vec<PageKey>, Vec<PageKey>) {
    let mut cache = PrefixCache::new();
    let mut pages = PageAllocator::new(16);
    let (a, b) = (keys(&[1, 2, 3]), keys(&[4, 5, 6]));
    for k in [&a, &b] {
        let table = pages.alloc(k.len()).expect("room");
        assert!(cache.insert(k, &table).duplicates.is_empty());
    }
    (cache, a, b)
}

#[test]
fn a_lock_released_unused_frees_the_nodes_and_keeps_their_order() {
    let (mut cache, a, _) = two_documents();
    // The order device eviction takes with no lock held: `a`'s three pages first.
    let mut plain = cache.clone();
    let order = plain.evict_device(6, WritePolicy::WriteThrough).freed;
    assert_eq!(order.len(), 6);
    let m = cache.match_prefix(&a);
    assert_eq!(m.device, 3);
    cache.lock(&m.nodes);
    assert_eq!(cache.locked_nodes(), 3, "a match's three nodes locked");
    let held = cache
        .clone()
        .evict_device(6, WritePolicy::WriteThrough)
        .freed;
    assert_eq!(held, order[3..], "locked nodes are not evicted");
    cache.unlock_unused(&m.nodes);
    assert_eq!(cache.locked_nodes(), 0, "the unused lock released");
    let after = cache.evict_device(6, WritePolicy::WriteThrough).freed;
    assert_eq!(
        after, order,
        "an unused lock leaves the eviction order as it was"
    );
}

#[test]
fn a_lock_released_after_use_makes_the_nodes_most_recently_used() {
    let (mut cache, a, b) = two_documents();
    let m = cache.match_prefix(&a);
    cache.lock(&m.nodes);
    cache.unlock(&m.nodes);
    assert_eq!(cache.locked_nodes(), 0);
    assert_eq!(
        cache.evict_device(3, WritePolicy::WriteThrough).freed.len(),
        3
    );
    assert_eq!(cache.match_prefix(&a).device, 3, "`a`, used last, is kept");
    assert_eq!(cache.match_prefix(&b).device, 0, "`b` is evicted first");
}

/// An insert is a use: a document inserted again (its nodes resident, the request's pages
/// duplicates) becomes the most recently used, so device eviction takes the other one first,
/// though its nodes are newer.
#[test]
fn inserting_a_document_again_makes_it_the_most_recently_used() {
    let (mut cache, a, b) = two_documents();
    // Pages of its own (past the six the documents hold), as a second request's would be.
    let mut other = PageAllocator::new(16);
    other.alloc(6).expect("room");
    let again = other.alloc(a.len()).expect("room");
    let dup = cache.insert(&a, &again).duplicates;
    assert_eq!(dup.len(), a.len(), "every page of `a` a duplicate");
    let first = cache.evict_device(3, WritePolicy::WriteThrough).freed;
    let b_pages: Vec<u32> = (3..6).collect();
    let mut got: Vec<u32> = first.iter().map(|p| p.0).collect();
    got.sort();
    assert_eq!(got, b_pages, "`b` ({b:?}) goes first");
}

/// A node's slot reused by another node has another generation (what the controller compares
/// before it retries a deferred backup of the first one).
#[test]
fn a_reused_node_slot_has_a_new_generation() {
    let mut cache = PrefixCache::new();
    let mut pages = PageAllocator::new(16);
    let a = keys(&[1]);
    let table = pages.alloc(1).expect("room");
    cache.insert(&a, &table);
    let first = cache.match_prefix(&a).nodes[0];
    let generation = cache.generation(first);
    let freed = cache.evict_device(1, WritePolicy::WriteThrough).freed;
    assert_eq!(freed, table, "the node deleted with its page");
    assert!(!cache.is_live(first));
    let b = keys(&[2]);
    let table = pages.alloc(1).expect("room");
    cache.insert(&b, &table);
    let second = cache.match_prefix(&b).nodes[0];
    assert_eq!(second, first, "the slot reused");
    assert!(cache.is_live(second));
    assert_ne!(cache.generation(second), generation);
}
