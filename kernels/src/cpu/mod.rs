//! The CPU references: plain Rust over byte slices in the DESIGN §3 layouts, held to the
//! specification (`spec`). The CUDA kernels agree with them bit for bit (the exact logits kernel
//! included: the reference uses its operation order), except the tensor-core logits kernels,
//! held to 1e-5 of each logit's magnitude. The CPU device and the simulator's CPU executor run
//! every kernel through these.

pub mod draw;
pub mod logits;
pub mod numerics;
pub mod page_copy;
pub mod q_prep;
pub mod sparse_read;
pub mod store;
pub mod topk;

pub use logits::{index_logits, index_logits_from_pages, KeyBlock, PageKeys};
pub use page_copy::{check_page_copy, page_copy};
pub use q_prep::{q_prep, QPrepInputs};
pub use sparse_read::{row_hash, sparse_read, sparse_read_hashed};
pub use store::{index_k_store, kv_store, IndexKStoreInputs};
pub use topk::topk;
