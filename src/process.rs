//! Which process a handle belongs to. A child made by `fork()` inherits
//! the parent's handles but not its threads, and shares its file locks: a
//! handle used (or dropped) there must neither write nor close anything.

use crate::{Error, Result};

/// The process that opened a handle.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owner(u32);

impl Owner {
    /// This process.
    pub(crate) fn current() -> Owner {
        Owner(std::process::id())
    }

    /// Whether this is another process than the owner (a forked child).
    pub(crate) fn forked(self) -> bool {
        std::process::id() != self.0
    }

    /// Refuse work in a forked child; `what` names the handle.
    pub(crate) fn check(self, what: &dyn Fn() -> String) -> Result<()> {
        if self.forked() {
            return Err(Error::Forked {
                what: what(),
                opened_by: self.0,
                this: std::process::id(),
            });
        }
        Ok(())
    }
}
