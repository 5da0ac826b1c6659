//! The on-disk format: every table, every persisted record and its codec,
//! and what format 1 (ckptstore 0.1) left behind.
//!
//! | table         | key -> value                | holds                                        |
//! |---------------|-----------------------------|----------------------------------------------|
//! | `meta`        | `&str -> &[u8]`             | format version, store id, counters           |
//! | `steps`       | `u64 -> &[u8]`              | a step's manifest ([`manifest`])             |
//! | `chunk_data`  | `u64 -> &[u8]`              | chunk bytes by chunk id (ascending)          |
//! | `pack_chunks` | `u64 -> &[u8]`              | chunk id -> place in a pack file ([`packs`])  |
//! | `pack_files`  | `u32 -> (u64, u64)`         | pack file id -> (length, live bytes)         |
//! | `chunk_index` | `[u8; 32] -> (u64, u64)`    | BLAKE3 hash -> (chunk id, uses)              |
//! | `summaries`   | `u64 -> &[u8]`              | per step: time, metrics, sizes ([`summary`]) |
//! | `pins`        | `u64 -> ()`                 | steps retention and removal must not delete  |
//! | `packed`      | `(u64, u32) -> &[u8]`       | per step: its small blobs, concatenated      |
//! | `chunks`, `refs` | by hash                  | format 1's chunks and counts (read, emptied) |
//!
//! Format versions: 1 (ckptstore 0.1) wrote JSON manifests and kept chunks
//! by hash in `chunks`; 2 writes binary manifests and chunks by id, and reads
//! both. Opening a format 1 store for writing adds the format 2 tables and
//! marks it format 2 ([`upgrade_to_current`]), so that an older build refuses
//! it instead of misreading new steps. Its format 1 steps keep their chunks
//! where they are (new chunks are not deduplicated against them) until they
//! are removed.

mod codec;
pub(crate) mod layout;
pub(crate) mod manifest;
mod manifest_v1;
pub(crate) mod packs;
mod step;
pub(crate) mod summary;
pub(crate) mod tables;

pub(crate) use tables::{check_tables, create_tables, upgrade_to_current, FORMAT_VERSION};
