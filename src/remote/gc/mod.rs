//! Retention and garbage collection under the lock protocol (`retention`).

pub(crate) mod retention;
