//! Faults injected into pack file writes, for the tests of what a failed
//! write or fsync leaves (`store::pack_faults`).

use std::cell::Cell;
use std::path::Path;

use crate::{PackError, PackOp, Result};

/// Which call fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    Write,
    Sync,
    /// The fsync of the pack directory (the new file's entry).
    SyncDir,
}

thread_local! {
    static NEXT: Cell<Option<Fault>> = const { Cell::new(None) };
}

/// Make the next `fault` call of this thread fail.
pub(crate) fn arm(fault: Fault) {
    NEXT.with(|n| n.set(Some(fault)));
}

/// Fail here if this is the armed call.
pub(crate) fn strike(fault: Fault, op: PackOp, path: &Path) -> Result<()> {
    if NEXT.with(Cell::get) == Some(fault) {
        NEXT.with(|n| n.set(None));
        return Err(PackError::io(op, path, std::io::Error::other("injected fault")).into());
    }
    Ok(())
}
