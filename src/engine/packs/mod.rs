//! Pack files in a transaction: the writer a large commit hands its new
//! chunks to, the tables that record them, and the reader that reads a
//! chunk straight into its place ([`crate::format::packs`] is the layout),
//! all over one file-system seam ([`io::PackIo`]).

#[cfg(test)]
pub(crate) mod faults;
pub(crate) mod io;
mod read;
mod tables;
mod writer;

pub(crate) use io::PackDir;
pub(crate) use read::{is_missing_pack, missing_pack, PackReader};
pub(crate) use tables::{recorded_packs, sweep_unrecorded, unrecorded, PackTables};
pub(crate) use writer::PackWriter;
