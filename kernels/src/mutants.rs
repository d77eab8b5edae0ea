//! Bugs planted in the CPU references and the layout module, for the simulator's self-test
//! (feature `mutants`). A bug in a reference is the hardest kind for a simulator whose executor
//! runs that reference: the reference mutants prove that the oracles judge by the specification
//! rather than by the reference, and that an op which writes or reads outside what it declares is
//! caught; the layout mutants, that the specification's own byte formats see a layout every
//! kernel agrees on.
//!
//! A thread switches one on for a run (`set`); the references ask `on`. Without the feature
//! `on` is a constant `false` and the planted code compiles away.

/// A planted reference bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelMutant {
    /// RoPE applied to dims 64..128 instead of 0..64 (in both the index-K store and `q_prep`).
    RopeWrongHalf,
    /// `kv_store` also writes the row after each stored slot: bytes the op never declared.
    KvStoreWritesNextRow,
    /// `index_logits` takes the key of each row's last position from the page after the one
    /// its page table names: bytes the op never declared it reads.
    LogitsReadsNextPage,
    /// The layout module places an fp8 index-K page's scales first and its values after them
    /// (the same page size): every kernel that goes through the layout agrees with every other,
    /// so only a check with a layout of its own can see it.
    IndexKScalesFirst,
    /// The layout module places the host mirror's pages in the other order (page-first for
    /// layer-first and back): the engine's copies and views agree, the design does not.
    HostOrderSwapped,
    /// `index_logits` reads an fp8 index-K page as token-interleaved (each token's 128 values
    /// and then its scale, 132 bytes a token) while the store writes it block-planar (every
    /// value, then every scale): the same 8448 bytes a page, so no size check can see it
    /// (the engine's zoo mutant `index-k-read-interleaved`, vllm-project/vllm#50576).
    LogitsReadsInterleaved,
}

impl KernelMutant {
    pub const ALL: [KernelMutant; 6] = [
        KernelMutant::RopeWrongHalf,
        KernelMutant::KvStoreWritesNextRow,
        KernelMutant::LogitsReadsNextPage,
        KernelMutant::IndexKScalesFirst,
        KernelMutant::HostOrderSwapped,
        KernelMutant::LogitsReadsInterleaved,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KernelMutant::RopeWrongHalf => "reference-rope-wrong-half",
            KernelMutant::KvStoreWritesNextRow => "reference-kv-store-writes-next-row",
            KernelMutant::LogitsReadsNextPage => "reference-logits-reads-next-page",
            KernelMutant::IndexKScalesFirst => "layout-index-k-scales-first",
            KernelMutant::HostOrderSwapped => "layout-host-order-swapped",
            KernelMutant::LogitsReadsInterleaved => "reference-logits-reads-interleaved",
        }
    }

    pub fn parse(s: &str) -> Option<KernelMutant> {
        KernelMutant::ALL.into_iter().find(|m| m.name() == s)
    }
}

#[cfg(feature = "mutants")]
thread_local! {
    static ACTIVE: std::cell::Cell<Option<KernelMutant>> = const { std::cell::Cell::new(None) };
}

/// Whether `m` is switched on for this thread.
#[inline]
pub fn on(m: KernelMutant) -> bool {
    #[cfg(feature = "mutants")]
    {
        ACTIVE.with(|a| a.get() == Some(m))
    }
    #[cfg(not(feature = "mutants"))]
    {
        let _ = m;
        false
    }
}

/// Switches `m` on for this thread (`None`: the clean references).
#[cfg(feature = "mutants")]
pub fn set(m: Option<KernelMutant>) {
    ACTIVE.with(|a| a.set(m));
}
