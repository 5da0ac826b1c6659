//! Retention and garbage collection under the lock protocol (`retention`),
//! and the rewrite of packs that are mostly dead (`repack`).

pub(crate) mod repack;
pub(crate) mod retention;
