//! Crashes and faults: kill -9, power cuts, I/O errors, damaged files, readers in other processes.

#![allow(clippy::cast_possible_truncation)] // test sizes and indices are small; 64-bit only

#[path = "../common/mod.rs"]
mod common;

mod a_store_is_its_real_path;
mod concurrent_readers;
mod damaged_files_never_lie;
mod damaged_pack_files;
mod io_errors_are_recovered;
mod kill9_loses_nothing;
mod power_cut_loses_nothing;
mod readers_beside_a_writer_see_whole_steps;
mod recovery_is_quick;
