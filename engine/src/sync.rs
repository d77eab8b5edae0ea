//! The engine's one seam for cross-thread synchronisation (like `tokio/src/loom/`): std in
//! production, loom under `cfg(loom)` so the production runtime's cross-thread primitives can be
//! model-checked. Nothing else in the engine names `std::sync` primitives shared across threads.

#[cfg(not(loom))]
pub use std::sync::{
    atomic::{AtomicBool, AtomicU64, Ordering},
    Arc, Condvar, Mutex,
};

#[cfg(loom)]
pub use loom::sync::{
    atomic::{AtomicBool, AtomicU64, Ordering},
    Arc, Condvar, Mutex,
};
