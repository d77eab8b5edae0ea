//! Checking the ops of a step's layers once: [`CheckKey`], what [`check_op`](super::check_op)'s
//! verdict on an op depends on, and [`CheckMemo`], the keys of the ops a device has checked.
//!
//! The ops of one step's layers differ only in their layer (which pool buffer, which drawn
//! layer) and share their index arrays (`args::Array`, made once a step). Walking a step's
//! slots and page tables is most of what `check_op` costs, and it gives every layer the same
//! answer: a device that keeps the keys of the ops it checked takes the verdict for an op whose
//! key it holds instead of walking the arrays again. A key names an op's buffers by their size
//! and format, not by id, its regions by their size and whether they lie inside their buffer
//! (not by offset: the checks read an offset only to bound the region), and its index arrays by
//! identity: the arrays of a shared allocation
//! never change (`Array::to_mut` copies a shared one first), and a key holds each by a weak
//! reference, so that its address is not reused while the key lives.
//!
//! Only the ops whose checks walk index arrays have keys; each key's fields are taken by
//! exhaustive destructuring, so that a field added to an op does not compile until it is either
//! in the key or said not to be read by any check.

use super::op::{IndexKStore, IndexLogits, KvStore, Op, Region, SparseRead, TopK};
use super::{args, BufferDesc, BufferId, Drawn};
use crate::layout::{Bytes, LayoutFingerprint};
use std::sync::{Arc, Weak};

/// A shared array, by identity: its address and length (a weak reference keeps the address
/// from being reused while the key lives), and whether someone still holds it.
pub(crate) struct Identity {
    /// The allocation's address and length.
    pub(crate) at: (usize, usize),
    alive: Box<dyn Fn() -> bool + Send>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "array at {:#x} of {}", self.at.0, self.at.1)
    }
}

impl Identity {
    pub(crate) fn of<T: Send + Sync + 'static>(a: &Arc<[T]>) -> Identity {
        let w: Weak<[T]> = Arc::downgrade(a);
        Identity {
            at: (Arc::as_ptr(a) as *const T as usize, a.len()),
            alive: Box::new(move || w.strong_count() > 0),
        }
    }
    /// Someone still holds the array.
    pub(crate) fn alive(&self) -> bool {
        (self.alive)()
    }
}

/// The most words, buffers and arrays a key holds (`index_logits`' key is the largest today:
/// 10 words, 4 buffers, 2 arrays); `CheckKey::of` asserts them in debug builds.
const KEY_WORDS_MAX: usize = 16;
const KEY_BUFFERS_MAX: usize = 8;
const KEY_ARRAYS_MAX: usize = 4;

/// What `check_op`'s verdict on one op depends on (see the module doc). Two ops with equal keys
/// get the same verdict.
#[derive(Debug)]
pub struct CheckKey {
    kind: usize,
    /// The op's scalars, and each region's size and whether it lies inside its buffer.
    words: Vec<u64>,
    /// Each buffer the op names (its regions' and its pools'), by size and format.
    buffers: Vec<(Bytes, LayoutFingerprint)>,
    arrays: Vec<Identity>,
}

impl PartialEq for CheckKey {
    fn eq(&self, o: &CheckKey) -> bool {
        self.kind == o.kind
            && self.words == o.words
            && self.buffers == o.buffers
            && self.arrays.len() == o.arrays.len()
            && self.arrays.iter().zip(&o.arrays).all(|(a, b)| a.at == b.at)
    }
}

/// Builds one key; `None` once an array is not shared (a borrowed array has no identity).
struct Builder<'a> {
    desc: &'a dyn Fn(BufferId) -> BufferDesc,
    key: CheckKey,
    shared: bool,
}

impl Builder<'_> {
    fn word(&mut self, w: u64) -> &mut Self {
        self.key.words.push(w);
        self
    }
    fn buffer(&mut self, b: BufferId) -> &mut Self {
        let d = (self.desc)(b);
        self.key.buffers.push((d.bytes, d.fingerprint));
        self
    }
    /// A region by its size, its buffer's size and format, and whether it lies inside its
    /// buffer: the only way a check reads its offset (so that the layers' regions of one
    /// step, at other offsets of one buffer, share a key).
    fn region(&mut self, r: &Region) -> &mut Self {
        let Region {
            buffer,
            offset,
            bytes,
        } = *r;
        let size = (self.desc)(buffer).bytes;
        let inside = offset
            .0
            .checked_add(bytes.0)
            .is_some_and(|end| end <= size.0);
        self.word(bytes.0).word(inside as u64).buffer(buffer)
    }
    fn ints(&mut self, a: &args::Array<'_, i32>) -> &mut Self {
        match a.shared() {
            Some(a) => self.key.arrays.push(Identity::of(a)),
            None => self.shared = false,
        }
        self
    }
    fn shared_ints(&mut self, a: &Arc<[i32]>) -> &mut Self {
        self.key.arrays.push(Identity::of(a));
        self
    }
    /// Drawn rows: their rows and the tokens region pending rows read. No check reads the
    /// seed or the layer (they say what the device draws, not where it reads or writes).
    fn drawn(&mut self, d: &Drawn) -> &mut Self {
        let Drawn {
            seed: _,
            layer: _,
            rows,
            tokens,
        } = d;
        self.key.arrays.push(Identity::of(rows));
        match tokens {
            Some(t) => self.word(1).region(t),
            None => self.word(0),
        }
    }
}

/// One method per op kind with a key: every field, destructured.
impl Builder<'_> {
    fn index_k_store(&mut self, o: &IndexKStore) {
        let IndexKStore {
            dst,
            args:
                args::IndexKStore {
                    dtype,
                    ue8m0,
                    slots,
                },
            keys,
            gamma: _,
            beta: _,
            rope: _,
            tags: _,
        } = o;
        self.buffer(*dst).word(*dtype as u64).word(*ue8m0 as u64);
        self.ints(slots).drawn(keys);
    }
    fn kv_store(&mut self, o: &KvStore) {
        let KvStore {
            dst,
            args: args::KvStore { dtype, slots },
            rows,
            tags: _,
        } = o;
        self.buffer(*dst)
            .word(*dtype as u64)
            .ints(slots)
            .drawn(rows);
    }
    fn index_logits(&mut self, o: &IndexLogits) {
        let IndexLogits {
            args:
                args::IndexLogits {
                    dtype,
                    heads,
                    page_table,
                    pt_stride,
                    context_lens,
                    out_stride,
                },
            q,
            w,
            k,
            out,
            tags: _,
        } = o;
        self.word(*dtype as u64)
            .word(*heads as u64)
            .word(*pt_stride as u64);
        self.word(*out_stride as u64)
            .ints(page_table)
            .ints(context_lens);
        self.region(q).region(w).buffer(*k).region(out);
    }
    fn topk(&mut self, o: &TopK) {
        let TopK {
            args:
                args::TopK {
                    k,
                    stride,
                    context_lens,
                    page_table,
                    pt_stride,
                },
            logits,
            out,
        } = o;
        self.word(*k as u64)
            .word(*stride as u64)
            .word(*pt_stride as u64);
        self.ints(context_lens)
            .ints(page_table)
            .region(logits)
            .region(out);
    }
    fn sparse_read(&mut self, o: &SparseRead) {
        let SparseRead {
            args: args::SparseRead { dtype, rows, k },
            slots,
            kv,
            page_table,
            pt_stride,
            context_lens,
            out,
            tags: _,
        } = o;
        self.word(*dtype as u64).word(*rows as u64).word(*k as u64);
        self.region(slots).buffer(*kv).shared_ints(page_table);
        self.word(*pt_stride as u64)
            .shared_ints(context_lens)
            .region(out);
    }
}

impl CheckKey {
    /// The key of `op` over buffers described by `desc`, for the ops whose checks walk index
    /// arrays; `None` for the others and for an op with a borrowed array. No check reads an
    /// op's row tags (they are the oracles'), its RoPE frequencies or its LayerNorm parameters
    /// (what the device computes with, which the launcher binds).
    pub fn of(op: &Op, desc: &dyn Fn(BufferId) -> BufferDesc) -> Option<CheckKey> {
        if let Op::QPrep(_) | Op::PageCopy(_) | Op::NextTokens(_) | Op::Copy(_) = op {
            return None;
        }
        let mut b = Builder {
            desc,
            key: CheckKey {
                kind: op.kind(),
                // Room for the largest key, so that no key grows while it is built.
                words: Vec::with_capacity(KEY_WORDS_MAX),
                buffers: Vec::with_capacity(KEY_BUFFERS_MAX),
                arrays: Vec::with_capacity(KEY_ARRAYS_MAX),
            },
            shared: true,
        };
        match op {
            Op::IndexKStore(o) => b.index_k_store(o),
            Op::KvStore(o) => b.kv_store(o),
            Op::IndexLogits(o) => b.index_logits(o),
            Op::TopK(o) => b.topk(o),
            Op::SparseRead(o) => b.sparse_read(o),
            Op::QPrep(_) | Op::PageCopy(_) | Op::NextTokens(_) | Op::Copy(_) => {
                unreachable!("refused above")
            }
        }
        let k = &b.key;
        debug_assert!(
            k.words.len() <= KEY_WORDS_MAX
                && k.buffers.len() <= KEY_BUFFERS_MAX
                && k.arrays.len() <= KEY_ARRAYS_MAX,
            "a check key past its room: {} words, {} buffers, {} arrays",
            k.words.len(),
            k.buffers.len(),
            k.arrays.len()
        );
        b.shared.then_some(b.key)
    }

    /// Every array it names is still held by someone (else the key can never match again).
    fn alive(&self) -> bool {
        self.arrays.iter().all(Identity::alive)
    }
}

/// The keys of the ops a device checked and found good, while their arrays live.
#[derive(Debug, Default)]
pub struct CheckMemo {
    passed: Vec<CheckKey>,
}

/// Keys held at most: past it the memo starts again (a step's layers share a few dozen).
const MEMO_KEYS_MAX: usize = 256;

impl CheckMemo {
    /// `check_op(op, desc)`, or the verdict of an op with the same key checked before.
    pub fn check(
        &mut self,
        op: &Op,
        desc: &dyn Fn(BufferId) -> BufferDesc,
    ) -> Result<(), super::DeviceError> {
        let key = CheckKey::of(op, desc);
        if let Some(k) = &key {
            if self.passed.contains(k) {
                crate::probe::hit(crate::probe::Probe::DeviceCheckRemembered);
                // The paired assertion: the key holds everything a check reads (a check that
                // came to read a field the key leaves out fails here, with debug assertions
                // on, as in `cargo test`).
                debug_assert!(
                    super::check_op(op, desc).is_ok(),
                    "a remembered verdict the check refuses: {k:?}"
                );
                return Ok(());
            }
        }
        super::check_op(op, desc)?;
        if let Some(k) = key {
            self.passed.retain(CheckKey::alive);
            if self.passed.len() >= MEMO_KEYS_MAX {
                self.passed.clear();
            }
            self.passed.push(k);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{BufferRole, MemoryTier, RowTags};
    use crate::layout::{BufferKind, IndexKDtype, LayerId, PageFormat, PAGE_TOKENS};

    /// Buffer 0 and 1: index-K pools of two layers, `pages` pages each for buffer 0 and
    /// `pages_1` for buffer 1; buffers 2 and up: scratch of 1 MiB.
    fn descs(pages_1: u64) -> impl Fn(BufferId) -> BufferDesc {
        move |b: BufferId| {
            let fmt = PageFormat::IndexK(IndexKDtype::Fp8);
            let fp = fmt.fingerprint();
            match b.0 {
                0 | 1 => BufferDesc {
                    role: BufferRole::Pool {
                        kind: BufferKind::IndexK,
                        layer: LayerId(b.0),
                    },
                    tier: MemoryTier::Device,
                    bytes: Bytes(fp.page_bytes * if b.0 == 0 { 4 } else { pages_1 }),
                    fingerprint: fp,
                },
                _ => BufferDesc {
                    role: BufferRole::Scratch { name: "scratch" },
                    tier: MemoryTier::Device,
                    bytes: Bytes(1 << 20),
                    fingerprint: LayoutFingerprint::unpaged(1 << 20),
                },
            }
        }
    }

    fn region(buffer: u32, bytes: u64) -> Region {
        Region {
            buffer: BufferId(buffer),
            offset: Bytes::ZERO,
            bytes: Bytes(bytes),
        }
    }

    /// `topk` of one row over pool pages `table` (a context of `len` tokens).
    fn logits(k: u32, table: &Arc<[i32]>, lens: &Arc<[i32]>) -> Op {
        let heads = 4;
        Op::IndexLogits(IndexLogits {
            args: args::IndexLogits {
                dtype: IndexKDtype::Fp8,
                heads,
                page_table: table.clone().into(),
                pt_stride: table.len() as u32,
                context_lens: lens.clone().into(),
                out_stride: table.len() as u32 * PAGE_TOKENS,
            },
            q: region(2, heads as u64 * 128),
            w: region(3, heads as u64 * 4),
            k: BufferId(k),
            out: region(4, table.len() as u64 * PAGE_TOKENS as u64 * 4),
            tags: RowTags {
                layer_global: k,
                rows: Arc::from([]),
            },
        })
    }

    /// The ops of two layers over one step's arrays share a key (their pools are alike); a
    /// pool of another size, other arrays with the same contents, a borrowed array, another
    /// scalar: each its own key.
    #[test]
    fn layers_of_a_step_share_a_key_and_nothing_else_does() {
        let (table, lens): (Arc<[i32]>, Arc<[i32]>) = (Arc::from([0, 3]), Arc::from([100]));
        let desc = descs(4);
        let key = |op: &Op, desc: &dyn Fn(BufferId) -> BufferDesc| CheckKey::of(op, desc);
        let first = key(&logits(0, &table, &lens), &desc).expect("shared arrays");
        assert_eq!(Some(&first), key(&logits(1, &table, &lens), &desc).as_ref());
        assert_ne!(
            Some(&first),
            key(&logits(1, &table, &lens), &descs(3)).as_ref()
        );
        let copy: Arc<[i32]> = Arc::from(&table[..]);
        assert_ne!(Some(&first), key(&logits(0, &copy, &lens), &desc).as_ref());
        let mut other = logits(0, &table, &lens);
        if let Op::IndexLogits(o) = &mut other {
            o.args.heads = 8;
        }
        assert_ne!(Some(&first), key(&other, &desc).as_ref());
        if let Op::IndexLogits(o) = &mut other {
            o.args.page_table = args::Array::Borrowed(&[0, 3]);
        }
        assert!(key(&other, &desc).is_none(), "a borrowed array has no key");
    }

    /// The memo takes a layer's verdict from an op of the same key and checks any other op: a
    /// page past a smaller pool is refused although the same arrays passed over a larger one.
    #[test]
    fn the_memo_checks_what_it_has_not_seen() {
        let (table, lens): (Arc<[i32]>, Arc<[i32]>) = (Arc::from([0, 3]), Arc::from([100]));
        let mut memo = CheckMemo::default();
        let desc = descs(3);
        crate::probe::take();
        memo.check(&logits(0, &table, &lens), &desc)
            .expect("page 3 of 4");
        memo.check(&logits(0, &table, &lens), &desc)
            .expect("the same op");
        let hits = crate::probe::take();
        assert_eq!(hits.get("device.check_remembered"), Some(&1), "{hits:?}");
        let e = memo.check(&logits(1, &table, &lens), &desc);
        assert!(e.is_err(), "page 3 of a pool of 3 pages: {e:?}");
    }

    /// Regions at other offsets of one buffer share a key while they lie inside it; one past
    /// its end has its own key, and is refused.
    #[test]
    fn regions_are_keyed_by_size_and_whether_they_fit() {
        let (table, lens): (Arc<[i32]>, Arc<[i32]>) = (Arc::from([0, 3]), Arc::from([100]));
        let desc = descs(4);
        let at = |offset: u64| {
            let mut op = logits(0, &table, &lens);
            if let Op::IndexLogits(o) = &mut op {
                o.out.offset = Bytes(offset);
            }
            op
        };
        let key = |op: &Op| CheckKey::of(op, &desc).expect("shared arrays");
        assert_eq!(key(&at(0)), key(&at(4096)));
        let past = (1 << 20) - 256; // the output is 512 bytes
        assert_ne!(key(&at(0)), key(&at(past)));
        // An offset whose end overflows is not inside either, and not keyed as one that is.
        let wraps = u64::MAX - 100;
        assert_ne!(key(&at(0)), key(&at(wraps)));
        let mut memo = CheckMemo::default();
        memo.check(&at(0), &desc).expect("inside");
        assert!(
            memo.check(&at(past), &desc).is_err(),
            "past the buffer's end"
        );
        assert!(memo.check(&at(wraps), &desc).is_err(), "an end past u64");
    }

    /// A sparse read's key holds its scalars and its regions: reads that differ in `k`, in their
    /// rows or in their output's size have their own keys; the same read over another layer's
    /// pool shares one.
    #[test]
    fn a_sparse_reads_key_holds_its_fields() {
        use crate::layout::KvDtype;
        let (table, lens): (Arc<[i32]>, Arc<[i32]>) = (Arc::from([0, 3]), Arc::from([100]));
        let read = |kv: u32, k: u32, rows: u32, out: u64| {
            Op::SparseRead(SparseRead {
                args: args::SparseRead {
                    dtype: KvDtype::Bf16,
                    rows,
                    k,
                },
                slots: region(2, rows as u64 * k as u64 * 4),
                kv: BufferId(kv),
                page_table: table.clone(),
                pt_stride: 2,
                context_lens: lens.clone(),
                out: region(3, out),
                tags: RowTags {
                    layer_global: kv,
                    rows: Arc::from([]),
                },
            })
        };
        let desc = descs(4);
        let key = |op: &Op| CheckKey::of(op, &desc).expect("shared arrays");
        let first = key(&read(0, 4, 1, 8));
        assert_eq!(first, key(&read(1, 4, 1, 8)));
        for other in [read(0, 8, 1, 8), read(0, 4, 2, 8), read(0, 4, 1, 16)] {
            assert_ne!(first, key(&other), "{other:?}");
        }
    }

    /// An index-K store's key holds its scale format and its slots array (by identity: another
    /// allocation of the same values is another key); the same store over another layer's pool
    /// shares one.
    #[test]
    fn an_index_k_stores_key_holds_its_fields() {
        use crate::device::op::IndexKStore;
        use tierkv_kernels::cpu::draw::TokenAt;
        let slots: Arc<[i32]> = Arc::from([0, 1]);
        let other: Arc<[i32]> = Arc::from([0, 1]);
        let rows: Arc<[TokenAt]> = Arc::from(
            [TokenAt {
                token: 5,
                position: 0,
            }; 2],
        );
        let store = |dst: u32, ue8m0: bool, slots: &Arc<[i32]>| {
            Op::IndexKStore(IndexKStore {
                dst: BufferId(dst),
                args: args::IndexKStore {
                    dtype: IndexKDtype::Fp8,
                    ue8m0,
                    slots: slots.clone().into(),
                },
                keys: Drawn {
                    seed: 1,
                    layer: dst,
                    rows: rows.clone(),
                    tokens: None,
                },
                gamma: Arc::from([1.0; 128]),
                beta: Arc::from([0.0; 128]),
                rope: crate::device::Rope::new(&tierkv_kernels::rope::RopeParams::deepseek_v32(
                    4096,
                )),
                tags: RowTags {
                    layer_global: dst,
                    rows: Arc::from([]),
                },
            })
        };
        let desc = descs(4);
        let key = |op: &Op| CheckKey::of(op, &desc).expect("shared arrays");
        let first = key(&store(0, false, &slots));
        assert_eq!(first, key(&store(1, false, &slots)));
        assert_ne!(first, key(&store(0, true, &slots)));
        assert_ne!(first, key(&store(0, false, &other)));
    }

    /// A key whose arrays nobody holds any more is dropped at the next insertion.
    #[test]
    fn keys_of_dropped_arrays_go() {
        let mut memo = CheckMemo::default();
        let desc = descs(4);
        for _ in 0..3 {
            let (table, lens): (Arc<[i32]>, Arc<[i32]>) = (Arc::from([0, 3]), Arc::from([100]));
            memo.check(&logits(0, &table, &lens), &desc)
                .expect("good op");
        }
        assert_eq!(memo.passed.len(), 1, "{:?}", memo.passed);
    }

    /// A key whose arrays are still held stays through the insertion of another: its op is
    /// remembered after another op's check.
    #[test]
    fn keys_of_held_arrays_stay() {
        let mut memo = CheckMemo::default();
        let desc = descs(4);
        let (table, lens): (Arc<[i32]>, Arc<[i32]>) = (Arc::from([0, 3]), Arc::from([100]));
        let other: Arc<[i32]> = Arc::from([1, 2]);
        crate::probe::take();
        memo.check(&logits(0, &table, &lens), &desc)
            .expect("good op");
        memo.check(&logits(0, &other, &lens), &desc)
            .expect("another good op");
        memo.check(&logits(0, &table, &lens), &desc)
            .expect("the first again");
        assert_eq!(memo.passed.len(), 2, "{:?}", memo.passed);
        let hits = crate::probe::take();
        assert_eq!(hits.get("device.check_remembered"), Some(&1), "{hits:?}");
    }
}
