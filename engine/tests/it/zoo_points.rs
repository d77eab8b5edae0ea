//! With the `mutants` feature (the bug zoo's build): the engine's zoo points act where they
//! should, and only with their mutant (a point that acted elsewhere would plant another bug,
//! which the zoo's campaigns could still catch, for the wrong reason).

use tierkv_engine::cache::{PageKey, PrefixCache};
use tierkv_engine::config::WritePolicy;
use tierkv_engine::cpu_device::{InOrderDevice, ManualClock};
use tierkv_engine::device::BufferRole;
use tierkv_engine::layout::BufferKind;
use tierkv_engine::mutants::{Mutant, Mutants};
use tierkv_engine::pools::PageAllocator;
use tierkv_engine::{Config, Engine, EngineOptions, RequestSpec};

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

/// Whether a backup wrote the host mirror of `kind`: its bytes changed while a 300-token prompt
/// ran under write-through with `mutants` (its four full pages backed up).
fn mirrored(mutants: Mutants, kind: BufferKind) -> bool {
    let cfg = Config::preset("sim-small").expect("preset");
    let options = EngineOptions {
        mutants,
        ..EngineOptions::default()
    };
    let mut e =
        Engine::new(cfg, InOrderDevice::new(), ManualClock::default(), options).expect("an engine");
    let mirror = e
        .dev
        .buffers_of(kind)
        .into_iter()
        .find(|&b| matches!(e.dev.mem.desc(b).role, BufferRole::Mirror { .. }))
        .expect("a host mirror");
    let before = e.dev.mem.bytes(mirror).to_vec();
    let s = e.synth;
    e.submit(RequestSpec {
        prompt: (0..300u64).map(|i| s.token(3, i)).collect(),
        max_new_tokens: 1,
    })
    .expect("accepted");
    for _ in 0..100 {
        if e.step().expect("step").idle {
            break;
        }
    }
    assert!(e.metrics.backups > 0, "{:?}", e.metrics);
    e.dev.mem.bytes(mirror) != before.as_slice()
}

/// Mutant 3 leaves the index-K pages out of a backup, and the KV pages in; the clean engine
/// backs both up. (Mutant 29 skips the same on a load, through the same branch.)
#[test]
fn a_backup_without_index_k_copies_the_kv_pages() {
    let clean = Mutants::none();
    assert!(mirrored(clean, BufferKind::Kv));
    assert!(mirrored(clean, BufferKind::IndexK));
    let skips = Mutants::only(Mutant::IndexKNotMirrored);
    assert!(
        mirrored(skips, BufferKind::Kv),
        "the KV pages were left out"
    );
    assert!(
        !mirrored(skips, BufferKind::IndexK),
        "the index-K pages were backed up"
    );
}
