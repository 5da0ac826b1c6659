//! The stores this process has open for writing, by real path: a second
//! writable open of one is refused with [`Error::AlreadyOpen`] before
//! redb's file lock answers (which cannot tell this process from
//! another).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::{Error, Result};

/// Real path -> the process that registered it (a forked child inherits
/// the map, not the handles).
static OPEN: Mutex<Option<HashMap<PathBuf, u32>>> = Mutex::new(None);

/// This process's claim on a store path, released on drop.
pub(crate) struct Registered(PathBuf);

/// Register `path` as open for writing here.
pub(crate) fn register(path: &Path) -> Result<Registered> {
    let mut open = OPEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let open = open.get_or_insert_with(HashMap::new);
    if open.get(path) == Some(&std::process::id()) {
        return Err(Error::AlreadyOpen {
            path: path.to_owned(),
        });
    }
    open.insert(path.to_owned(), std::process::id());
    Ok(Registered(path.to_owned()))
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut open = OPEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(open) = open.as_mut() {
            if open.get(&self.0) == Some(&std::process::id()) {
                open.remove(&self.0);
            }
        }
    }
}
