//! The transfer lifecycle.
//!
//! ```text
//! Pending --submit--> Submitted --complete(ok)--> Done
//!    |                    `-----complete(err)--> Failed
//!    `---cancel---> Cancelled
//! ```
//!
//! `Pending` is a transfer being validated and written into its slab; nothing has been issued.
//! A transfer refused there is `Cancelled` and its error goes back to the caller of submit.
//! Every other edge is refused with a [`TransitionError`]. Done, Failed and Cancelled are final.

use std::fmt;

/// A caller's name for a transfer. Live at most once at a time.
pub type JobId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferState {
    Pending,
    Submitted,
    Done,
    Failed,
    Cancelled,
}

impl TransferState {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            TransferState::Pending => "pending",
            TransferState::Submitted => "submitted",
            TransferState::Done => "done",
            TransferState::Failed => "failed",
            TransferState::Cancelled => "cancelled",
        }
    }

    /// Done, Failed or Cancelled.
    #[must_use]
    pub fn is_final(self) -> bool {
        matches!(
            self,
            TransferState::Done | TransferState::Failed | TransferState::Cancelled
        )
    }

    fn to(self, to: TransferState) -> Result<TransferState, TransitionError> {
        use TransferState::{Cancelled, Done, Failed, Pending, Submitted};
        match (self, to) {
            (Pending, Submitted | Cancelled) | (Submitted, Done | Failed) => Ok(to),
            (from, to) => Err(TransitionError { from, to }),
        }
    }

    /// Pending -> Submitted.
    pub fn submit(self) -> Result<TransferState, TransitionError> {
        self.to(TransferState::Submitted)
    }

    /// Submitted -> Done (`ok`) or Failed.
    pub fn complete(self, ok: bool) -> Result<TransferState, TransitionError> {
        self.to(if ok {
            TransferState::Done
        } else {
            TransferState::Failed
        })
    }

    /// Pending -> Cancelled.
    pub fn cancel(self) -> Result<TransferState, TransitionError> {
        self.to(TransferState::Cancelled)
    }
}

impl fmt::Display for TransferState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An edge the lifecycle does not have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransitionError {
    pub from: TransferState,
    pub to: TransferState,
}

impl fmt::Display for TransitionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a transfer cannot go from {} to {}", self.from, self.to)
    }
}

impl std::error::Error for TransitionError {}

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

#[cfg(test)]
mod tests {
    use super::TransferState::*;
    use super::*;

    const ALL: [TransferState; 5] = [Pending, Submitted, Done, Failed, Cancelled];

    #[test]
    fn legal_edges() {
        assert_eq!(Pending.submit(), Ok(Submitted));
        assert_eq!(Pending.cancel(), Ok(Cancelled));
        assert_eq!(Submitted.complete(true), Ok(Done));
        assert_eq!(Submitted.complete(false), Ok(Failed));
    }

    #[test]
    fn every_other_edge_is_refused() {
        let legal = [
            (Pending, Submitted),
            (Pending, Cancelled),
            (Submitted, Done),
            (Submitted, Failed),
        ];
        let mut refused = 0;
        for from in ALL {
            for to in ALL {
                let r = from.to(to);
                if legal.contains(&(from, to)) {
                    assert_eq!(r, Ok(to));
                } else {
                    assert_eq!(r, Err(TransitionError { from, to }), "{from} -> {to}");
                    refused += 1;
                }
            }
        }
        assert_eq!(refused, 21);
        // The named transitions refuse the same way.
        assert_eq!(
            Submitted.submit(),
            Err(TransitionError {
                from: Submitted,
                to: Submitted
            })
        );
        assert_eq!(
            Submitted.cancel(),
            Err(TransitionError {
                from: Submitted,
                to: Cancelled
            })
        );
        assert_eq!(
            Done.complete(true),
            Err(TransitionError {
                from: Done,
                to: Done
            })
        );
        assert_eq!(
            Pending.complete(false),
            Err(TransitionError {
                from: Pending,
                to: Failed
            })
        );
        assert_eq!(
            Cancelled.submit(),
            Err(TransitionError {
                from: Cancelled,
                to: Submitted
            })
        );
        for s in ALL {
            assert_eq!(s.is_final(), matches!(s, Done | Failed | Cancelled));
        }
    }
}
