//! A trace replayed through the prefix cache's logic alone, with no device and no bytes: each
//! request matches its prefix, locks it, takes device pages for the rest (evicting least recently
//! used leaves when the device tier is full), loads its host-only prefix, inserts its pages and
//! backs them up (write-through; when the host tier is full, its least recently used copies are
//! evicted as the engine's controller does, or the backup is skipped when that cannot make room).
//! The same sequence of calls the engine makes at admission, with the copies completing at once.
//!
//! The trace test compares its hits with computations written apart from the cache, and
//! `tierkv bench --cache` times it over a whole trace.

use super::{TraceRecord, BLOCK_TOKENS};
use crate::cache::{PageKey, PrefixCache};
use crate::config::WritePolicy;
use crate::layout::PAGE_TOKENS;
use crate::pools::PageAllocator;
use crate::synth::Synth;

/// The full pages of a record's prompt (its partial last page is not cached).
pub fn full_pages(rec: &TraceRecord) -> usize {
    (rec.input_length / PAGE_TOKENS) as usize
}

/// The full pages of a record's prompt as page keys: `page_keys(prompt_tokens(..))`, made without
/// the intermediate token vector.
pub fn prompt_page_keys(rec: &TraceRecord, synth: &Synth) -> Vec<PageKey> {
    let pages = full_pages(rec);
    let per_block = (BLOCK_TOKENS / PAGE_TOKENS) as usize;
    (0..pages)
        .map(|p| {
            let block = rec.hash_ids[p / per_block];
            let first = ((p % per_block) * PAGE_TOKENS as usize) as u64;
            let mut key = [0u32; PAGE_TOKENS as usize];
            for (i, t) in key.iter_mut().enumerate() {
                *t = synth.token(block, first + i as u64);
            }
            key
        })
        .collect()
}

/// A request the replay cannot serve.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CacheReplayError {
    #[error(
        "a request of {pages} full pages does not fit a device tier of {device_pages} pages \
         (give a larger device tier)"
    )]
    RequestTooLarge { pages: usize, device_pages: u32 },
}

/// Pages a request found in each tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hits {
    pub device: u64,
    pub host: u64,
}

/// The prefix cache with a finite device tier and a write-through host tier, fed one request's
/// page keys at a time.
pub struct CacheReplay {
    cache: PrefixCache,
    device: PageAllocator,
    host: PageAllocator,
    /// Device pages given back by eviction so far.
    pub evicted: u64,
    /// Calls of `evict_device` so far.
    pub evictions: u64,
    /// Host pages given back by host eviction so far.
    pub host_evicted: u64,
    /// Backups skipped because the host tier could not make room.
    pub backups_skipped: u64,
}

impl CacheReplay {
    pub fn new(device_pages: u32, host_pages: u32) -> CacheReplay {
        CacheReplay {
            cache: PrefixCache::new(),
            device: PageAllocator::new(device_pages),
            host: PageAllocator::new(host_pages),
            evicted: 0,
            evictions: 0,
            host_evicted: 0,
            backups_skipped: 0,
        }
    }

    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Serves one request: what it hit in each tier. Checks before it changes anything, so a
    /// refused request leaves the cache as it was.
    pub fn request(&mut self, keys: &[PageKey]) -> Result<Hits, CacheReplayError> {
        if keys.len() > self.device.capacity() as usize {
            return Err(CacheReplayError::RequestTooLarge {
                pages: keys.len(),
                device_pages: self.device.capacity(),
            });
        }
        let cache = &mut self.cache;
        let m = cache.match_prefix(keys);
        cache.touch(&m.nodes);
        // The request holds its matched device pages and takes fresh ones for the rest (its host
        // hits are loaded into fresh pages; here the load completes at once).
        cache.lock(&m.nodes);
        let need = keys.len() - m.device;
        let pages = loop {
            if let Some(p) = self.device.alloc(need) {
                break p;
            }
            let short = need - self.device.free_count() as usize;
            let ev = cache.evict_device(short, WritePolicy::WriteThrough);
            // Everything but this request's locked path can go, and the path fits the tier.
            assert!(!ev.freed.is_empty(), "the device tier cannot make room");
            self.evictions += 1;
            self.evicted += ev.freed.len() as u64;
            self.device.free(&ev.freed);
        };
        let host_part = &m.nodes[m.device..];
        cache.pin_host(host_part);
        cache.begin_load(host_part, &pages[..m.host]);
        let unpublished = cache.finish_load(host_part, true);
        assert!(
            unpublished.is_empty(),
            "a completed load published its pages"
        );
        // The page table: the device hits' pages, then the fresh pages (the loaded ones first,
        // which their nodes now hold, then the new ones).
        let mut table: Vec<_> = m.nodes[..m.device]
            .iter()
            .map(|&n| cache.node(n).device.expect("a device hit is resident"))
            .collect();
        table.extend_from_slice(&pages);
        let ins = cache.insert(keys, &table);
        self.device.free(&ins.duplicates);
        cache.unlock(&m.nodes);
        if let Some(&last) = ins.nodes.last() {
            let path = cache.needs_backup(last);
            if !path.is_empty() {
                let hp = self.host.alloc(path.len()).or_else(|| {
                    // As the controller does: evict host copies when that makes room without
                    // dropping the path's own ancestors.
                    let want = path.len() - self.host.free_count() as usize;
                    let keep = cache.node(path[0]).parent;
                    if cache.host_evictable(keep) < want {
                        return None;
                    }
                    let freed = cache.evict_host(want, keep);
                    self.host_evicted += freed.len() as u64;
                    self.host.free(&freed);
                    self.host.alloc(path.len())
                });
                match hp {
                    Some(hp) => {
                        cache.begin_backup(&path, &hp);
                        let (host_free, device_free) = cache.finish_backup(&path, true);
                        assert!(host_free.is_empty() && device_free.is_empty());
                    }
                    None => self.backups_skipped += 1,
                }
            }
        }
        Ok(Hits {
            device: m.device as u64,
            host: m.host as u64,
        })
    }
}
