//! blockswap: move many small blocks between pinned host memory and GPU memory at the speed of the
//! `PCIe` link.
//!
//! The crate is the core of the `blockswap` Python package, and a plain Rust library as well:
//! `cargo test` needs neither Python nor a GPU. The layers, from the bottom:
//!
//! - [`fork`]: the count of forks this process descends through, which every object holding
//!   driver state or pinned memory compares with the count it was made under;
//! - [`direction`]: the four directions, each an ordered lane;
//! - [`descriptor`]: validation and coalescing of `(src, dst, size)` batches;
//! - [`region`]: the memory blockswap knows about; every address of a transfer must lie in it;
//! - [`plan`]: the three routes a transfer may take, one enum at every layer;
//! - [`kernel`]: the copy kernels the core launches or hands a batch to;
//! - [`table`]: block tables, for transfers named by block ids, and their expansion by route;
//! - [`hostmem`]: exactly sized host buffers for CPU caches, page-locked in pieces;
//! - [`slab`]: backends' host allocations, and the descriptor slab a transfer owns with the
//!   backend's handle on it in flight;
//! - [`pool`]: reused descriptor slabs (page-locked on CUDA), never reused while in flight;
//! - [`transfer`]: a transfer's job id and its result;
//! - [`completion`]: lock-free completion polling over per-lane sequence numbers;
//! - [`backend`]: the host (memcpy) backend and the CUDA driver backend;
//! - [`engine`]: submit / poll / wait / shutdown over a backend.
//!
//! The `PyO3` bindings live in `py.rs`, behind the `python` feature that maturin enables.

pub mod affinity;
pub mod backend;
pub mod completion;
pub mod descriptor;
pub mod direction;
pub mod engine;
pub mod error;
pub mod fork;
pub mod hostmem;
pub mod kernel;
pub mod plan;
pub mod pool;
pub mod region;
pub mod slab;
mod sync;
pub mod table;
pub mod transfer;

#[cfg(feature = "python")]
mod py;

pub use backend::{Backend, BackendError, BackendInfo};
pub use direction::Direction;
pub use engine::{Engine, EngineConfig, EngineError, EngineStats};
pub use region::MemoryKind;
pub use transfer::{JobId, TransferResult};
