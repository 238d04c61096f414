//! [`EngineError`]: everything the engine refuses, wrapping each layer's typed error.

use std::fmt;

use super::ConfigError;
use crate::backend::BackendError;
use crate::descriptor::DescriptorError;
use crate::direction::Direction;
use crate::pool::PoolError;
use crate::region::RegionError;
use crate::table::TableError;
use crate::transfer::JobId;

/// Everything submit, wait and registration can refuse.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineError {
    Descriptor(DescriptorError),
    Region(RegionError),
    Pool(PoolError),
    Backend(BackendError),
    Table(TableError),
    /// A setting outside its limits, refused when the engine is made.
    Config(ConfigError),
    /// The job id names a transfer whose result has not been reported yet.
    JobIdLive(JobId),
    /// Too many transfers in flight on one direction.
    TooManyInFlight {
        direction: Direction,
        max: usize,
    },
    /// `wait` ran out of time; these jobs were not finished.
    Timeout {
        pending: Vec<JobId>,
    },
    /// The engine was shut down.
    ShutDown,
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineError::Descriptor(e) => e.fmt(f),
            EngineError::Region(e) => e.fmt(f),
            EngineError::Pool(e) => e.fmt(f),
            EngineError::Backend(e) => e.fmt(f),
            EngineError::Table(e) => e.fmt(f),
            EngineError::Config(e) => e.fmt(f),
            EngineError::JobIdLive(id) => {
                write!(
                    f,
                    "job id {id} is still live: its result has not been reported yet"
                )
            }
            EngineError::TooManyInFlight { direction, max } => write!(
                f,
                "{max} {direction} transfers are in flight or finished but not yet polled (call \
                 get_finished, or raise max_in_flight)"
            ),
            EngineError::Timeout { pending } => {
                write!(
                    f,
                    "wait timed out with {} jobs unfinished: {pending:?}",
                    pending.len()
                )
            }
            EngineError::ShutDown => f.write_str("the engine is shut down"),
        }
    }
}

impl std::error::Error for EngineError {}

macro_rules! from_error {
    ($($ty:ident => $variant:ident),*) => {$(
        impl From<$ty> for EngineError {
            fn from(e: $ty) -> Self {
                EngineError::$variant(e)
            }
        }
    )*};
}
from_error!(DescriptorError => Descriptor, RegionError => Region, PoolError => Pool,
    BackendError => Backend, TableError => Table,
    ConfigError => Config);
