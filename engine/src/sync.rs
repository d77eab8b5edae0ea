//! The engine's one seam for cross-thread synchronisation (like `tokio/src/loom/`): std in
//! production, loom under `cfg(tierkv_loom)` so the production runtime's cross-thread primitives
//! can be model-checked. Outside the production runtime (`runtime/`, which holds cudarc's handles
//! in `Arc`s), nothing else in the engine names `std::sync` primitives shared across threads
//! (`engine/tests/it/architecture.rs` checks the rest of the crate).
//!
//! The cfg is `tierkv_loom`, not `loom`: `--cfg loom` would also switch tokio (a dependency) into
//! its own loom mode, which does not build outside tokio's tests.
//!
//! ```text
//! RUSTFLAGS="--cfg tierkv_loom" cargo test -p tierkv-engine --lib loom
//! ```
//!
//! The models run only with debug assertions (the dev profile, as above): a release build drops
//! the arithmetic overflow checks and any `debug_assert!` of the code under the model, so a
//! model could report a pass that the dev profile would stop. A loom build without debug
//! assertions does not compile.

#[cfg(all(tierkv_loom, not(debug_assertions)))]
compile_error!(
    "the loom models need debug assertions: run them in the dev profile \
     (RUSTFLAGS=\"--cfg tierkv_loom\" cargo test -p tierkv-engine --lib loom), not --release"
);

#[cfg(not(tierkv_loom))]
pub use std::sync::{
    atomic::{AtomicBool, AtomicU64, Ordering},
    Arc, Condvar, Mutex,
};

#[cfg(tierkv_loom)]
pub use loom::sync::{
    atomic::{AtomicBool, AtomicU64, Ordering},
    Arc, Condvar, Mutex,
};

/// `UnsafeCell` with loom's closure API (loom tracks every access through it).
pub mod cell {
    #[cfg(tierkv_loom)]
    pub use loom::cell::UnsafeCell;

    #[cfg(not(tierkv_loom))]
    #[derive(Debug, Default)]
    pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    #[cfg(not(tierkv_loom))]
    impl<T> UnsafeCell<T> {
        pub fn new(v: T) -> Self {
            UnsafeCell(std::cell::UnsafeCell::new(v))
        }
        pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }
        pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }
}
