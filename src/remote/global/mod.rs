//! Global steps of N ranks: shards that complete a step by themselves
//! (`shards`), steps a coordinator completes (`coordinated`), and DCP's
//! metadata over them (`dcp`).

pub(crate) mod coordinated;
pub(crate) mod dcp;
pub(crate) mod shards;
