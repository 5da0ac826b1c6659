//! Reads: the commit objects (`commits`), what a commit stands for and the checks a step passes
//! (`step`), listings and summaries (`listing`), restores (`restore`), ranged
//! reads of a global step (`pieces`, and `local` for a directory bucket),
//! and `verify`.

pub(crate) mod commits;
pub(crate) mod listing;
pub(crate) mod local;
pub(crate) mod pieces;
pub(crate) mod restore;
pub(crate) mod step;
pub(crate) mod verify;
