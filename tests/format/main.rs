//! File formats: format 1 stores, newer formats, bad files, the seed's JSON, the chunk accounting model.

#![allow(clippy::cast_possible_truncation)] // test sizes and indices are small; 64-bit only

#[path = "../common/mod.rs"]
mod common;

mod format1_store_still_opens;
mod newer_format_is_refused;
mod open_rejects_bad_files;
mod refcounts_match_a_model;
mod seed_file_format;
mod seed_json_fuzz;
