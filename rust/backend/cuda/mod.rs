//! The CUDA driver backend, on `cudarc`'s raw driver bindings.
//!
//! This is the only module that makes driver calls. The driver library is opened at run time
//! (`dlopen`), so the crate builds and the host backend runs where there is no driver; every symbol
//! this backend calls is looked up before the first call, so a missing one is an error, never a
//! panic. The batch copy entry point is resolved through `cuGetProcAddress` with the ABI version
//! the installed driver offers: `cuMemcpyBatchAsync` of CUDA 12.8 (with `failIdx`) or the 13.0
//! `_v2` ABI (without it). Never at compile time. A loop of `cuMemcpyAsync` is the fallback.
//!
//! Each direction has its own non-blocking stream (or a stream the caller names; never the legacy
//! default stream). After a transfer's copies the stream writes the transfer's sequence number into
//! mapped pinned memory (`cuStreamWriteValue64`), which polls read with an atomic load; where the
//! device has no stream memory operations, a ring of events is queried instead.
//!
//! The rooms, each using only those listed before it: `driver` loads the library and resolves
//! its entry points, `options` holds what a backend is made with, `query` the queries for code
//! outside the backends, `resources` the driver resources each freed by its own `Drop`, `stage`
//! the staged plan's resources, `lane` each direction's stream, completion state and queue,
//! `shared` the driver state the backend shares with its issuing threads, `worker` a lane's
//! issuing thread and completion queries, `copy` a transfer's copies, `staged` the staged plan's
//! issuing, `backend` the [`CudaBackend`].

mod backend;
mod copy;
mod driver;
mod lane;
mod options;
mod query;
mod resources;
mod shared;
mod stage;
mod staged;
mod worker;

pub use backend::CudaBackend;
pub use driver::driver_available;
pub use options::{
    AccessOrder, CompletionMode, CopyPath, CudaOptions, DEFAULT_KEEP_WARM, DEFAULT_MAX_BATCH,
    KEEP_WARM_EVERY, MAX_KEEP_WARM,
};
pub use query::{host_device_pointer, memcpy, memory_kind};
pub use resources::HostPinner;
pub use shared::Shared;

// Miri cannot dlopen a driver (or probe for one).
#[cfg(all(test, not(miri)))]
mod tests;
