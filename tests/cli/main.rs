//! The `ckpt` command-line tool.

#![allow(clippy::cast_possible_truncation)] // test sizes and indices are small; 64-bit only

#[path = "../common/mod.rs"]
mod common;

mod bench;
mod export_import;
mod hardening;
mod inspect;
mod manage;
mod reads_live_store;
mod safetensors;
mod steps_of_files;
mod verify_exit_codes;
