//! The library's API: commits, reads, listing, retention, async commits, options.

#![allow(clippy::cast_possible_truncation)] // test sizes and indices are small; 64-bit only

#[path = "../common/mod.rs"]
mod common;

mod async_commits;
mod async_copy_commits_the_state_as_passed;
mod commit_get_roundtrip;
mod consolidate;
mod copy_a_store;
mod create_is_atomic;
mod dedup_accounting;
mod duplicate_step_is_refused;
mod graph_model;
mod handed_on_ranges;
mod hashed_copies;
mod large_commits_stage_their_chunks;
mod latest_and_listing;
mod lost_pack_files;
mod pack_files;
mod ranged_reads;
mod read_only_open;
mod remove_and_rollback;
mod retention_policies;
mod save_is_durable_and_clean;
mod save_records;
mod space_stays_bounded;
mod steps_of_files;
mod store_options;
mod tensors;
mod threads;
