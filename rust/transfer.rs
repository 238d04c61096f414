//! The transfer lifecycle.
//!
//! A submit validates the transfer and writes its descriptors into a slab; a transfer refused
//! there never reaches the backend and its error goes back to the caller. An accepted transfer is
//! on its direction's lane from the moment it is issued, and `get_finished` reports it exactly
//! once, as done or failed ([`TransferResult`]). There is no other state: a record on a lane is a
//! submitted transfer by construction, so nothing checks edges at run time.

/// A caller's name for a transfer. Live at most once at a time.
pub type JobId = u64;

/// The outcome of one transfer, reported exactly once by `get_finished`.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferResult {
    pub job_id: JobId,
    pub success: bool,
    /// Bytes the transfer was asked to move.
    pub bytes: u64,
    /// Copy time: device time from timing events where the backend has them, worker time on the
    /// host backend, else the time from submission to observed completion.
    pub seconds: f64,
    /// Why it failed.
    pub error: Option<String>,
}
