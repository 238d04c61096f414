//! The error types of each layer, gathered into one enum for callers that want a single type.
//!
//! Every layer has its own typed error ([`DescriptorError`], [`RegionError`], [`PoolError`],
//! [`BackendError`], [`TableError`] and [`ConfigError`] for engine settings);
//! [`EngineError`](crate::engine::EngineError) wraps them and the Python bindings map each variant
//! to one exception class.

pub use crate::backend::BackendError;
pub use crate::descriptor::DescriptorError;
pub use crate::engine::ConfigError;
pub use crate::pool::PoolError;
pub use crate::region::RegionError;
pub use crate::table::TableError;
