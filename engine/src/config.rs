//! The model and cache configuration (DESIGN §3): loaded from TOML or JSON, or taken from a built-in
//! preset, and validated into a [`Config`] whose every field obeys its rule.
//!
//! Parsing never trusts serde's shape errors to explain themselves: a file is read into a generic
//! value and every field is extracted here, so each invalid input becomes a [`ConfigError`] that
//! names the field (`model.index_topk`) and the rule it broke. No input panics. A file may start
//! from a preset (`preset = "sim-small"`) and override any field; without a preset, every field
//! is required.

use crate::layout::{
    Bytes, HostLayout, IndexKDtype, KvDtype, Layout, LayoutError, LayoutParams, ScratchBuffer,
    ScratchLayout, ScratchParams, INDEX_HEADS_MAX, INDEX_HEAD_DIM, INDEX_TOPK_MAX, KV_LORA_RANK,
    PAGE_TOKENS, QUANT_BLOCK, ROPE_DIM,
};

/// Query rows per indexer launch (the step scratch holds one launch of queries and logits).
pub const QUERY_ROWS_PER_LAUNCH: u32 = 64;
use serde::Serialize;
use serde_json::{Map, Value};
use std::fmt;
use tierkv_kernels::rope::RopeParams;
pub use tierkv_kernels::rope::YarnRule;

/// A key of the configuration, spelled once: its name in its section and its full path.
#[derive(Clone, Copy, Debug)]
struct Key {
    name: &'static str,
    path: &'static str,
}

macro_rules! key {
    ($section:ident . $key:ident) => {
        Key {
            name: stringify!($key),
            path: concat!(stringify!($section), ".", stringify!($key)),
        }
    };
}

/// Reads `section.key` from `fields` with the given reader, defaulting to the base preset's
/// value (required without a base), or to `or $default` when the key is optional.
macro_rules! field {
    ($f:expr, $b:expr, $section:ident . $key:ident, $read:ident) => {
        $f.$read(key!($section.$key), $b.map(|b| b.$section.$key))
    };
    ($f:expr, $b:expr, $section:ident . $key:ident, $read:ident, or $default:expr) => {
        $f.$read(
            key!($section.$key),
            Some($b.map_or($default, |b| b.$section.$key)),
        )
    };
    ($f:expr, $b:expr, $section:ident . $key:ident, named $t:ty) => {
        $f.name(
            key!($section.$key),
            <$t>::NAMES,
            <$t>::parse,
            $b.map(|b| b.$section.$key),
        )
    };
    ($f:expr, $b:expr, $section:ident . $key:ident, named $t:ty, or $default:expr) => {
        $f.name(
            key!($section.$key),
            <$t>::NAMES,
            <$t>::parse,
            Some($b.map_or($default, |b| b.$section.$key)),
        )
    };
}

/// What every key of a configuration means: its path, then its meaning, unit, range and default
/// (the default is the preset's value when the file names a preset). `docs/CONFIG.md` and
/// `tierkv check-config --emit-toml` are written from this table, and a test checks that it
/// covers every key a configuration has.
pub const KEY_DOCS: &[(&str, &str)] = &[
    ("preset", "Start from this built-in preset (deepseek-v3.2, deepseek-v4-flash-bf16, sim-small); every other key then overrides it. Without a preset every key without a fixed default is required."),
    ("name", "A name for reports. Default: the preset's name, or \"custom\"."),
    ("model.layers", "Layers this engine serves. Range 1..=512."),
    ("model.layer_base", "Global id of the first served layer: 0, unless this engine is a later pipeline stage. Range 0..=4096; default 0."),
    ("model.kv_lora_rank", "MLA latent values per KV row. Must be 512 (the KV row layout fixes it)."),
    ("model.qk_rope_head_dim", "MLA RoPE values per KV row. Must be 64."),
    ("model.rope_theta", "RoPE base: frequency i of the 32 is rope_theta^(-2i/64) before YaRN. A finite number above 1; default 10000.0 (DeepSeek-V3.2)."),
    ("model.rope_factor", "YaRN's scaling factor: the low frequencies are divided by it, when YaRN applies (model.rope_yarn says when; the indexer takes no YaRN attention scale: DeepSeek applies mscale to MLA only). A finite number, at least 1 (1: no YaRN); default 40.0 (DeepSeek-V3.2)."),
    ("model.rope_original_seq_len", "The context the model was pre-trained at (YaRN's original_seq_len), in tokens. Range 1..=1048576; default 4096 (DeepSeek-V3.2)."),
    ("model.rope_beta_fast", "YaRN's beta_fast: frequencies turning more often than this over rope_original_seq_len keep their value. A finite number above rope_beta_slow; default 32.0 (DeepSeek-V3.2)."),
    ("model.rope_beta_slow", "YaRN's beta_slow: frequencies turning less often than this over rope_original_seq_len are divided by rope_factor. A finite number above 0; default 1.0 (DeepSeek-V3.2)."),
    ("model.rope_yarn", "When YaRN applies: \"configured\" (whenever rope_factor is above 1, whatever the context, as SGLang and vLLM apply it to a DeepSeek model whose configuration carries rope_scaling) or \"context_above_original\" (only when model.context_tokens_max exceeds model.rope_original_seq_len, as DeepSeek's reference precompute_freqs_cis does). Default configured; configurations written before this key existed had the reference rule, and a saved scenario without the key keeps it."),
    ("model.index_n_heads", "Indexer query heads. Range 1..=64 (DeepSeek-V3.2: 64)."),
    ("model.index_head_dim", "Values per index key and query head. Must be 128 (the Hadamard transform and the page layout fix it)."),
    ("model.index_topk", "Positions the indexer selects per query, honoured everywhere. Range 1..=2048 (DeepSeek-V3.2: 2048)."),
    ("model.page_size", "Tokens per page. Must be 64 (the DeepGEMM, SGLang and vLLM paged layouts fix it)."),
    ("model.kv_dtype", "MLA KV element type: \"bf16\" (1152 B/token) or \"fp8_packed\" (656 B/token: 512 e4m3 values, 4 fp32 tile scales, 64 bf16 RoPE values)."),
    ("model.index_k_dtype", "Index-K element type: \"fp8\" (132 B/token: 128 e4m3 values and one fp32 scale) or \"bf16\" (256 B/token)."),
    ("model.scale_fmt", "Format of the indexer's fp8 scales, for the queries (q_prep) and the fp8 index keys alike, as DeepSeek's scale_fmt: \"fp32\" (max(amax, 1e-4) / 448) or \"ue8m0\" (that rounded up to a power of two). Default fp32 (DeepSeek-V3.2: ue8m0)."),
    ("model.context_tokens_max", "Longest context a request may reach, prompt plus generated tokens. Range 1..=1048576, and at most cache.device_pages pages."),
    ("model.prefill_indexer", "Which prefill tokens run the indexer: \"every_token\" (as the model does) or \"last_token\" (each chunk's last; the simulator's default, cheaper on the CPU). Default every_token."),
    ("cache.device_pages", "Pages (64 tokens each) of the device tier, per layer. At least 1; every slot must fit in i32; pools and step scratch at most 1 TiB."),
    ("cache.host_ratio", "Host tier size as a multiple of the device tier: a finite number above 1. Give this or cache.host_tokens."),
    ("cache.host_tokens", "Host tier size in tokens: more than the device tier's, fewer than 2^32 pages, at most 16 TiB of pinned memory. Give this or cache.host_ratio."),
    ("cache.host_layout", "Order of the host mirror: \"layer_first\" ([layer][page]) or \"page_first\" ([page][layer])."),
    ("cache.write_policy", "How KV reaches the host tier: \"write_through\" (every cached page at once), \"write_through_selective\" (on its second hit) or \"write_back\" (when the device tier evicts it)."),
    ("cache.load_slots", "Slots of the load ring (loads in flight at once; SGLang uses 3). Range 1..=64; default 3."),
    ("scheduler.queued_requests_max", "Requests waiting for admission; intake rejects more. Range 1..=1048576."),
    ("scheduler.pending_tokens_max", "Prompt tokens waiting for admission; intake rejects more. Range 1..=2^36."),
    ("scheduler.prefill_tokens_per_step_max", "Prompt tokens one step may compute. Range 1..=1048576."),
    ("scheduler.running_requests_max", "Requests in the running batch. Range 1..=4096."),
    ("scheduler.output_tokens_max", "Tokens a request may ask to generate. At least 1, below model.context_tokens_max."),
];

/// Which query tokens of a prefill chunk run the indexer (decode tokens always do).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillIndexer {
    /// Every prefill token is a query, as in the real model.
    EveryToken,
    /// Only each request's last prefill token of the chunk; the simulator's default, because the
    /// indexer dominates its CPU time and the last token already reads the whole context.
    LastToken,
}

impl PrefillIndexer {
    pub const NAMES: &'static [&'static str] = &["every_token", "last_token"];
    pub fn name(self) -> &'static str {
        match self {
            PrefillIndexer::EveryToken => "every_token",
            PrefillIndexer::LastToken => "last_token",
        }
    }
    fn parse(s: &str) -> Option<Self> {
        [PrefillIndexer::EveryToken, PrefillIndexer::LastToken]
            .into_iter()
            .find(|v| v.name() == s)
    }
}

/// The format of the indexer's fp8 scales (DeepSeek's `scale_fmt`). One setting for the queries
/// and the index keys, because the reference quantizes both with the same
/// `act_quant(.., self.scale_fmt)` (DeepSeek-V3.2-Exp `Indexer.forward`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleFmt {
    /// `max(amax, 1e-4) / 448` as an fp32 (the reference's `scale_fmt = None`).
    Fp32,
    /// That scale rounded up to a power of two (`scale_fmt = "ue8m0"`).
    Ue8m0,
}

impl ScaleFmt {
    pub const NAMES: &'static [&'static str] = &["fp32", "ue8m0"];
    pub fn name(self) -> &'static str {
        match self {
            ScaleFmt::Fp32 => "fp32",
            ScaleFmt::Ue8m0 => "ue8m0",
        }
    }
    /// Whether the kernels round their scales up to powers of two.
    pub fn ue8m0(self) -> bool {
        self == ScaleFmt::Ue8m0
    }
    fn parse(s: &str) -> Option<Self> {
        [ScaleFmt::Fp32, ScaleFmt::Ue8m0]
            .into_iter()
            .find(|v| v.name() == s)
    }
}

/// How new KV reaches the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WritePolicy {
    /// Back up every newly cached page at once.
    WriteThrough,
    /// Back up a page on its second hit.
    WriteThroughSelective,
    /// Back up a page only when the device tier evicts it.
    WriteBack,
}

impl WritePolicy {
    pub const ALL: [WritePolicy; 3] = [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective,
        WritePolicy::WriteBack,
    ];
    pub const NAMES: &'static [&'static str] =
        &["write_through", "write_through_selective", "write_back"];
    pub fn name(self) -> &'static str {
        match self {
            WritePolicy::WriteThrough => "write_through",
            WritePolicy::WriteThroughSelective => "write_through_selective",
            WritePolicy::WriteBack => "write_back",
        }
    }
    fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.name() == s)
    }
}

/// Host tier size: a multiple of the device pool, or a token count.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostCapacity {
    Ratio(f64),
    Tokens(u64),
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelConfig {
    /// Layers served by this engine.
    pub layers: u32,
    /// Global id of the first served layer (0 unless this engine is a later pipeline stage).
    pub layer_base: u32,
    pub kv_lora_rank: u32,
    pub qk_rope_head_dim: u32,
    /// RoPE's base (before YaRN).
    pub rope_theta: f64,
    /// YaRN's factor; when YaRN applies, `rope_yarn` says.
    pub rope_factor: f64,
    /// The context the model was pre-trained at.
    pub rope_original_seq_len: u32,
    /// YaRN's `beta_fast` (rotations over the original length above which a frequency is kept).
    pub rope_beta_fast: f64,
    /// YaRN's `beta_slow` (rotations below which a frequency is divided by the factor).
    pub rope_beta_slow: f64,
    /// When YaRN applies: whenever configured (the servers' rule) or only above the original
    /// length (the reference's).
    pub rope_yarn: YarnRule,
    pub index_n_heads: u32,
    pub index_head_dim: u32,
    /// Positions the indexer selects per query; honoured everywhere (DESIGN §1 incident 3).
    pub index_topk: u32,
    pub page_size: u32,
    pub kv_dtype: KvDtype,
    pub index_k_dtype: IndexKDtype,
    /// The format of the indexer's fp8 scales, for queries and index keys.
    pub scale_fmt: ScaleFmt,
    /// Longest context (prompt + generated) a request may reach.
    pub context_tokens_max: u32,
    pub prefill_indexer: PrefillIndexer,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CacheConfig {
    pub device_pages: u32,
    pub host: HostCapacity,
    pub host_layout: HostLayout,
    pub write_policy: WritePolicy,
    /// The ring of load slots (three in SGLang).
    pub load_slots: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SchedulerConfig {
    /// Requests waiting for admission to a batch; over it, intake rejects.
    pub queued_requests_max: u32,
    /// Prompt tokens waiting in the queue; over it, intake rejects.
    pub pending_tokens_max: u64,
    /// Prefill tokens one step may process.
    pub prefill_tokens_per_step_max: u32,
    /// Requests in the running batch.
    pub running_requests_max: u32,
    /// Tokens a request may ask to generate.
    pub output_tokens_max: u32,
}

/// A validated configuration. Construct it with [`Config::preset`], [`Config::from_toml`],
/// [`Config::from_json`] or [`Config::from_file`]; all of them validate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Config {
    pub name: String,
    pub model: ModelConfig,
    pub cache: CacheConfig,
    pub scheduler: SchedulerConfig,
}

/// Why a configuration was refused. Every variant names the field.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("could not read {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{format} syntax error: {message}")]
    Syntax {
        format: &'static str,
        message: String,
    },
    #[error("unknown preset `{name}`; presets are: {}", Config::PRESETS.join(", "))]
    UnknownPreset { name: String },
    #[error("unknown field `{field}`")]
    UnknownField { field: String },
    #[error("missing field `{field}` (give it, or start from a preset with `preset = \"...\"`)")]
    Missing { field: &'static str },
    #[error("`{field}` has the wrong type: expected {expected}, found {found}")]
    Type {
        field: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("`{field}` = {value}: {rule}")]
    Invalid {
        field: &'static str,
        value: String,
        rule: String,
    },
    #[error("`{field}` = \"{value}\" is not one of: {}", expected.join(", "))]
    UnknownName {
        field: &'static str,
        value: String,
        expected: &'static [&'static str],
    },
    #[error("`{field}`: {what} overflows u64 bytes")]
    Overflow {
        field: &'static str,
        what: &'static str,
    },
    #[error("`{field}` = {value}: over the limit of {limit} ({why})")]
    TooLarge {
        field: &'static str,
        value: String,
        limit: String,
        why: &'static str,
    },
    #[error("`{field}` = {value}: must be a finite number")]
    NotFinite { field: String, value: String },
}

/// The most each field may be: what the engine can serve (the kernels', the load ring's and the
/// scheduler's bounds) and what one GPU server holds. `check-config` refuses more, naming the
/// field and the limit.
/// Bytes an engine allocates: on the device (pools and step scratch) and in pinned host memory
/// (the mirror and the readback buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footprint {
    pub device: Bytes,
    pub host: Bytes,
}

impl Footprint {
    pub fn total(&self) -> Bytes {
        Bytes(self.device.0.saturating_add(self.host.0))
    }
}

/// Bounds of what one configuration may ask for: beyond them validation answers
/// `ConfigError::TooLarge`, before anything is allocated.
pub mod limits {
    /// Layers one engine serves (DeepSeek-V3.2 has 61): each costs two pool buffers and one event
    /// per load slot.
    pub const LAYERS_MAX: u32 = 512;
    /// The largest global id of a first layer (a pipeline stage's offset).
    pub const LAYER_BASE_MAX: u32 = 4096;
    /// The longest context, in tokens (DeepSeek-V3.2 serves 128K; 8x that).
    pub const CONTEXT_TOKENS_MAX: u32 = 1 << 20;
    /// Slots of the load ring (three in SGLang), each one event per layer.
    pub const LOAD_SLOTS_MAX: u32 = 64;
    /// Requests waiting for admission.
    pub const QUEUED_REQUESTS_MAX: u32 = 1 << 20;
    /// Prompt tokens waiting for admission (a power of two: the documentation says 2^36).
    pub const PENDING_TOKENS_MAX: u64 = 1 << 36;
    /// Prompt tokens one step computes.
    pub const PREFILL_TOKENS_PER_STEP_MAX: u32 = 1 << 20;
    /// Requests in the running batch.
    pub const RUNNING_REQUESTS_MAX: u32 = 4096;
    /// Device memory of the pools and the step scratch (one H200 holds 141 GB).
    pub const DEVICE_BYTES_MAX: u64 = 1 << 40;
    /// Pinned host memory of the mirror.
    pub const HOST_BYTES_MAX: u64 = 16 << 40;
}

pub type ConfigResult<T> = Result<T, ConfigError>;

/// DeepSeek-V3.2's RoPE settings (the longest sequence aside, which the configuration's context
/// gives).
const V32_ROPE: RopeParams = RopeParams::deepseek_v32(0);

/// Where a preset's model values come from.
#[derive(Clone, Copy, Debug)]
pub struct PresetSource {
    /// The public material the values are taken from.
    pub source: &'static str,
    /// `(key, why)` of each value that material does not confirm (a stand-in, or a third-party
    /// report).
    pub unconfirmed: &'static [(&'static str, &'static str)],
}

impl Config {
    pub const PRESETS: &'static [&'static str] =
        &["deepseek-v3.2", "deepseek-v4-flash-bf16", "sim-small"];
    /// The simulator's and the README's default.
    pub const DEFAULT_PRESET: &'static str = "sim-small";

    /// A built-in preset, validated. Its model values are the published model's; where public
    /// material does not confirm one, [`Config::preset_source`] says so, and `check-config`
    /// prints it.
    pub fn preset(name: &str) -> ConfigResult<Config> {
        let c = match name {
            // DeepSeek-V3.2-Exp: `inference/config_671B_v3.2.json` (61 layers, 64 indexer heads of
            // 128, top-2048, scale_fmt ue8m0) and `inference/model.py`'s RoPE defaults; fp8
            // index-K as the reference caches it, packed fp8 KV as FlashMLA stores it.
            "deepseek-v3.2" => Config {
                name: name.into(),
                model: ModelConfig {
                    layers: 61,
                    layer_base: 0,
                    kv_lora_rank: KV_LORA_RANK,
                    qk_rope_head_dim: ROPE_DIM,
                    rope_theta: V32_ROPE.theta,
                    rope_factor: V32_ROPE.factor,
                    rope_original_seq_len: V32_ROPE.original_seq_len,
                    rope_beta_fast: V32_ROPE.beta_fast,
                    rope_beta_slow: V32_ROPE.beta_slow,
                    rope_yarn: YarnRule::Configured,
                    index_n_heads: 64,
                    index_head_dim: INDEX_HEAD_DIM,
                    index_topk: 2048,
                    page_size: PAGE_TOKENS,
                    kv_dtype: KvDtype::Fp8Packed,
                    index_k_dtype: IndexKDtype::Fp8,
                    scale_fmt: ScaleFmt::Ue8m0,
                    context_tokens_max: 131_072,
                    prefill_indexer: PrefillIndexer::EveryToken,
                },
                cache: CacheConfig {
                    device_pages: 4096,
                    host: HostCapacity::Ratio(2.0),
                    host_layout: HostLayout::LayerFirst,
                    write_policy: WritePolicy::WriteThroughSelective,
                    load_slots: 3,
                },
                scheduler: SchedulerConfig {
                    queued_requests_max: 512,
                    pending_tokens_max: 4 << 20,
                    prefill_tokens_per_step_max: 8192,
                    running_requests_max: 64,
                    output_tokens_max: 8192,
                },
            },
            // The incident deployment: bf16 index-K for recall, index_topk 512, on DeepSeek-V3.2's
            // byte layouts. The model values are DeepSeek-V4-Flash's as third-party copies of its
            // published configuration give them; `preset_source` lists them as unconfirmed.
            "deepseek-v4-flash-bf16" => {
                let mut c = Config::preset("deepseek-v3.2")?;
                c.name = name.into();
                let m = &mut c.model;
                m.layers = 43;
                m.index_n_heads = 64;
                m.index_topk = 512;
                m.index_k_dtype = IndexKDtype::Bf16;
                m.rope_theta = 10000.0;
                m.rope_factor = 16.0;
                m.rope_original_seq_len = 65_536;
                m.rope_beta_fast = 32.0;
                m.rope_beta_slow = 1.0;
                m.scale_fmt = ScaleFmt::Ue8m0;
                c
            }
            // The simulator's default: few layers and heads, tiny pools that force eviction;
            // DeepSeek-V3.2's RoPE (swarm seeds draw both YaRN rules).
            "sim-small" => Config {
                name: name.into(),
                model: ModelConfig {
                    layers: 2,
                    layer_base: 0,
                    kv_lora_rank: KV_LORA_RANK,
                    qk_rope_head_dim: ROPE_DIM,
                    rope_theta: V32_ROPE.theta,
                    rope_factor: V32_ROPE.factor,
                    rope_original_seq_len: V32_ROPE.original_seq_len,
                    rope_beta_fast: V32_ROPE.beta_fast,
                    rope_beta_slow: V32_ROPE.beta_slow,
                    rope_yarn: YarnRule::Configured,
                    index_n_heads: 2,
                    index_head_dim: INDEX_HEAD_DIM,
                    index_topk: 64,
                    page_size: PAGE_TOKENS,
                    kv_dtype: KvDtype::Fp8Packed,
                    index_k_dtype: IndexKDtype::Bf16,
                    scale_fmt: ScaleFmt::Fp32,
                    context_tokens_max: 2048,
                    prefill_indexer: PrefillIndexer::LastToken,
                },
                cache: CacheConfig {
                    device_pages: 48,
                    host: HostCapacity::Ratio(3.0),
                    host_layout: HostLayout::PageFirst,
                    write_policy: WritePolicy::WriteThrough,
                    load_slots: 3,
                },
                scheduler: SchedulerConfig {
                    queued_requests_max: 64,
                    pending_tokens_max: 65_536,
                    prefill_tokens_per_step_max: 512,
                    running_requests_max: 8,
                    output_tokens_max: 64,
                },
            },
            _ => {
                return Err(ConfigError::UnknownPreset {
                    name: name.to_string(),
                })
            }
        };
        c.validate()?;
        Ok(c)
    }

    /// Where preset `name`'s model values come from, and each value public material does not
    /// confirm (`None` for an unknown preset).
    pub fn preset_source(name: &str) -> Option<PresetSource> {
        Some(match name {
            "deepseek-v3.2" => PresetSource {
                source: "DeepSeek-V3.2-Exp inference/config_671B_v3.2.json (n_layers 61, index_n_heads 64, \
                         index_head_dim 128, index_topk 2048, kv_lora_rank 512, qk_rope_head_dim 64, \
                         scale_fmt ue8m0) and inference/model.py's ModelArgs defaults, which that file \
                         keeps (rope_theta 10000, rope_factor 40, original_seq_len 4096, beta_fast 32, \
                         beta_slow 1); context, dtypes and pools are this deployment's",
                unconfirmed: &[],
            },
            "deepseek-v4-flash-bf16" => PresetSource {
                source: "the deployment of incident 1 (bf16 index-K, index_topk 512) on DeepSeek-V3.2's \
                         byte layouts; DeepSeek-V4-Flash's values as third-party copies of its published \
                         config.json and GGUF metadata report them (no DeepSeek reference code for V4 was \
                         read)",
                unconfirmed: &[
                    ("model.layers", "43 as third-party copies of the V4-Flash config report (num_hidden_layers)"),
                    ("model.index_n_heads", "64 as third-party copies of the V4-Flash config report"),
                    ("model.index_topk", "512 as third-party copies of the V4-Flash config report"),
                    ("model.rope_theta", "V4-Flash compresses the KV its indexer scores and names a second base (compress_rope_theta 160000); which base the indexer's keys rotate by is not confirmed"),
                    ("model.rope_factor", "16 as third-party GGUF metadata report"),
                    ("model.rope_original_seq_len", "65536 as third-party GGUF metadata report"),
                    ("model.rope_beta_fast", "32 as third-party GGUF metadata report"),
                    ("model.rope_beta_slow", "1 as third-party GGUF metadata report"),
                    ("model.scale_fmt", "ue8m0 as the quantization_config of third-party copies reports"),
                    ("model.kv_lora_rank", "DeepSeek-V3.2's MLA row (512 + 64 values); V4-Flash's attention keeps another KV layout, which tierkv does not model"),
                ],
            },
            "sim-small" => PresetSource {
                source: "the simulator's preset, not a published model; DeepSeek-V3.2's RoPE settings",
                unconfirmed: &[],
            },
            _ => return None,
        })
    }

    /// The unconfirmed values of preset `preset` that this configuration still holds (a file may
    /// start from the preset and override them): key, value and why.
    pub fn unconfirmed(&self, preset: &str) -> Vec<(&'static str, String, &'static str)> {
        let (Some(src), Ok(base)) = (Config::preset_source(preset), Config::preset(preset)) else {
            return Vec::new();
        };
        let (mine, theirs) = (self.values(), base.values());
        src.unconfirmed
            .iter()
            .filter_map(|&(key, why)| {
                let value = mine.iter().find(|(k, _)| k == key)?.1.clone();
                let same = theirs.iter().any(|(k, v)| k == key && *v == value);
                same.then_some((key, value, why))
            })
            .collect()
    }

    /// Every key's path and its value as `to_toml` writes it.
    fn values(&self) -> Vec<(String, String)> {
        let mut section = String::new();
        let mut out = Vec::new();
        for line in self.to_toml().lines() {
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = format!("{name}.");
            } else if let Some((key, value)) = line.split_once(" = ") {
                out.push((format!("{section}{key}"), value.to_string()));
            }
        }
        out
    }

    /// The RoPE settings of the kernels' rows: the model's, with the longest context as the
    /// reference's `max_seq_len` (YaRN applies above `rope_original_seq_len`).
    pub fn rope(&self) -> RopeParams {
        let m = &self.model;
        RopeParams {
            theta: m.rope_theta,
            factor: m.rope_factor,
            original_seq_len: m.rope_original_seq_len,
            beta_fast: m.rope_beta_fast,
            beta_slow: m.rope_beta_slow,
            max_seq_len: m.context_tokens_max,
            yarn_rule: m.rope_yarn,
        }
    }

    /// The preset a configuration file starts from (its top-level `preset`), if it names one
    /// and can be read.
    pub fn base_preset_of(path: &std::path::Path) -> Option<String> {
        let text = crate::input::read_text(path, crate::input::CONFIG_BYTES_MAX).ok()?;
        let v: Value = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(&text).ok()?
        } else {
            serde_json::to_value(toml::from_str::<toml::Table>(&text).ok()?).ok()?
        };
        v.get("preset")?.as_str().map(str::to_string)
    }

    pub fn from_toml(text: &str) -> ConfigResult<Config> {
        let t: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            format: "TOML",
            message: clip_lines(&e.to_string()),
        })?;
        // TOML has `nan` and `inf`, which the generic value below cannot hold: refuse them here,
        // by name, rather than let them read as missing values.
        for (section, v) in &t {
            non_finite(section, v)?;
        }
        let v = serde_json::to_value(&t).map_err(|e| ConfigError::Syntax {
            format: "TOML",
            message: e.to_string(),
        })?;
        Config::from_value(&v)
    }

    pub fn from_json(text: &str) -> ConfigResult<Config> {
        let v: Value = serde_json::from_str(text).map_err(|e| ConfigError::Syntax {
            format: "JSON",
            message: clip_lines(&e.to_string()),
        })?;
        Config::from_value(&v)
    }

    /// Reads a `.json` file as JSON and anything else as TOML: a regular file of at most
    /// [`crate::input::CONFIG_BYTES_MAX`] bytes.
    pub fn from_file(path: &std::path::Path) -> ConfigResult<Config> {
        let text = crate::input::read_text(path, crate::input::CONFIG_BYTES_MAX).map_err(|e| {
            ConfigError::Io {
                path: path.display().to_string(),
                reason: e.to_string(),
            }
        })?;
        if path.extension().is_some_and(|e| e == "json") {
            Config::from_json(&text)
        } else {
            Config::from_toml(&text)
        }
    }

    /// Builds a configuration from a parsed document (TOML and JSON both land here): the base
    /// preset if one is named, then each section, every key read once and leftovers refused.
    pub fn from_value(v: &Value) -> ConfigResult<Config> {
        let top = v.as_object().ok_or_else(|| ConfigError::Type {
            field: "(document)",
            expected: "a table of sections",
            found: kind(v),
        })?;
        let base = match top.get("preset") {
            None => None,
            Some(Value::String(name)) => Some(Config::preset(name)?),
            Some(other) => {
                return Err(ConfigError::Type {
                    field: "preset",
                    expected: "a string",
                    found: kind(other),
                })
            }
        };
        for key in top.keys() {
            if !["preset", "name", "model", "cache", "scheduler"].contains(&key.as_str()) {
                return Err(ConfigError::UnknownField { field: key.clone() });
            }
        }
        let empty = Map::new();
        let m = Fields::of(top, "model", &empty)?;
        let c = Fields::of(top, "cache", &empty)?;
        let s = Fields::of(top, "scheduler", &empty)?;
        let b = base.as_ref();
        let name = match top.get("name") {
            Some(Value::String(n)) => n.clone(),
            Some(other) => {
                return Err(ConfigError::Type {
                    field: "name",
                    expected: "a string",
                    found: kind(other),
                })
            }
            None => b.map(|b| b.name.clone()).unwrap_or_else(|| "custom".into()),
        };
        let cfg = Config {
            name,
            model: model_section(&m, b)?,
            cache: cache_section(&c, b)?,
            scheduler: scheduler_section(&s, b)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every rule; the first broken one is the error.
    pub fn validate(&self) -> ConfigResult<()> {
        self.validate_model()?;
        self.validate_cache()?;
        self.validate_scheduler()?;
        self.validate_limits()?;
        self.validate_footprint()
    }

    /// Every numeric field within what the engine can serve.
    fn validate_limits(&self) -> ConfigResult<()> {
        use limits::*;
        let (m, c, s) = (&self.model, &self.cache, &self.scheduler);
        let checks: [(Key, u64, u64, &'static str); 9] = [
            (
                key!(model.layers),
                m.layers as u64,
                LAYERS_MAX as u64,
                "layers one engine serves",
            ),
            (
                key!(model.layer_base),
                m.layer_base as u64,
                LAYER_BASE_MAX as u64,
                "global layer ids",
            ),
            (
                key!(model.context_tokens_max),
                m.context_tokens_max as u64,
                CONTEXT_TOKENS_MAX as u64,
                "the longest context the kernels are tested for",
            ),
            (
                key!(cache.load_slots),
                c.load_slots as u64,
                LOAD_SLOTS_MAX as u64,
                "slots of the load ring",
            ),
            (
                key!(scheduler.queued_requests_max),
                s.queued_requests_max as u64,
                QUEUED_REQUESTS_MAX as u64,
                "requests one queue holds",
            ),
            (
                key!(scheduler.pending_tokens_max),
                s.pending_tokens_max,
                PENDING_TOKENS_MAX,
                "prompt tokens one queue holds",
            ),
            (
                key!(scheduler.prefill_tokens_per_step_max),
                s.prefill_tokens_per_step_max as u64,
                PREFILL_TOKENS_PER_STEP_MAX as u64,
                "prefill tokens of one step",
            ),
            (
                key!(scheduler.running_requests_max),
                s.running_requests_max as u64,
                RUNNING_REQUESTS_MAX as u64,
                "requests of one batch",
            ),
            (
                key!(scheduler.output_tokens_max),
                s.output_tokens_max as u64,
                CONTEXT_TOKENS_MAX as u64,
                "the longest context",
            ),
        ];
        for (key, value, limit, why) in checks {
            if value > limit {
                return Err(ConfigError::TooLarge {
                    field: key.path,
                    value: value.to_string(),
                    limit: limit.to_string(),
                    why,
                });
            }
        }
        Ok(())
    }

    /// What an engine of this configuration allocates when its selections hold `topk` tokens
    /// (the configured `index_topk`, unless a zoo mutant overrides it): device pools and step
    /// scratch on the device; the host mirror and the readback buffer in pinned host memory.
    pub fn footprint(&self, topk: u32) -> ConfigResult<Footprint> {
        let layout = self.layout()?;
        let scratch = self.scratch_layout(topk)?;
        let (mut device, mut host) = (layout.device_total_bytes(), layout.host_total_bytes());
        for b in ScratchBuffer::ALL {
            let bytes = scratch.bytes(b);
            if b == ScratchBuffer::Readback {
                host = Bytes(host.0.saturating_add(bytes.0));
            } else {
                device = Bytes(device.0.saturating_add(bytes.0));
            }
        }
        Ok(Footprint { device, host })
    }

    /// The device tier (pools and the step's scratch) and the host mirror within what one GPU
    /// server holds.
    fn validate_footprint(&self) -> ConfigResult<()> {
        let fp = self.footprint(self.model.index_topk)?;
        let device = fp.device.0;
        let too_large = |field, bytes: u64, limit: u64, why| ConfigError::TooLarge {
            field,
            value: format!("{} ({bytes} B)", self.cache.device_pages),
            limit: format!("{limit} B"),
            why,
        };
        if device > limits::DEVICE_BYTES_MAX {
            return Err(too_large(
                key!(cache.device_pages).path,
                device,
                limits::DEVICE_BYTES_MAX,
                "device memory of the pools and the step scratch",
            ));
        }
        let host = fp.host.0;
        if host > limits::HOST_BYTES_MAX {
            let field = match self.cache.host {
                HostCapacity::Ratio(_) => key!(cache.host_ratio).path,
                HostCapacity::Tokens(_) => key!(cache.host_tokens).path,
            };
            return Err(ConfigError::TooLarge {
                field,
                value: format!("{} host pages ({host} B)", self.host_pages()),
                limit: format!("{} B", limits::HOST_BYTES_MAX),
                why: "pinned host memory of the mirror",
            });
        }
        Ok(())
    }

    /// The model step's scratch for this configuration, selecting `topk` per query row.
    pub fn scratch_layout(&self, topk: u32) -> ConfigResult<ScratchLayout> {
        let (m, s) = (&self.model, &self.scheduler);
        let overflow = |what| ConfigError::Overflow {
            field: key!(scheduler.prefill_tokens_per_step_max).path,
            what,
        };
        // Every prefill token is a query row under `every_token`, and every decoding request
        // one more.
        let rows_max = match m.prefill_indexer {
            PrefillIndexer::EveryToken => s
                .prefill_tokens_per_step_max
                .checked_add(s.running_requests_max)
                .ok_or(overflow("query rows per step"))?,
            PrefillIndexer::LastToken => s.running_requests_max,
        };
        ScratchLayout::new(ScratchParams {
            heads: m.index_n_heads,
            launch_rows: QUERY_ROWS_PER_LAUNCH,
            rows_max,
            context_tokens_max: m.context_tokens_max,
            topk,
            layers: m.layers,
        })
        .map_err(|e| match e {
            LayoutError::Overflow { what } => overflow(what),
            LayoutError::Zero { field } => ConfigError::Invalid {
                field,
                value: "0".into(),
                rule: "must be at least 1".into(),
            },
        })
    }

    /// The model's shapes: the ones the byte layouts fix, and the ones the kernels bound.
    fn validate_model(&self) -> ConfigResult<()> {
        let m = &self.model;
        if m.layers == 0 {
            return Err(inv(
                key!(model.layers).path,
                "0".into(),
                "must be at least 1",
            ));
        }
        if m.layer_base.checked_add(m.layers).is_none() {
            return Err(inv(
                key!(model.layer_base).path,
                m.layer_base.to_string(),
                "layer_base + layers must fit in u32",
            ));
        }
        if m.page_size != PAGE_TOKENS {
            return Err(inv(
                key!(model.page_size).path,
                m.page_size.to_string(),
                "must be 64: the paged index-K and KV layouts (DeepGEMM, SGLang, vLLM) fix 64 tokens per page",
            ));
        }
        if m.index_head_dim == 0 || m.index_head_dim % QUANT_BLOCK != 0 {
            return Err(inv(
                key!(model.index_head_dim).path,
                m.index_head_dim.to_string(),
                "must be a non-zero multiple of the 128-value quantization block",
            ));
        }
        if m.index_head_dim != INDEX_HEAD_DIM {
            return Err(inv(
                key!(model.index_head_dim).path,
                m.index_head_dim.to_string(),
                "must be 128: the Hadamard transform and the index-K page layout are defined for 128-value keys",
            ));
        }
        if m.kv_lora_rank != KV_LORA_RANK {
            return Err(inv(
                key!(model.kv_lora_rank).path,
                m.kv_lora_rank.to_string(),
                "must be 512: the MLA KV row layout (576 values, 656 B packed) fixes it",
            ));
        }
        if m.qk_rope_head_dim != ROPE_DIM {
            return Err(inv(
                key!(model.qk_rope_head_dim).path,
                m.qk_rope_head_dim.to_string(),
                "must be 64: the MLA KV row layout fixes it",
            ));
        }
        if m.index_n_heads == 0 || m.index_n_heads > INDEX_HEADS_MAX {
            return Err(inv(
                key!(model.index_n_heads).path,
                m.index_n_heads.to_string(),
                "must be in 1..=64 (the indexer kernels hold at most 64 heads)",
            ));
        }
        if m.index_topk == 0 || m.index_topk > INDEX_TOPK_MAX {
            return Err(inv(
                key!(model.index_topk).path,
                m.index_topk.to_string(),
                "must be in 1..=2048 (the top-k kernel selects at most 2048 positions)",
            ));
        }
        if m.context_tokens_max == 0 {
            return Err(inv(
                key!(model.context_tokens_max).path,
                "0".into(),
                "must be at least 1",
            ));
        }
        self.validate_rope()
    }

    /// The RoPE settings: what YaRN's formula needs to be finite and ordered.
    fn validate_rope(&self) -> ConfigResult<()> {
        let m = &self.model;
        let number = |key: Key, v: f64, ok: bool, rule: &str| {
            if v.is_finite() && ok {
                Ok(())
            } else {
                Err(inv(key.path, v.to_string(), rule))
            }
        };
        number(
            key!(model.rope_theta),
            m.rope_theta,
            m.rope_theta > 1.0,
            "must be a finite number above 1 (the frequencies divide by its logarithm)",
        )?;
        number(
            key!(model.rope_factor),
            m.rope_factor,
            m.rope_factor >= 1.0,
            "must be a finite number, at least 1",
        )?;
        number(
            key!(model.rope_beta_slow),
            m.rope_beta_slow,
            m.rope_beta_slow > 0.0,
            "must be a finite number above 0",
        )?;
        number(
            key!(model.rope_beta_fast),
            m.rope_beta_fast,
            m.rope_beta_fast > m.rope_beta_slow,
            &format!(
                "must be a finite number above model.rope_beta_slow = {}",
                m.rope_beta_slow
            ),
        )?;
        let orig = m.rope_original_seq_len;
        if orig == 0 || orig > limits::CONTEXT_TOKENS_MAX {
            return Err(inv(
                key!(model.rope_original_seq_len).path,
                orig.to_string(),
                &format!("must be in 1..={}", limits::CONTEXT_TOKENS_MAX),
            ));
        }
        Ok(())
    }

    /// The pools, the host tier and the load ring.
    fn validate_cache(&self) -> ConfigResult<()> {
        let m = &self.model;
        let c = &self.cache;
        if c.device_pages == 0 {
            return Err(inv(
                key!(cache.device_pages).path,
                "0".into(),
                "must be at least 1",
            ));
        }
        if c.device_pages as u64 * PAGE_TOKENS as u64 > i32::MAX as u64 {
            return Err(inv(
                key!(cache.device_pages).path,
                c.device_pages.to_string(),
                "must keep every slot (page * 64 + offset) within i32, the kernels' slot type",
            ));
        }
        if c.load_slots == 0 {
            return Err(inv(
                key!(cache.load_slots).path,
                "0".into(),
                "must be at least 1",
            ));
        }
        let pages_per_request = (m.context_tokens_max as u64).div_ceil(PAGE_TOKENS as u64);
        if pages_per_request > c.device_pages as u64 {
            return Err(inv(
                key!(model.context_tokens_max).path,
                m.context_tokens_max.to_string(),
                &format!(
                    "a request of that many tokens needs {pages_per_request} pages, more than cache.device_pages = {}",
                    c.device_pages
                ),
            ));
        }
        let device_tokens = c.device_pages as u64 * PAGE_TOKENS as u64;
        match c.host {
            HostCapacity::Ratio(r) => {
                if !r.is_finite() || r <= 1.0 {
                    return Err(inv(
                        key!(cache.host_ratio).path,
                        r.to_string(),
                        "must be a finite number above 1: the host tier must be larger than the device tier",
                    ));
                }
                if r * device_tokens as f64 >= (u32::MAX as f64) * PAGE_TOKENS as f64 {
                    return Err(inv(
                        key!(cache.host_ratio).path,
                        r.to_string(),
                        "gives more than 2^32 host pages",
                    ));
                }
            }
            HostCapacity::Tokens(t) => {
                if t <= device_tokens {
                    return Err(inv(
                        key!(cache.host_tokens).path,
                        t.to_string(),
                        &format!("must be larger than the device tier ({device_tokens} tokens)"),
                    ));
                }
                if t / PAGE_TOKENS as u64 > u32::MAX as u64 {
                    return Err(inv(
                        key!(cache.host_tokens).path,
                        t.to_string(),
                        "gives more than 2^32 host pages",
                    ));
                }
            }
        }
        // Whole pages: a ratio or a token count just above the device tier's can still round
        // down to no more pages than it has.
        let host_pages = self.host_pages();
        if host_pages <= c.device_pages {
            let (field, value) = match c.host {
                HostCapacity::Ratio(r) => (key!(cache.host_ratio).path, r.to_string()),
                HostCapacity::Tokens(t) => (key!(cache.host_tokens).path, t.to_string()),
            };
            return Err(inv(
                field,
                value,
                &format!(
                    "gives {host_pages} whole host pages, no more than cache.device_pages = {}: the host tier must hold more pages than the device tier",
                    c.device_pages
                ),
            ));
        }
        Ok(())
    }

    /// The scheduler's limits.
    fn validate_scheduler(&self) -> ConfigResult<()> {
        let m = &self.model;
        let s = &self.scheduler;
        for (field, v) in [
            (
                key!(scheduler.queued_requests_max).path,
                s.queued_requests_max as u64,
            ),
            (
                key!(scheduler.pending_tokens_max).path,
                s.pending_tokens_max,
            ),
            (
                key!(scheduler.prefill_tokens_per_step_max).path,
                s.prefill_tokens_per_step_max as u64,
            ),
            (
                key!(scheduler.running_requests_max).path,
                s.running_requests_max as u64,
            ),
            (
                key!(scheduler.output_tokens_max).path,
                s.output_tokens_max as u64,
            ),
        ] {
            if v == 0 {
                return Err(inv(field, "0".into(), "must be at least 1"));
            }
        }
        if s.output_tokens_max >= m.context_tokens_max {
            return Err(inv(
                key!(scheduler.output_tokens_max).path,
                s.output_tokens_max.to_string(),
                &format!(
                    "must be below model.context_tokens_max = {}",
                    m.context_tokens_max
                ),
            ));
        }
        Ok(())
    }

    /// Host tier pages (whole pages; a ratio rounds down).
    pub fn host_pages(&self) -> u32 {
        match self.cache.host {
            HostCapacity::Ratio(r) => (self.cache.device_pages as f64 * r).floor() as u32,
            HostCapacity::Tokens(t) => (t / PAGE_TOKENS as u64) as u32,
        }
    }

    pub fn layout_params(&self) -> LayoutParams {
        LayoutParams {
            layers: self.model.layers,
            layer_base: self.model.layer_base,
            index_n_heads: self.model.index_n_heads,
            index_k_dtype: self.model.index_k_dtype,
            kv_dtype: self.model.kv_dtype,
            device_pages: self.cache.device_pages,
            host_pages: self.host_pages(),
            host_layout: self.cache.host_layout,
        }
    }

    /// The layout every pool of this engine is built from.
    pub fn layout(&self) -> ConfigResult<Layout> {
        Layout::new(self.layout_params()).map_err(|e| match e {
            LayoutError::Overflow { what } => ConfigError::Overflow {
                field: key!(cache.device_pages).path,
                what,
            },
            LayoutError::Zero { field } => ConfigError::Invalid {
                field,
                value: "0".into(),
                rule: "must be at least 1".into(),
            },
        })
    }

    /// The configuration as TOML that [`Config::from_toml`] reads back to an equal value.
    pub fn to_toml(&self) -> String {
        let m = &self.model;
        let c = &self.cache;
        let s = &self.scheduler;
        let host = match c.host {
            HostCapacity::Ratio(r) => format!("host_ratio = {r:?}"),
            HostCapacity::Tokens(t) => format!("host_tokens = {t}"),
        };
        format!(
            "name = \"{}\"\n\n[model]\nlayers = {}\nlayer_base = {}\nkv_lora_rank = {}\nqk_rope_head_dim = {}\n\
             rope_theta = {:?}\nrope_factor = {:?}\nrope_original_seq_len = {}\nrope_beta_fast = {:?}\n\
             rope_beta_slow = {:?}\nrope_yarn = \"{}\"\n\
             index_n_heads = {}\nindex_head_dim = {}\nindex_topk = {}\npage_size = {}\nkv_dtype = \"{}\"\n\
             index_k_dtype = \"{}\"\nscale_fmt = \"{}\"\ncontext_tokens_max = {}\nprefill_indexer = \"{}\"\n\n\
             [cache]\ndevice_pages = {}\n{}\nhost_layout = \"{}\"\nwrite_policy = \"{}\"\nload_slots = {}\n\n\
             [scheduler]\nqueued_requests_max = {}\npending_tokens_max = {}\nprefill_tokens_per_step_max = {}\n\
             running_requests_max = {}\noutput_tokens_max = {}\n",
            self.name,
            m.layers,
            m.layer_base,
            m.kv_lora_rank,
            m.qk_rope_head_dim,
            m.rope_theta,
            m.rope_factor,
            m.rope_original_seq_len,
            m.rope_beta_fast,
            m.rope_beta_slow,
            m.rope_yarn.name(),
            m.index_n_heads,
            m.index_head_dim,
            m.index_topk,
            m.page_size,
            m.kv_dtype.name(),
            m.index_k_dtype.name(),
            m.scale_fmt.name(),
            m.context_tokens_max,
            m.prefill_indexer.name(),
            c.device_pages,
            host,
            c.host_layout.name(),
            c.write_policy.name(),
            c.load_slots,
            s.queued_requests_max,
            s.pending_tokens_max,
            s.prefill_tokens_per_step_max,
            s.running_requests_max,
            s.output_tokens_max,
        )
    }
}

impl Config {
    /// The configuration as TOML with every key's meaning, unit, range and default as a comment
    /// above it (`tierkv check-config --emit-toml`): a file to start from.
    pub fn to_documented_toml(&self) -> String {
        let mut out = String::from(
            "# tierkv configuration. Check it with: tierkv check-config FILE\n\
             # Every key is below with its meaning, unit, range and default.\n\n",
        );
        let mut section = String::new();
        for line in self.to_toml().lines() {
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = format!("{name}.");
            }
            if let Some((key, _)) = line.split_once(" = ") {
                let path = format!("{section}{key}");
                let doc = KEY_DOCS
                    .iter()
                    .find(|(k, _)| *k == path)
                    .unwrap_or_else(|| panic!("the key `{path}` has no entry in KEY_DOCS"));
                for l in wrap(doc.1, 98) {
                    out.push_str(&format!("# {l}\n"));
                }
            }
            out.push_str(line);
            out.push('\n');
        }
        out
    }
}

/// `text` in lines of at most `width` characters, split at spaces.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for word in text.split(' ') {
        let last = lines.last_mut().expect("a line");
        if !last.is_empty() && last.len() + 1 + word.len() > width {
            lines.push(word.to_string());
        } else {
            if !last.is_empty() {
                last.push(' ');
            }
            last.push_str(word);
        }
    }
    lines
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_toml())
    }
}

/// A parser's message with every line cut to 160 characters (a syntax error on a line of 200 KB
/// must not echo it whole).
fn clip_lines(message: &str) -> String {
    const WIDTH: usize = 160;
    message
        .lines()
        .map(|l| match l.char_indices().nth(WIDTH) {
            Some((at, _)) => format!("{}…", &l[..at]),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first `nan` or `inf` under `path` in a TOML document, as an error naming its field.
fn non_finite(path: &str, v: &toml::Value) -> ConfigResult<()> {
    match v {
        toml::Value::Float(f) if !f.is_finite() => Err(ConfigError::NotFinite {
            field: path.to_string(),
            value: f.to_string(),
        }),
        toml::Value::Table(t) => t
            .iter()
            .try_for_each(|(k, v)| non_finite(&format!("{path}.{k}"), v)),
        toml::Value::Array(a) => a
            .iter()
            .enumerate()
            .try_for_each(|(i, v)| non_finite(&format!("{path}[{i}]"), v)),
        _ => Ok(()),
    }
}

fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string \"{s}\""),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "a table".into(),
    }
}

fn inv(field: &'static str, value: String, rule: &str) -> ConfigError {
    ConfigError::Invalid {
        field,
        value,
        rule: rule.to_string(),
    }
}

fn model_section(m: &Fields, b: Option<&Config>) -> ConfigResult<ModelConfig> {
    // The key `scale_fmt` replaced: say so, rather than only that the old key is unknown.
    if let Some(v) = m.map.get("index_k_ue8m0") {
        let write = match v.as_bool() {
            Some(true) => "model.scale_fmt = \"ue8m0\"",
            Some(false) => "model.scale_fmt = \"fp32\" (the default)",
            None => "model.scale_fmt = \"ue8m0\" or \"fp32\"",
        };
        return Err(ConfigError::Invalid {
            field: "model.index_k_ue8m0",
            value: v.to_string(),
            rule: format!(
                "was renamed: write {write} (it now sets the queries' scales too, as DeepSeek's \
                 scale_fmt does)"
            ),
        });
    }
    let model = ModelConfig {
        layers: field!(m, b, model.layers, u32)?,
        layer_base: field!(m, b, model.layer_base, u32, or 0)?,
        kv_lora_rank: field!(m, b, model.kv_lora_rank, u32, or KV_LORA_RANK)?,
        qk_rope_head_dim: field!(m, b, model.qk_rope_head_dim, u32, or ROPE_DIM)?,
        rope_theta: field!(m, b, model.rope_theta, f64, or V32_ROPE.theta)?,
        rope_factor: field!(m, b, model.rope_factor, f64, or V32_ROPE.factor)?,
        rope_original_seq_len: field!(
            m,
            b,
            model.rope_original_seq_len,
            u32,
            or V32_ROPE.original_seq_len
        )?,
        rope_beta_fast: field!(m, b, model.rope_beta_fast, f64, or V32_ROPE.beta_fast)?,
        rope_beta_slow: field!(m, b, model.rope_beta_slow, f64, or V32_ROPE.beta_slow)?,
        rope_yarn: field!(m, b, model.rope_yarn, named YarnRule, or YarnRule::Configured)?,
        index_n_heads: field!(m, b, model.index_n_heads, u32)?,
        index_head_dim: field!(m, b, model.index_head_dim, u32, or INDEX_HEAD_DIM)?,
        index_topk: field!(m, b, model.index_topk, u32)?,
        page_size: field!(m, b, model.page_size, u32, or PAGE_TOKENS)?,
        kv_dtype: field!(m, b, model.kv_dtype, named KvDtype)?,
        index_k_dtype: field!(m, b, model.index_k_dtype, named IndexKDtype)?,
        scale_fmt: field!(m, b, model.scale_fmt, named ScaleFmt, or ScaleFmt::Fp32)?,
        context_tokens_max: field!(m, b, model.context_tokens_max, u32)?,
        prefill_indexer: field!(
            m,
            b,
            model.prefill_indexer,
            named PrefillIndexer,
            or PrefillIndexer::EveryToken
        )?,
    };
    m.finish()?;
    Ok(model)
}

fn cache_section(c: &Fields, b: Option<&Config>) -> ConfigResult<CacheConfig> {
    let (ratio, tokens) = (key!(cache.host_ratio), key!(cache.host_tokens));
    let host = match (c.get(ratio), c.get(tokens)) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::Invalid {
                field: tokens.path,
                value: format!("(with {})", ratio.path),
                rule: format!("give either {} or {}, not both", ratio.path, tokens.path),
            })
        }
        (Some(_), None) => HostCapacity::Ratio(c.f64(ratio, None)?),
        (None, Some(_)) => HostCapacity::Tokens(c.u64(tokens, None)?),
        (None, None) => b
            .map(|b| b.cache.host)
            .ok_or(ConfigError::Missing { field: ratio.path })?,
    };
    let cache = CacheConfig {
        device_pages: field!(c, b, cache.device_pages, u32)?,
        host,
        host_layout: field!(c, b, cache.host_layout, named HostLayout)?,
        write_policy: field!(c, b, cache.write_policy, named WritePolicy)?,
        load_slots: field!(c, b, cache.load_slots, u32, or 3)?,
    };
    c.finish()?;
    Ok(cache)
}

fn scheduler_section(s: &Fields, b: Option<&Config>) -> ConfigResult<SchedulerConfig> {
    let sched = SchedulerConfig {
        queued_requests_max: field!(s, b, scheduler.queued_requests_max, u32)?,
        pending_tokens_max: field!(s, b, scheduler.pending_tokens_max, u64)?,
        prefill_tokens_per_step_max: field!(s, b, scheduler.prefill_tokens_per_step_max, u32)?,
        running_requests_max: field!(s, b, scheduler.running_requests_max, u32)?,
        output_tokens_max: field!(s, b, scheduler.output_tokens_max, u32)?,
    };
    s.finish()?;
    Ok(sched)
}

/// One section's fields, consumed as they are read so that leftovers are reported as unknown.
struct Fields<'a> {
    section: &'static str,
    map: &'a Map<String, Value>,
    seen: std::cell::RefCell<Vec<&'static str>>,
}

impl<'a> Fields<'a> {
    /// Section `section` of the document (an absent section reads as empty).
    fn of(
        top: &'a Map<String, Value>,
        section: &'static str,
        empty: &'a Map<String, Value>,
    ) -> ConfigResult<Fields<'a>> {
        let map = match top.get(section) {
            None => empty,
            Some(Value::Object(m)) => m,
            Some(other) => {
                return Err(ConfigError::Type {
                    field: section,
                    expected: "a table",
                    found: kind(other),
                })
            }
        };
        Ok(Fields {
            section,
            map,
            seen: std::cell::RefCell::new(Vec::new()),
        })
    }
    fn get(&self, key: Key) -> Option<&'a Value> {
        self.seen.borrow_mut().push(key.name);
        self.map.get(key.name)
    }
    fn u64(&self, key: Key, default: Option<u64>) -> ConfigResult<u64> {
        let field = key.path;
        match self.get(key) {
            None => default.ok_or(ConfigError::Missing { field }),
            Some(v) => v.as_u64().ok_or_else(|| match v.as_i64() {
                Some(n) if n < 0 => ConfigError::Invalid {
                    field,
                    value: n.to_string(),
                    rule: "must not be negative".into(),
                },
                _ => ConfigError::Type {
                    field,
                    expected: "a non-negative integer",
                    found: kind(v),
                },
            }),
        }
    }
    fn u32(&self, key: Key, default: Option<u32>) -> ConfigResult<u32> {
        let v = self.u64(key, default.map(u64::from))?;
        u32::try_from(v).map_err(|_| ConfigError::Invalid {
            field: key.path,
            value: v.to_string(),
            rule: "must fit in 32 bits".into(),
        })
    }
    fn f64(&self, key: Key, default: Option<f64>) -> ConfigResult<f64> {
        match self.get(key) {
            None => default.ok_or(ConfigError::Missing { field: key.path }),
            Some(v) => v.as_f64().ok_or_else(|| ConfigError::Type {
                field: key.path,
                expected: "a number",
                found: kind(v),
            }),
        }
    }
    fn name<T>(
        &self,
        key: Key,
        expected: &'static [&'static str],
        parse: impl Fn(&str) -> Option<T>,
        default: Option<T>,
    ) -> ConfigResult<T> {
        match self.get(key) {
            None => default.ok_or(ConfigError::Missing { field: key.path }),
            Some(Value::String(s)) => parse(s).ok_or_else(|| ConfigError::UnknownName {
                field: key.path,
                value: s.clone(),
                expected,
            }),
            Some(v) => Err(ConfigError::Type {
                field: key.path,
                expected: "a string",
                found: kind(v),
            }),
        }
    }
    /// Fails on any key nobody asked for (a typo must not be silently ignored — incident 3).
    fn finish(&self) -> ConfigResult<()> {
        let seen = self.seen.borrow();
        for k in self.map.keys() {
            if !seen.contains(&k.as_str()) {
                return Err(ConfigError::UnknownField {
                    field: format!("{}.{k}", self.section),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;

/// Fuzz body (`fuzz/fuzz_targets/config.rs`): any bytes, as TOML or JSON, give a configuration
/// that validates and round-trips, or a typed error — never a panic. The first byte picks the
/// format (even: TOML, odd: JSON); answers whether the rest parsed to a configuration.
pub fn fuzz_config(data: &[u8]) -> bool {
    let Some((&which, rest)) = data.split_first() else {
        return false;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return false;
    };
    let parsed = if which % 2 == 0 {
        Config::from_toml(text)
    } else {
        Config::from_json(text)
    };
    let Ok(c) = parsed else {
        return false;
    };
    c.validate().expect("a parsed configuration validates");
    let l = c.layout().expect("a valid configuration has a layout");
    assert!(l.host_tokens().0 > l.device_tokens().0);
    assert_eq!(Config::from_toml(&c.to_toml()).expect("round trip"), c);
    true
}
