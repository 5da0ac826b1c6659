//! Writes: a store's push (`push`, and `push_known` when the store
//! remembers the bucket), a shard's pack objects and the memory of what
//! they hold (`packs`), and background replication (`replicate`).

pub(crate) mod packs;
pub(crate) mod push;
pub(crate) mod push_known;
pub(crate) mod replicate;
