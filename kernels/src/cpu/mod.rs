//! The CPU references: each kernel's specification, plain Rust over byte slices in the DESIGN §3
//! layouts. The CUDA kernels must agree with these bit for bit (logits included: the reference
//! uses the CUDA kernel's operation order). The simulator runs every kernel through these.

pub mod draw;
pub mod logits;
pub mod numerics;
pub mod page_copy;
pub mod q_prep;
pub mod sparse_read;
pub mod store;
pub mod topk;

pub use logits::{index_logits, index_logits_from_pages, IndexLogitsArgs, KeyBlock, PageKeys};
pub use page_copy::{check_page_copy, page_copy};
pub use q_prep::{q_prep, QPrepArgs};
pub use sparse_read::{row_hash, sparse_read, sparse_read_hashed, SparseReadArgs};
pub use store::{index_k_store, kv_store, IndexKStoreArgs, KvStoreArgs};
pub use topk::{topk, TopKArgs};
