//! Undeclared accesses: bytes an op touched outside the ranges it declared (`Op::accesses`). The
//! race detector and the content oracle see an op only through its declarations, so an op that
//! reads or writes elsewhere escapes both.
//!
//! Writes: this check compares, around each op, a shadow copy of the bytes near its declared
//! writes with what the op left there.
//!
//! Reads ([`ReadProbe`]): for one op in [`FULL_EVERY`] and the first [`FIRST_OF_KIND`] ops of each
//! kind, the op runs a second time from the same
//! state with the bytes next to its declared reads changed (the page on each side of a paged
//! read, `MARGIN_BYTES` on each side of another, minus everything it declares); if its output
//! differs, it read some of them. The op's CPU reference reads through no checked view of its
//! own — this reruns it — so a read is found when it changes the output, which is when it
//! matters. Its declared writes and the changed bytes are left as the first run left them (an
//! op that also writes outside its declarations keeps the second run's stray bytes there; the
//! write check reports it either way). The pages "beside" a paged read are the neighbouring
//! `page_bytes` of the buffer, which is the neighbouring page in the device pools; in a host
//! mirror of another order they may be another layer's bytes.
//!
//! What it compares: for every buffer the op declares a write to, the pages its writes touch and
//! one page on each side (for scratch buffers, 4 KiB on each side of the written span); and for
//! one op in [`FULL_EVERY`] (by op id, so a seed always checks the same ops), the whole buffer. A
//! stray write next to the declared rows is caught at once; one far away is caught when a whole-
//! buffer check lands on it. The cost is a copy and a comparison of the checked bytes.

use std::ops::Range;
use tierkv_engine::cpu_device::Memory;
use tierkv_engine::device::{BufferId, ByteRange, Op};

/// One op in this many (by op id) has every byte of its written buffers compared.
pub const FULL_EVERY: u64 = 8;

/// The first ops of each kind in a run whose reads are all probed.
pub const FIRST_OF_KIND: u32 = 4;

/// Bytes on each side of a non-paged write that are compared.
const MARGIN_BYTES: usize = 4096;

/// The bytes of one buffer an op may not change, as they were before it ran.
pub struct Shadow {
    buffer: BufferId,
    /// Checked spans of the buffer, each with where its bytes before the op are in the arena.
    spans: Vec<(Range<usize>, Range<usize>)>,
    /// What the op declared it writes there (sorted, merged).
    allowed: Vec<Range<usize>>,
}

/// Bytes an op changed outside its declared writes: the buffer and the first such span.
pub struct Stray {
    pub buffer: BufferId,
    pub bytes: Range<usize>,
}

/// The accesses' byte ranges, grouped by buffer (in order of first appearance).
fn by_buffer<'a>(
    accesses: impl Iterator<Item = &'a tierkv_engine::device::Access>,
) -> Vec<(BufferId, Vec<Range<usize>>)> {
    let mut out: Vec<(BufferId, Vec<Range<usize>>)> = Vec::new();
    for a in accesses {
        let r = a.range.span();
        match out.iter_mut().find(|(b, _)| *b == a.range.buffer) {
            Some((_, v)) => v.push(r),
            None => out.push((a.range.buffer, vec![r])),
        }
    }
    out
}

/// Sorted, merged ranges.
fn merged(mut v: Vec<Range<usize>>) -> Vec<Range<usize>> {
    v.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Copies what `op` (number `op_id`) must leave alone, before it runs, into `arena` (cleared
/// first; the caller keeps it from op to op, so the copies of whole buffers cost no fresh
/// allocation and no page faults).
pub fn before(op: &Op, op_id: u64, mem: &Memory, arena: &mut Vec<u8>) -> Vec<Shadow> {
    arena.clear();
    let full = op_id % FULL_EVERY == 0;
    by_buffer(op.accesses().iter().filter(|a| a.write))
        .into_iter()
        .map(|(buffer, writes)| {
            let allowed = merged(writes);
            let len = mem.bytes(buffer).len();
            let fp = mem.desc(buffer).fingerprint;
            let checked = if full {
                std::iter::once(0..len).collect()
            } else if fp.is_paged() {
                let pb = fp.page_bytes.max(1) as usize;
                merged(
                    allowed
                        .iter()
                        .map(|r| {
                            let first = (r.start / pb).saturating_sub(1);
                            let last = r.end.div_ceil(pb) + 1;
                            // A write declared past the buffer (an op whose arrays the device
                            // read as garbage) is the executor's to refuse, not this copy's.
                            (first * pb).min(len)..(last * pb).min(len)
                        })
                        .collect(),
                )
            } else {
                merged(
                    allowed
                        .iter()
                        .map(|r| {
                            let end = r.end.saturating_add(MARGIN_BYTES).min(len);
                            r.start.saturating_sub(MARGIN_BYTES).min(end)..end
                        })
                        .collect(),
                )
            };
            let spans = checked
                .into_iter()
                .map(|r| {
                    let at = arena.len();
                    arena.extend_from_slice(&mem.bytes(buffer)[r.clone()]);
                    (r, at..arena.len())
                })
                .collect();
            Shadow {
                buffer,
                spans,
                allowed,
            }
        })
        .collect()
}

/// The first bytes the op changed outside its declared writes, if any (`arena` as `before` left
/// it).
pub fn after(shadows: &[Shadow], mem: &Memory, arena: &[u8]) -> Option<Stray> {
    for s in shadows {
        let now = mem.bytes(s.buffer);
        for (span, kept) in &s.spans {
            let was = &arena[kept.clone()];
            // The gaps between the declared writes inside this span (both lists are sorted).
            let first = s.allowed.partition_point(|w| w.end <= span.start);
            let mut at = span.start;
            let mut gaps = Vec::new();
            for w in s.allowed[first..].iter().take_while(|w| w.start < span.end) {
                if w.start > at {
                    gaps.push(at..w.start);
                }
                at = at.max(w.end);
            }
            if at < span.end {
                gaps.push(at..span.end);
            }
            for g in gaps {
                let old = &was[g.start - span.start..g.end - span.start];
                if now[g.clone()] == *old {
                    continue;
                }
                let from = (g.start..g.end)
                    .find(|&i| now[i] != was[i - span.start])
                    .expect("a differing byte");
                let to = (from..g.end)
                    .take_while(|&i| now[i] != was[i - span.start])
                    .last()
                    .unwrap_or(from);
                return Some(Stray {
                    buffer: s.buffer,
                    bytes: from..to + 1,
                });
            }
        }
    }
    None
}

/// `span` without the parts `declared` (sorted, merged) covers.
fn subtract(span: Range<usize>, declared: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut at = span.start;
    for d in declared {
        if d.end <= at || d.start >= span.end {
            continue;
        }
        if d.start > at {
            out.push(at..d.start);
        }
        at = at.max(d.end);
    }
    if at < span.end {
        out.push(at..span.end);
    }
    out
}

/// Undeclared reads of one op (see the module comment): what the op's writes held before it
/// ran, and the undeclared bytes beside its reads that the second run changes.
pub struct ReadProbe {
    writes: Vec<(ByteRange, Vec<u8>)>,
    beside: Vec<(BufferId, Range<usize>)>,
}

/// What an op read that it did not declare: the buffers whose undeclared bytes were changed for
/// the second run, and the first output byte that then differed.
pub struct StrayRead {
    pub changed: Vec<BufferId>,
    pub output: (BufferId, usize),
}

impl ReadProbe {
    /// Whether op number `op_id` is probed, when ops of its kind were probed `kind_probed`
    /// times before in the run: one op in [`FULL_EVERY`], and the first [`FIRST_OF_KIND`] of
    /// each kind (so that every kind is probed in the first steps of a run, before its outputs
    /// reach the other oracles).
    pub fn sampled(op_id: u64, kind_probed: u32) -> bool {
        op_id % FULL_EVERY == FULL_EVERY / 2 || kind_probed < FIRST_OF_KIND
    }

    /// Before `op` runs: `None` for ops that write nothing (there is no output to compare) or
    /// read nothing that has undeclared bytes beside it.
    pub fn before(op: &Op, mem: &Memory) -> Option<ReadProbe> {
        let accesses = op.accesses();
        // An op declaring bytes past a buffer (its arrays read as garbage on the device) is the
        // executor's to refuse; nothing is probed.
        if accesses
            .iter()
            .any(|a| a.range.span().end > mem.bytes(a.range.buffer).len())
        {
            return None;
        }
        let writes: Vec<(ByteRange, Vec<u8>)> = accesses
            .iter()
            .filter(|a| a.write)
            .map(|a| (a.range, mem.range(a.range).to_vec()))
            .collect();
        if writes.is_empty() {
            return None;
        }
        let declared = by_buffer(accesses.iter());
        let mut beside = Vec::new();
        for (buffer, ranges) in declared {
            let reads: Vec<Range<usize>> = accesses
                .iter()
                .filter(|a| !a.write && a.range.buffer == buffer)
                .map(|a| a.range.span())
                .collect();
            let all = merged(ranges);
            let len = mem.bytes(buffer).len();
            let fp = mem.desc(buffer).fingerprint;
            let near: Vec<Range<usize>> = reads
                .iter()
                .flat_map(|r| {
                    let (lo, hi) = if fp.is_paged() {
                        let pb = fp.page_bytes.max(1) as usize;
                        let first = r.start / pb * pb;
                        let last = r.end.div_ceil(pb) * pb;
                        (
                            first.saturating_sub(pb)..first,
                            last.min(len)..(last + pb).min(len),
                        )
                    } else {
                        (
                            r.start.saturating_sub(MARGIN_BYTES)..r.start,
                            r.end..(r.end + MARGIN_BYTES).min(len),
                        )
                    };
                    [lo, hi]
                })
                .collect();
            for span in merged(near) {
                beside.extend(subtract(span, &all).into_iter().map(|r| (buffer, r)));
            }
        }
        (!beside.is_empty()).then_some(ReadProbe { writes, beside })
    }

    /// After the op's first run: runs it again (`run`) from the state it started in, with the
    /// bytes beside its reads changed, and compares the outputs; then puts the memory back as
    /// the first run left it.
    pub fn after(
        self,
        op: &Op,
        mem: &mut Memory,
        run: impl FnOnce(&Op, &mut Memory),
    ) -> Option<StrayRead> {
        let first: Vec<Vec<u8>> = self
            .writes
            .iter()
            .map(|(r, _)| mem.range(*r).to_vec())
            .collect();
        for (r, was) in &self.writes {
            mem.range_mut(*r).copy_from_slice(was);
        }
        let kept: Vec<Vec<u8>> = self
            .beside
            .iter()
            .map(|(b, r)| {
                let bytes = &mut mem.bufs[b.0 as usize][r.clone()];
                let old = bytes.to_vec();
                for (i, x) in bytes.iter_mut().enumerate() {
                    *x = !*x ^ (i as u8).wrapping_mul(37);
                }
                old
            })
            .collect();
        run(op, mem);
        let mut stray = None;
        for ((r, _), out) in self.writes.iter().zip(&first) {
            let again = mem.range(*r);
            if stray.is_none() && again != out.as_slice() {
                let i = again
                    .iter()
                    .zip(out)
                    .position(|(a, b)| a != b)
                    .expect("outputs that differ have a differing byte");
                let at = r.start.0 as usize + i;
                let mut changed: Vec<BufferId> = self.beside.iter().map(|(b, _)| *b).collect();
                changed.dedup();
                stray = Some(StrayRead {
                    changed,
                    output: (r.buffer, at),
                });
            }
        }
        for ((b, r), old) in self.beside.iter().zip(kept) {
            mem.bufs[b.0 as usize][r.clone()].copy_from_slice(&old);
        }
        for ((r, _), out) in self.writes.iter().zip(first) {
            mem.range_mut(*r).copy_from_slice(&out);
        }
        stray
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_joins_overlaps_and_neighbours() {
        assert_eq!(merged(vec![5..7, 0..2, 1..3, 7..9]), vec![0..3, 5..9]);
        assert_eq!(merged(vec![]), Vec::<Range<usize>>::new());
    }

    /// A shadow over 0..32 allowing 8..16: a change inside is declared, one beside it is not.
    #[test]
    fn changes_outside_the_declared_writes_are_found() {
        use tierkv_engine::device::{BufferDesc, BufferRole, MemoryTier};
        use tierkv_engine::layout::{Bytes, LayoutFingerprint};
        let mut mem = Memory::default();
        let b = mem.alloc(BufferDesc {
            role: BufferRole::Scratch { name: "test" },
            tier: MemoryTier::Device,
            bytes: Bytes(32),
            fingerprint: LayoutFingerprint::unpaged(32),
        });
        let shadow = |mem: &Memory, arena: &mut Vec<u8>| {
            arena.clear();
            arena.extend_from_slice(mem.bytes(b));
            Shadow {
                buffer: b,
                spans: vec![(0..32, 0..32)],
                allowed: std::iter::once(8..16).collect(),
            }
        };
        let mut arena = Vec::new();
        let s = shadow(&mem, &mut arena);
        mem.bufs[b.0 as usize][10] ^= 1;
        assert!(after(&[s], &mem, &arena).is_none(), "a declared write");
        let s = shadow(&mem, &mut arena);
        mem.bufs[b.0 as usize][16] ^= 1;
        mem.bufs[b.0 as usize][17] ^= 1;
        let stray = after(&[s], &mem, &arena).expect("an undeclared write");
        assert_eq!(stray.bytes, 16..18);
    }
}
