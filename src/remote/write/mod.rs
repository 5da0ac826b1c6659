//! Writes: a store's push (`push`, over `knowledge` of what the bucket
//! holds: the store's memory of it or a listing), pack objects (`packs`,
//! for pushes and shards alike), and background replication
//! (`replicate`).

pub(crate) mod knowledge;
pub(crate) mod packs;
pub(crate) mod push;
pub(crate) mod replicate;
