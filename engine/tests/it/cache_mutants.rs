//! With the `mutants` feature (the bug zoo's build): a prefix cache built with a zoo mutant
//! follows it, and one built without any does not.

use tierkv_engine::cache::{PageKey, PrefixCache};
use tierkv_engine::config::WritePolicy;
use tierkv_engine::mutants::{Mutant, Mutants};
use tierkv_engine::pools::PageAllocator;

/// Device eviction under a cache of two three-page documents, `a` inserted first.
fn evicted_first(mut cache: PrefixCache) -> Vec<u32> {
    let mut pages = PageAllocator::new(16);
    for k in [[1u32, 2, 3], [4, 5, 6]] {
        let keys: Vec<PageKey> = k.iter().map(|&k| [k; 64]).collect();
        let table = pages.alloc(keys.len()).expect("room");
        assert!(cache.insert(&keys, &table).duplicates.is_empty());
    }
    let freed = cache.evict_device(1, WritePolicy::WriteThrough).freed;
    freed.iter().map(|p| p.0).collect()
}

#[test]
fn a_cache_follows_the_mutant_it_was_built_with() {
    // Clean: the least recently used leaf, `a`'s last page (page 2); mutant 21: the most
    // recently used, `b`'s last page (page 5).
    assert_eq!(evicted_first(PrefixCache::new()), [2]);
    assert_eq!(
        evicted_first(PrefixCache::with_mutants(Mutants::none())),
        [2]
    );
    let newest = PrefixCache::with_mutants(Mutants::only(Mutant::DeviceEvictsNewest));
    assert_eq!(evicted_first(newest), [5]);
}
