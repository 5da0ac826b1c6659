//! The node-local tier on disk (`ckptstore.dcp.Tiers`): every byte of a
//! node's tier directory and every rule about it, shared by the Python
//! package and the `ckpt` tool.
//!
//! A job of `W` ranks keeps each rank's shards in a store of its own on
//! its node's disk, copies of them on peer nodes, and, once every shard
//! and copy of a save is durable, a record of the save from every rank.
//! A node's directory:
//!
//! | name | what |
//! |---|---|
//! | `rank-RRRRR.ckpt` | rank R's own shards, one store step per step ([`StoreName`]) |
//! | `copies-of-RRRRR.ckpt` | copies of rank R's shards kept on this node |
//! | `records/step-<S:020>.rank-<R:05>.json` | rank R's [`Record`] of step S ([`RecordName`]) |
//! | `records/step-<S:020>.in-bucket` | the save of step S that is whole in the bucket ([`MarkName`]) |
//!
//! - [`TierDir`]: the directory: its stores, its records read as
//!   untrusted input, durable writes and removals, the in-bucket marks.
//! - [`Held`], [`pick`]: which saves the job's ranks can restore whole,
//!   the one to restore (the one made last) and who serves each shard:
//!   pure functions of what the ranks hold.
//! - [`retain`]: the steps a rank keeps after a save.
//!
//! The collectives that carry holdings and choices between ranks are the
//! Python package's; every rule they apply is here. The byte layout is in
//! docs/design.md ("The local tier").

mod choice;
mod dir;
mod names;
mod record;
#[cfg(test)]
mod tests;

pub use choice::{pick, retain, Evaluation, Held, Holding};
pub use dir::{Records, TierDir};
pub use names::{MarkName, NotOurs, RecordName, StoreKind, StoreName, MAX_RANKS, RECORDS};
pub use record::{Cost, Legacy, Record, SaveKey, MAX_RECORD_BYTES, RECORD_FORMAT};
