//! The one layout module: every byte size and offset of every buffer tierkv touches.
//!
//! This module owns the byte layouts of DESIGN §3 — index-K pages (fp8 and bf16), MLA KV rows (bf16
//! and packed fp8), the per-layer device buffers, the pinned-host mirror in `layer_first` and
//! `page_first` order, and the slot ↔ (page, offset) mapping. Nothing the engine, the references
//! or the CUDA launchers run multiplies an element count by a dtype size: buffer-size mismatches
//! are born exactly there (DESIGN §1, incidents 1 and 4, upstream #37534), so there is one place
//! where such a product is written for them. The specification (`spec::format`) writes the
//! products again, apart, to check this module.
//!
//! A [`Layout`] is built once, from the validated configuration, with every product checked for u64
//! overflow; after construction its accessors cannot overflow, because every value they return is
//! bounded by a total that was checked. Host and device pools are built from the same `Layout`
//! value, and a copy between two buffers requires their [`LayoutFingerprint`]s to be equal.
//!
//! It lives in `tierkv-kernels` because the kernels' CPU references are written against these byte
//! layouts and the kernels crate sits below the engine; `tierkv_engine::layout` re-exports it.

use serde::Serialize;
use std::fmt;

/// Tokens per page. The DeepGEMM/SGLang paged layouts fix this at 64; tierkv never changes it.
pub const PAGE_TOKENS: u32 = 64;
/// Values per index key (DeepSeek's `index_head_dim`), also the Hadamard transform's size.
pub const INDEX_HEAD_DIM: u32 = 128;
/// Values that share one fp8 scale.
pub const QUANT_BLOCK: u32 = 128;
/// MLA latent (`kv_lora_rank`) values per KV row.
pub const KV_LORA_RANK: u32 = 512;
/// MLA RoPE values per KV row (`qk_rope_head_dim`); also how many leading index-key dims get RoPE.
pub const ROPE_DIM: u32 = 64;
/// Values per MLA KV row.
pub const KV_ROW_VALUES: u32 = KV_LORA_RANK + ROPE_DIM;
/// The most heads the indexer kernels accept (DeepSeek-V3.2 uses 64).
pub const INDEX_HEADS_MAX: u32 = 64;
/// The largest `index_topk` the top-k kernel supports.
pub const INDEX_TOPK_MAX: u32 = 2048;

const FP32_BYTES: u64 = 4;
const BF16_BYTES: u64 = 2;
const FP8_BYTES: u64 = 1;

// The layout constants of DESIGN §3, asserted at compile time so that a slip here cannot build.
const _: () = assert!(INDEX_HEAD_DIM % QUANT_BLOCK == 0);
const _: () = assert!(KV_LORA_RANK % QUANT_BLOCK == 0);
const _: () = assert!(index_k_token_bytes_of(IndexKDtype::Fp8) == 132);
const _: () = assert!(index_k_token_bytes_of(IndexKDtype::Bf16) == 256);
const _: () = assert!(index_k_token_bytes_of(IndexKDtype::Fp8) * PAGE_TOKENS as u64 == 8448);
const _: () = assert!(index_k_token_bytes_of(IndexKDtype::Bf16) * PAGE_TOKENS as u64 == 16384);
const _: () = assert!(kv_token_bytes_of(KvDtype::Bf16) == 1152);
const _: () = assert!(kv_token_bytes_of(KvDtype::Fp8Packed) == 656);
const _: () = assert!(kv_token_bytes_of(KvDtype::Fp8Unpacked) == 576);

/// Index-K cache element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexKDtype {
    /// 128 e4m3fn values and one fp32 scale per token: 132 B/token.
    Fp8,
    /// 128 bf16 values per token, no scale: 256 B/token.
    Bf16,
}

/// MLA KV cache element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    /// 576 bf16 values: 1152 B/token.
    Bf16,
    /// 512 e4m3fn latent values, 4 fp32 tile scales, 64 bf16 RoPE values: 656 B/token.
    Fp8Packed,
    /// 576 e4m3 values without tile scales: 576 B/token. A foreign row format that tierkv never
    /// stores (no configuration names it, no kernel accepts it); it exists so that a mirror sized
    /// for it — upstream #37534, a 576 B host row behind a 656 B device row — can be described,
    /// and refused by the fingerprint check.
    Fp8Unpacked,
}

/// Order of the pinned-host mirror.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostLayout {
    /// `[layer][page][page_bytes]`: one layer's pages are contiguous.
    LayerFirst,
    /// `[page][layer][page_bytes]`: one page's layers are contiguous.
    PageFirst,
}

impl IndexKDtype {
    pub const ALL: [IndexKDtype; 2] = [IndexKDtype::Fp8, IndexKDtype::Bf16];
    pub const NAMES: &'static [&'static str] = &["fp8", "bf16"];
    pub fn name(self) -> &'static str {
        match self {
            IndexKDtype::Fp8 => "fp8",
            IndexKDtype::Bf16 => "bf16",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl KvDtype {
    /// The formats tierkv stores.
    pub const ALL: [KvDtype; 2] = [KvDtype::Bf16, KvDtype::Fp8Packed];
    pub const NAMES: &'static [&'static str] = &["bf16", "fp8_packed"];
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8Packed => "fp8_packed",
            KvDtype::Fp8Unpacked => "fp8_unpacked",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl HostLayout {
    pub const ALL: [HostLayout; 2] = [HostLayout::LayerFirst, HostLayout::PageFirst];
    pub const NAMES: &'static [&'static str] = &["layer_first", "page_first"];
    pub fn name(self) -> &'static str {
        match self {
            HostLayout::LayerFirst => "layer_first",
            HostLayout::PageFirst => "page_first",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == s)
    }
}

macro_rules! newtype {
    ($(#[$m:meta])* $name:ident($inner:ty)) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize)]
        pub struct $name(pub $inner);
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

newtype!(
    /// A page of a pool (device or host), `PAGE_TOKENS` tokens.
    PageId(u32)
);
newtype!(
    /// A token slot of the device pool: `page * 64 + offset`. Top-k outputs are slots.
    SlotId(u32)
);
newtype!(
    /// A layer *local to this engine* (0-based within the served layer range).
    LayerId(u32)
);
newtype!(
    /// A number of tokens.
    TokenCount(u64)
);
newtype!(
    /// A number of bytes, or a byte offset.
    Bytes(u64)
);

impl PageId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl LayerId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl Bytes {
    pub const ZERO: Bytes = Bytes(0);
    pub fn get(self) -> u64 {
        self.0
    }
    /// As a `usize` index into an in-memory buffer. Every `Bytes` a `Layout` hands out is bounded by
    /// a buffer that exists in memory, so this cannot truncate on the 64-bit hosts tierkv runs on.
    pub fn usize(self) -> usize {
        usize::try_from(self.0).expect("byte offset exceeds the address space")
    }
}

impl std::ops::Add for Bytes {
    type Output = Bytes;
    fn add(self, o: Bytes) -> Bytes {
        Bytes(self.0.checked_add(o.0).expect("byte count overflow"))
    }
}
impl std::ops::Sub for Bytes {
    type Output = Bytes;
    fn sub(self, o: Bytes) -> Bytes {
        Bytes(self.0.checked_sub(o.0).expect("byte count underflow"))
    }
}
impl std::ops::AddAssign for Bytes {
    fn add_assign(&mut self, o: Bytes) {
        *self = *self + o;
    }
}

impl SlotId {
    /// The slot as the kernels take it (`int32`; -1 is their padding). Every slot of a valid
    /// configuration fits: `config` bounds `device_pages * 64` by `i32::MAX`.
    pub fn kernel(self) -> i32 {
        i32::try_from(self.0).expect("slot beyond the kernels' i32 range")
    }
}

/// Bytes of `n` elements of each type the kernels exchange: the one place where an element count
/// becomes a byte count.
pub const fn fp8_bytes(n: u64) -> Bytes {
    Bytes(n * FP8_BYTES)
}
pub const fn bf16_bytes(n: u64) -> Bytes {
    Bytes(n * BF16_BYTES)
}
pub const fn f32_bytes(n: u64) -> Bytes {
    Bytes(n * FP32_BYTES)
}
/// How many f32 fit in `b`.
pub const fn f32_count(b: Bytes) -> u64 {
    b.0 / FP32_BYTES
}
/// `int32` elements: slots, page-table entries, context lengths.
pub const fn i32_bytes(n: u64) -> Bytes {
    Bytes(n * 4)
}
/// How many int32 fit in `b`.
pub const fn i32_count(b: Bytes) -> u64 {
    b.0 / 4
}
/// Token ids (u32), and the inverse: how many fit in `b`.
pub const fn u32_bytes(n: u64) -> Bytes {
    Bytes(n * 4)
}
pub const fn u32_count(b: Bytes) -> u64 {
    b.0 / 4
}
/// 64-bit digests.
pub const fn u64_bytes(n: u64) -> Bytes {
    Bytes(n * 8)
}

/// The two kinds of paged buffer: the MLA KV cache and the indexer's index-K cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferKind {
    Kv,
    IndexK,
}

impl BufferKind {
    pub const ALL: [BufferKind; 2] = [BufferKind::Kv, BufferKind::IndexK];
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Kv => "kv",
            BufferKind::IndexK => "index_k",
        }
    }
}

/// The element format of a paged buffer: what its page bytes mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PageFormat {
    IndexK(IndexKDtype),
    Kv(KvDtype),
}

impl PageFormat {
    pub fn kind(self) -> BufferKind {
        match self {
            PageFormat::IndexK(_) => BufferKind::IndexK,
            PageFormat::Kv(_) => BufferKind::Kv,
        }
    }
    /// Bytes of one token's row in a page of this format.
    pub const fn token_bytes(self) -> u64 {
        match self {
            PageFormat::IndexK(d) => index_k_token_bytes_of(d),
            PageFormat::Kv(d) => kv_token_bytes_of(d),
        }
    }
    /// Bytes of one page (64 token rows).
    pub const fn page_bytes(self) -> u64 {
        self.token_bytes() * PAGE_TOKENS as u64
    }
    /// Bytes of `tokens` token rows (a server's block of another size than tierkv's page), or
    /// `None` past `u64`.
    pub const fn rows_bytes(self, tokens: u64) -> Option<u64> {
        tokens.checked_mul(self.token_bytes())
    }
    pub fn fingerprint(self) -> LayoutFingerprint {
        LayoutFingerprint {
            format: self,
            page_tokens: PAGE_TOKENS,
            token_bytes: self.token_bytes(),
            page_bytes: self.page_bytes(),
        }
    }
}

impl fmt::Display for PageFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageFormat::IndexK(d) => write!(f, "index_k/{}", d.name()),
            PageFormat::Kv(d) => write!(f, "kv/{}", d.name()),
        }
    }
}

/// What two paged buffers must share before any copy between them: the element format and the
/// per-token and per-page byte counts. The stride between pages (which differs between the device
/// pool and a `page_first` host mirror) is deliberately *not* part of it: pages are byte-identical
/// in every tier, only their placement differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct LayoutFingerprint {
    pub format: PageFormat,
    pub page_tokens: u32,
    pub token_bytes: u64,
    pub page_bytes: u64,
}

impl LayoutFingerprint {
    /// A fingerprint for a buffer that is not paged (scratch, staging): it never matches a paged one.
    pub fn unpaged(bytes: u64) -> Self {
        LayoutFingerprint {
            format: PageFormat::Kv(KvDtype::Bf16),
            page_tokens: 0,
            token_bytes: 0,
            page_bytes: bytes,
        }
    }
    pub fn is_paged(&self) -> bool {
        self.page_tokens != 0
    }
}

impl fmt::Display for LayoutFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_paged() {
            write!(
                f,
                "{} ({} B/token, {} B/page)",
                self.format, self.token_bytes, self.page_bytes
            )
        } else {
            write!(f, "unpaged ({} B)", self.page_bytes)
        }
    }
}

/// Bytes per token of an index-K page: values, plus one fp32 scale per 128-value block for fp8.
pub const fn index_k_token_bytes_of(dtype: IndexKDtype) -> u64 {
    match dtype {
        IndexKDtype::Fp8 => {
            INDEX_HEAD_DIM as u64 * FP8_BYTES + (INDEX_HEAD_DIM / QUANT_BLOCK) as u64 * FP32_BYTES
        }
        IndexKDtype::Bf16 => INDEX_HEAD_DIM as u64 * BF16_BYTES,
    }
}

/// Bytes per token of an MLA KV row.
pub const fn kv_token_bytes_of(dtype: KvDtype) -> u64 {
    match dtype {
        KvDtype::Bf16 => KV_ROW_VALUES as u64 * BF16_BYTES,
        KvDtype::Fp8Packed => {
            KV_LORA_RANK as u64 * FP8_BYTES
                + (KV_LORA_RANK / QUANT_BLOCK) as u64 * FP32_BYTES
                + ROPE_DIM as u64 * BF16_BYTES
        }
        KvDtype::Fp8Unpacked => KV_ROW_VALUES as u64 * FP8_BYTES,
    }
}

/// Byte offsets inside one index-K page (DESIGN §3). fp8: values `[0, 8192)` at `t*128 + d`, scales
/// at `8192 + 4t`; bf16: value `[t][d]` at `(t*128 + d) * 2`, no scale.
pub mod index_k_page {
    use super::*;

    /// Offset of value `d` of token `t` within the page.
    pub fn value_offset(dtype: IndexKDtype, t: u32, d: u32) -> usize {
        match dtype {
            // The planted layout bug: the scales first, the values after them.
            IndexKDtype::Fp8
                if crate::mutants::on(crate::mutants::KernelMutant::IndexKScalesFirst) =>
            {
                (PAGE_TOKENS as u64 * FP32_BYTES) as usize + (t * INDEX_HEAD_DIM + d) as usize
            }
            IndexKDtype::Fp8 => (t * INDEX_HEAD_DIM + d) as usize,
            IndexKDtype::Bf16 => ((t * INDEX_HEAD_DIM + d) as u64 * BF16_BYTES) as usize,
        }
    }
    /// Bytes of token `t`'s values (contiguous).
    pub const fn values_bytes(dtype: IndexKDtype) -> usize {
        match dtype {
            IndexKDtype::Fp8 => (INDEX_HEAD_DIM as u64 * FP8_BYTES) as usize,
            IndexKDtype::Bf16 => (INDEX_HEAD_DIM as u64 * BF16_BYTES) as usize,
        }
    }
    /// Where the scales start (fp8 only).
    pub const FP8_SCALES_OFFSET: usize = (PAGE_TOKENS * INDEX_HEAD_DIM) as usize;
    /// Offset of token `t`'s fp32 scale, fp8 pages only.
    pub fn scale_offset(dtype: IndexKDtype, t: u32) -> Option<usize> {
        match dtype {
            IndexKDtype::Fp8
                if crate::mutants::on(crate::mutants::KernelMutant::IndexKScalesFirst) =>
            {
                Some((t as u64 * FP32_BYTES) as usize)
            }
            IndexKDtype::Fp8 => Some(FP8_SCALES_OFFSET + (t as u64 * FP32_BYTES) as usize),
            IndexKDtype::Bf16 => None,
        }
    }
    const _: () = assert!(FP8_SCALES_OFFSET == 8192);
}

/// Byte offsets inside one MLA KV row. bf16: 576 values at `2v`. Packed fp8: 512 e4m3 latent values
/// at `v`, 4 fp32 tile scales at `512 + 4i`, 64 bf16 RoPE values at `528 + 2r`.
pub mod kv_row {
    use super::*;
    pub const FP8_SCALES_OFFSET: usize = KV_LORA_RANK as usize;
    pub const FP8_ROPE_OFFSET: usize =
        KV_LORA_RANK as usize + (KV_LORA_RANK / QUANT_BLOCK) as usize * FP32_BYTES as usize;
    pub const FP8_TILES: usize = (KV_LORA_RANK / QUANT_BLOCK) as usize;
    /// Offset of `slot`'s row in a paged KV buffer: rows of a page are contiguous and pages are
    /// contiguous, so a KV slot is simply its row index.
    pub const fn slot_offset(dtype: KvDtype, slot: u32) -> usize {
        (slot as u64 * kv_token_bytes_of(dtype)) as usize
    }
    const _: () = assert!(FP8_ROPE_OFFSET == 528);
    const _: () = assert!(FP8_ROPE_OFFSET + ROPE_DIM as usize * 2 == 656);
}

/// The parameters a `Layout` is built from (the engine's configuration projects onto this).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayoutParams {
    /// Layers served by this engine.
    pub layers: u32,
    /// Global id of the first served layer (a pipeline stage serves a range starting above 0).
    pub layer_base: u32,
    pub index_n_heads: u32,
    pub index_k_dtype: IndexKDtype,
    pub kv_dtype: KvDtype,
    pub device_pages: u32,
    pub host_pages: u32,
    pub host_layout: HostLayout,
}

/// Why a layout could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("layout overflow: {what} does not fit in u64 bytes")]
    Overflow { what: &'static str },
    #[error("layout: {field} must be at least 1")]
    Zero { field: &'static str },
}

/// Every byte size and offset of one engine's buffers. Built once; see the module comment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    params: LayoutParams,
    device_kv_layer_bytes: u64,
    device_index_k_layer_bytes: u64,
    host_kv_bytes: u64,
    host_index_k_bytes: u64,
}

fn mul(a: u64, b: u64, what: &'static str) -> Result<u64, LayoutError> {
    a.checked_mul(b).ok_or(LayoutError::Overflow { what })
}

impl Layout {
    /// The parameters it was built from (validated by [`Layout::new`]).
    pub fn params(&self) -> LayoutParams {
        self.params
    }
    pub fn new(params: LayoutParams) -> Result<Layout, LayoutError> {
        if params.layers == 0 {
            return Err(LayoutError::Zero { field: "layers" });
        }
        if params.device_pages == 0 {
            return Err(LayoutError::Zero {
                field: "device_pages",
            });
        }
        let kv = PageFormat::Kv(params.kv_dtype).page_bytes();
        let ik = PageFormat::IndexK(params.index_k_dtype).page_bytes();
        let dev_kv = mul(params.device_pages as u64, kv, "device KV bytes per layer")?;
        let dev_ik = mul(
            params.device_pages as u64,
            ik,
            "device index-K bytes per layer",
        )?;
        let layers = params.layers as u64;
        // The all-layer device totals must fit too (they are reported and summed).
        mul(dev_kv, layers, "device KV bytes")?;
        mul(dev_ik, layers, "device index-K bytes")?;
        (dev_kv * layers)
            .checked_add(dev_ik * layers)
            .ok_or(LayoutError::Overflow {
                what: "device bytes",
            })?;
        let host_page_layers = mul(params.host_pages as u64, layers, "host pages x layers")?;
        let host_kv = mul(host_page_layers, kv, "host KV bytes")?;
        let host_ik = mul(host_page_layers, ik, "host index-K bytes")?;
        host_kv
            .checked_add(host_ik)
            .ok_or(LayoutError::Overflow { what: "host bytes" })?;
        Ok(Layout {
            params,
            device_kv_layer_bytes: dev_kv,
            device_index_k_layer_bytes: dev_ik,
            host_kv_bytes: host_kv,
            host_index_k_bytes: host_ik,
        })
    }

    pub fn layers(&self) -> u32 {
        self.params.layers
    }
    pub fn device_pages(&self) -> u32 {
        self.params.device_pages
    }
    pub fn host_pages(&self) -> u32 {
        self.params.host_pages
    }
    pub fn index_n_heads(&self) -> u32 {
        self.params.index_n_heads
    }

    /// The page format of a buffer kind under this layout.
    pub fn format(&self, kind: BufferKind) -> PageFormat {
        match kind {
            BufferKind::Kv => PageFormat::Kv(self.params.kv_dtype),
            BufferKind::IndexK => PageFormat::IndexK(self.params.index_k_dtype),
        }
    }
    pub fn fingerprint(&self, kind: BufferKind) -> LayoutFingerprint {
        self.format(kind).fingerprint()
    }
    pub fn token_bytes(&self, kind: BufferKind) -> Bytes {
        Bytes(self.format(kind).token_bytes())
    }
    pub fn page_bytes(&self, kind: BufferKind) -> Bytes {
        Bytes(self.format(kind).page_bytes())
    }

    /// Bytes of one layer's device buffer of `kind` (`device_pages` pages).
    pub fn device_layer_bytes(&self, kind: BufferKind) -> Bytes {
        Bytes(match kind {
            BufferKind::Kv => self.device_kv_layer_bytes,
            BufferKind::IndexK => self.device_index_k_layer_bytes,
        })
    }
    /// Offset of `page` in a device layer buffer.
    pub fn device_page_offset(&self, kind: BufferKind, page: PageId) -> Bytes {
        assert!(
            page.0 < self.params.device_pages,
            "device page {page} out of range"
        );
        Bytes(page.0 as u64 * self.format(kind).page_bytes())
    }
    /// Device bytes of `kind` over all layers.
    pub fn device_bytes(&self, kind: BufferKind) -> Bytes {
        Bytes(self.device_layer_bytes(kind).0 * self.params.layers as u64)
    }
    /// All device bytes (KV + index-K, all layers).
    pub fn device_total_bytes(&self) -> Bytes {
        Bytes(self.device_bytes(BufferKind::Kv).0 + self.device_bytes(BufferKind::IndexK).0)
    }

    /// Bytes of the host mirror buffer of `kind` (all layers, all host pages).
    pub fn host_bytes(&self, kind: BufferKind) -> Bytes {
        Bytes(match kind {
            BufferKind::Kv => self.host_kv_bytes,
            BufferKind::IndexK => self.host_index_k_bytes,
        })
    }
    pub fn host_total_bytes(&self) -> Bytes {
        Bytes(self.host_kv_bytes + self.host_index_k_bytes)
    }
    /// Offset of (`layer`, host `page`) in the host mirror of `kind`.
    pub fn host_page_offset(&self, kind: BufferKind, layer: LayerId, page: PageId) -> Bytes {
        assert!(layer.0 < self.params.layers, "layer {layer} out of range");
        assert!(
            page.0 < self.params.host_pages,
            "host page {page} out of range"
        );
        let pb = self.format(kind).page_bytes();
        let (layers, pages) = (self.params.layers as u64, self.params.host_pages as u64);
        Bytes(match self.host_order() {
            HostLayout::LayerFirst => (layer.0 as u64 * pages + page.0 as u64) * pb,
            HostLayout::PageFirst => (page.0 as u64 * layers + layer.0 as u64) * pb,
        })
    }
    /// The order the mirror's pages are placed in: the configured one (or, with the planted
    /// layout bug, the other).
    fn host_order(&self) -> HostLayout {
        let order = self.params.host_layout;
        if crate::mutants::on(crate::mutants::KernelMutant::HostOrderSwapped) {
            match order {
                HostLayout::LayerFirst => HostLayout::PageFirst,
                HostLayout::PageFirst => HostLayout::LayerFirst,
            }
        } else {
            order
        }
    }

    /// A strided view of one layer of the host mirror: page `p` starts at `base + p * stride`.
    pub fn host_layer_view(&self, kind: BufferKind, layer: LayerId) -> PagedView {
        let pb = self.format(kind).page_bytes();
        let stride = match self.host_order() {
            HostLayout::LayerFirst => pb,
            HostLayout::PageFirst => pb * self.params.layers as u64,
        };
        assert!(layer.0 < self.params.layers, "layer {layer} out of range");
        // Where the layer's page 0 is (or would be: a mirror may have no pages).
        let base = match self.host_order() {
            HostLayout::LayerFirst => layer.0 as u64 * self.params.host_pages as u64 * pb,
            HostLayout::PageFirst => layer.0 as u64 * pb,
        };
        PagedView {
            base,
            page_stride: stride,
            pages: self.params.host_pages,
            fingerprint: self.fingerprint(kind),
        }
    }
    /// The view of a device layer buffer: contiguous pages.
    pub fn device_layer_view(&self, kind: BufferKind) -> PagedView {
        let pb = self.format(kind).page_bytes();
        PagedView {
            base: 0,
            page_stride: pb,
            pages: self.params.device_pages,
            fingerprint: self.fingerprint(kind),
        }
    }

    /// Bytes a transfer of `pages` whole pages moves over every layer, KV and index-K.
    pub fn transfer_bytes(&self, pages: u64) -> Bytes {
        let per_page =
            self.format(BufferKind::Kv).page_bytes() + self.format(BufferKind::IndexK).page_bytes();
        Bytes(pages * self.params.layers as u64 * per_page)
    }

    /// Device tokens (all pages).
    pub fn device_tokens(&self) -> TokenCount {
        TokenCount(self.params.device_pages as u64 * PAGE_TOKENS as u64)
    }
    pub fn host_tokens(&self) -> TokenCount {
        TokenCount(self.params.host_pages as u64 * PAGE_TOKENS as u64)
    }
}

/// The slot of token `offset` in `page`.
pub fn slot(page: PageId, offset: u32) -> SlotId {
    assert!(offset < PAGE_TOKENS, "offset {offset} outside a page");
    SlotId(page.0 * PAGE_TOKENS + offset)
}
/// The slot of token `offset` of page-table entry `page` as the kernels compute it: `int32`
/// arithmetic, as CUDA's `page * 64 + offset` (a valid page table gives a valid slot; the CPU
/// references use this so that they agree with the kernels on any input).
pub fn kernel_slot(page: i32, offset: u32) -> i32 {
    assert!(offset < PAGE_TOKENS, "offset {offset} outside a page");
    page.wrapping_mul(PAGE_TOKENS as i32)
        .wrapping_add(offset as i32)
}
/// The page holding `slot`.
pub fn slot_page(slot: SlotId) -> PageId {
    PageId(slot.0 / PAGE_TOKENS)
}
/// The offset of `slot` within its page.
pub fn slot_offset(slot: SlotId) -> u32 {
    slot.0 % PAGE_TOKENS
}
/// How many pages `tokens` tokens occupy.
pub fn pages_for_tokens(tokens: u64) -> u64 {
    tokens.div_ceil(PAGE_TOKENS as u64)
}

/// The model step's scratch buffers, in the order the engine allocates them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ScratchBuffer {
    /// fp8 queries of one indexer launch, `[launch_rows][heads][128]`.
    Queries,
    /// Folded head weights of one launch, `[launch_rows][heads]` f32.
    Weights,
    /// Logits of one launch, `[launch_rows][out_stride]` f32.
    Logits,
    /// Top-k selections of a whole step, `[rows_max][topk]` i32 slots.
    Selections,
    /// Per-layer digests of a whole step, `[layers][rows_max]` u64 (device).
    Digests,
    /// The pinned host copy of `Digests` that the host reads after the step.
    Readback,
    /// The token each query row of the last step generated, `[rows_max]` u32 (device): where the
    /// next step's rows read the tokens the host does not know yet (an engine running one step
    /// ahead; [`ScratchBuffer::AHEAD`]).
    Tokens,
    /// A second readback, for the step enqueued while the host reads the previous one's.
    ReadbackAhead,
}

impl ScratchBuffer {
    pub const ALL: [ScratchBuffer; 6] = [
        ScratchBuffer::Queries,
        ScratchBuffer::Weights,
        ScratchBuffer::Logits,
        ScratchBuffer::Selections,
        ScratchBuffer::Digests,
        ScratchBuffer::Readback,
    ];
    /// The buffers only an engine that runs one step ahead allocates, after [`ScratchBuffer::ALL`].
    pub const AHEAD: [ScratchBuffer; 2] = [ScratchBuffer::Tokens, ScratchBuffer::ReadbackAhead];

    pub fn name(self) -> &'static str {
        match self {
            ScratchBuffer::Queries => "q",
            ScratchBuffer::Weights => "w",
            ScratchBuffer::Logits => "logits",
            ScratchBuffer::Selections => "topk",
            ScratchBuffer::Digests => "digests",
            ScratchBuffer::Readback => "readback",
            ScratchBuffer::Tokens => "tokens",
            ScratchBuffer::ReadbackAhead => "readback_ahead",
        }
    }
}

// The engine allocates `ALL` then `AHEAD` and finds each buffer by its discriminant.
const _: () = {
    let mut i = 0;
    while i < ScratchBuffer::ALL.len() {
        assert!(
            ScratchBuffer::ALL[i] as usize == i,
            "ScratchBuffer::ALL out of order"
        );
        i += 1;
    }
    let n = ScratchBuffer::ALL.len();
    assert!(ScratchBuffer::AHEAD[0] as usize == n && ScratchBuffer::AHEAD[1] as usize == n + 1);
};

/// What a [`ScratchLayout`] is built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchParams {
    pub heads: u32,
    /// Query rows of one indexer launch: the query, weight and logits buffers hold one launch.
    pub launch_rows: u32,
    /// Query rows one step may hold: the selections and digests hold a whole step.
    pub rows_max: u32,
    /// Longest context a row may have, in tokens.
    pub context_tokens_max: u32,
    /// Positions the top-k selects per row.
    pub topk: u32,
    pub layers: u32,
}

/// Every byte size and offset of the model step's scratch: the engine allocates its buffers from
/// it, the model step addresses their regions through it, and the CPU device and the CUDA
/// launchers size their arguments with the same element functions. Built once, every product
/// checked for overflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchLayout {
    params: ScratchParams,
    /// Page-table entries per row.
    pt_stride: u32,
}

impl ScratchLayout {
    /// The parameters it was built from (validated by [`ScratchLayout::new`]).
    pub fn params(&self) -> ScratchParams {
        self.params
    }
    /// Page-table entries per row.
    pub fn pt_stride(&self) -> u32 {
        self.pt_stride
    }
    pub fn new(params: ScratchParams) -> Result<ScratchLayout, LayoutError> {
        for (field, v) in [
            ("heads", params.heads),
            ("launch_rows", params.launch_rows),
            ("rows_max", params.rows_max),
            ("context_tokens_max", params.context_tokens_max),
            ("topk", params.topk),
            ("layers", params.layers),
        ] {
            if v == 0 {
                return Err(LayoutError::Zero { field });
            }
        }
        let pt_stride = pages_for_tokens(params.context_tokens_max as u64);
        let l = ScratchLayout {
            params,
            pt_stride: u32::try_from(pt_stride).map_err(|_| LayoutError::Overflow {
                what: "page-table entries per row",
            })?,
        };
        // Every buffer's size must fit; everything the accessors return is bounded by one.
        let launch = params.launch_rows as u64;
        mul(
            mul(launch, params.heads as u64, "scratch queries")?,
            INDEX_HEAD_DIM as u64,
            "scratch queries",
        )?;
        mul(
            mul(launch, l.out_stride() as u64, "scratch logits")?,
            FP32_BYTES,
            "scratch logits",
        )?;
        mul(
            mul(
                params.rows_max as u64,
                params.topk as u64,
                "scratch selections",
            )?,
            4,
            "scratch selections",
        )?;
        mul(
            mul(
                params.layers as u64,
                params.rows_max as u64,
                "scratch digests",
            )?,
            8,
            "scratch digests",
        )?;
        Ok(l)
    }

    /// Logits per row: one per position of the row's page table.
    pub fn out_stride(&self) -> u32 {
        self.pt_stride * PAGE_TOKENS
    }
    pub fn rows_max(&self) -> u32 {
        self.params.rows_max
    }

    /// The allocation size of a scratch buffer.
    pub fn bytes(&self, b: ScratchBuffer) -> Bytes {
        let p = &self.params;
        match b {
            ScratchBuffer::Queries => self.queries(p.launch_rows),
            ScratchBuffer::Weights => self.weights(p.launch_rows),
            ScratchBuffer::Logits => self.logits(p.launch_rows),
            ScratchBuffer::Selections => self.selections(0, p.rows_max).1,
            ScratchBuffer::Digests | ScratchBuffer::Readback | ScratchBuffer::ReadbackAhead => {
                u64_bytes(p.layers as u64 * p.rows_max as u64)
            }
            ScratchBuffer::Tokens => u32_bytes(p.rows_max as u64),
        }
    }
    /// fp8 queries of `rows` rows (from the start of the buffer).
    pub fn queries(&self, rows: u32) -> Bytes {
        assert!(rows <= self.params.launch_rows, "{rows} rows in one launch");
        fp8_bytes(rows as u64 * self.params.heads as u64 * INDEX_HEAD_DIM as u64)
    }
    /// Folded head weights of `rows` rows.
    pub fn weights(&self, rows: u32) -> Bytes {
        assert!(rows <= self.params.launch_rows, "{rows} rows in one launch");
        f32_bytes(rows as u64 * self.params.heads as u64)
    }
    /// Logits of `rows` rows.
    pub fn logits(&self, rows: u32) -> Bytes {
        assert!(rows <= self.params.launch_rows, "{rows} rows in one launch");
        f32_bytes(rows as u64 * self.out_stride() as u64)
    }
    /// (offset, bytes) of the selections of rows `first..first + rows` of the step.
    pub fn selections(&self, first: u32, rows: u32) -> (Bytes, Bytes) {
        assert!(first + rows <= self.params.rows_max, "selection rows");
        let k = self.params.topk as u64;
        (i32_bytes(first as u64 * k), i32_bytes(rows as u64 * k))
    }
    /// (offset, bytes) of layer `layer`'s digests of rows `first..first + rows`.
    pub fn digests(&self, layer: u32, first: u32, rows: u32) -> (Bytes, Bytes) {
        assert!(layer < self.params.layers, "digest layer");
        assert!(first + rows <= self.params.rows_max, "digest rows");
        let at = layer as u64 * self.params.rows_max as u64 + first as u64;
        (u64_bytes(at), u64_bytes(rows as u64))
    }
    /// The index of layer `layer`'s digest of row `row` among all the step's digests.
    pub fn digest_index(&self, layer: u32, row: u32) -> usize {
        layer as usize * self.params.rows_max as usize + row as usize
    }
}

/// Where whole pages live in a buffer: page `p` occupies `[base + p*page_stride, .. + page_bytes)`.
/// Copies between two views move whole page rows and require equal fingerprints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PagedView {
    pub base: u64,
    pub page_stride: u64,
    pub pages: u32,
    pub fingerprint: LayoutFingerprint,
}

impl PagedView {
    pub fn page_bytes(&self) -> u64 {
        self.fingerprint.page_bytes
    }
    /// Byte range of `page` in the underlying buffer.
    pub fn page_range(&self, page: PageId) -> std::ops::Range<u64> {
        assert!(
            page.0 < self.pages,
            "page {page} outside the view ({} pages)",
            self.pages
        );
        let start = self.base + page.0 as u64 * self.page_stride;
        start..start + self.page_bytes()
    }
    /// Smallest buffer size this view needs.
    pub fn required_bytes(&self) -> u64 {
        if self.pages == 0 {
            return self.base;
        }
        self.base + (self.pages as u64 - 1) * self.page_stride + self.page_bytes()
    }
}

/// A run of `count` consecutive pages, `src..src+count` copied to `dst..dst+count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PageRun {
    pub src: PageId,
    pub dst: PageId,
    pub count: u32,
}

/// Coalesces page pairs into runs where both sides are consecutive (order preserved).
pub fn coalesce_runs(pairs: &[(PageId, PageId)]) -> Vec<PageRun> {
    let mut runs: Vec<PageRun> = Vec::new();
    for &(src, dst) in pairs {
        if let Some(last) = runs.last_mut() {
            if last.src.0 + last.count == src.0 && last.dst.0 + last.count == dst.0 {
                last.count += 1;
                continue;
            }
        }
        runs.push(PageRun { src, dst, count: 1 });
    }
    runs
}

#[cfg(test)]
mod tests;

/// Fuzz body (`fuzz/fuzz_targets/layout.rs`): layouts and copies built from arbitrary bytes. A
/// layout is built or refused with a typed error; a copy between two views is checked, and when
/// the check passes it stays inside both buffers and moves whole pages.
pub fn fuzz_layout_copy(data: &[u8]) {
    let mut it = data
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    let mut next = || it.next().unwrap_or(0);
    let p = LayoutParams {
        layers: next() % 8,
        layer_base: next(),
        index_n_heads: 1 + next() % 64,
        index_k_dtype: if next() % 2 == 0 {
            IndexKDtype::Fp8
        } else {
            IndexKDtype::Bf16
        },
        kv_dtype: [KvDtype::Bf16, KvDtype::Fp8Packed, KvDtype::Fp8Unpacked][(next() % 3) as usize],
        device_pages: next() % 64,
        host_pages: next() % 128,
        host_layout: if next() % 2 == 0 {
            HostLayout::LayerFirst
        } else {
            HostLayout::PageFirst
        },
    };
    let Ok(l) = Layout::new(p) else {
        return;
    };
    let kind = if next() % 2 == 0 {
        BufferKind::Kv
    } else {
        BufferKind::IndexK
    };
    let layer = LayerId(next() % l.layers());
    let dev = l.device_layer_view(kind);
    let host = l.host_layer_view(kind, layer);
    // Sometimes a view of another format, or a truncated buffer.
    let other = PageFormat::IndexK(if next() % 2 == 0 {
        IndexKDtype::Fp8
    } else {
        IndexKDtype::Bf16
    });
    let host = if next() % 5 == 0 {
        PagedView {
            fingerprint: other.fingerprint(),
            ..host
        }
    } else {
        host
    };
    let host_len = l.host_bytes(kind).0.saturating_sub((next() % 3) as u64 * 7);
    let runs: Vec<PageRun> = (0..next() % 6)
        .map(|_| PageRun {
            src: PageId(next() % 80),
            dst: PageId(next() % 140),
            count: next() % 9,
        })
        .collect();
    let dev_len = l.device_layer_bytes(kind).0;
    if dev_len > 1 << 24 || host_len > 1 << 24 {
        return;
    }
    let src = vec![0x5Au8; dev_len as usize];
    let mut dst = vec![0u8; host_len as usize];
    match crate::cpu::page_copy(&src, &dev, &mut dst, &host, &runs) {
        Ok(()) => {
            assert_eq!(dev.fingerprint, host.fingerprint);
            let copied = dst.iter().filter(|&&b| b == 0x5A).count() as u64;
            assert_eq!(copied % dev.page_bytes(), 0, "whole pages only");
        }
        Err(_) => assert!(dst.iter().all(|&b| b == 0), "a refused copy writes nothing"),
    }
}
