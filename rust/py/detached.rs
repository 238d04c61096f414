//! [`DropDetached`]: a pyclass's value dropped with the GIL released.

use std::mem::ManuallyDrop;
use std::ops::Deref;

use pyo3::prelude::*;

/// A value whose drop may wait (an engine's drains its transfers and takes the process-wide
/// host-buffer table's lock; a host buffer's takes that lock, then unpins and unmaps), held by a
/// pyclass: dropped with the GIL released, so that every other Python thread runs meanwhile.
///
/// A pyclass's value is dropped by its `tp_dealloc` (a reference count reaching zero, or the
/// garbage collector, on whatever thread) or by a constructor that failed, both with the thread
/// attached; releasing the GIL there is what Python's own objects do (a file closed by its
/// dealloc). During the interpreter's finalization only the finalizing thread runs Python, and it
/// takes the GIL back as usual (other threads would exit or wait, but none holds the GIL then).
pub(super) struct DropDetached<T: Send>(ManuallyDrop<T>);

impl<T: Send> DropDetached<T> {
    pub(super) fn new(value: T) -> Self {
        Self(ManuallyDrop::new(value))
    }
}

impl<T: Send> Deref for DropDetached<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Send> Drop for DropDetached<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here, as the wrapper goes: nothing reads `self.0` afterwards.
        let value = unsafe { ManuallyDrop::take(&mut self.0) };
        // Where the thread cannot attach (it is not attached, and the interpreter is finalizing
        // or gone), `try_attach` drops the closure unrun, and the value with it: nothing to
        // release then.
        let _ = Python::try_attach(move |py| py.detach(move || drop(value)));
    }
}
