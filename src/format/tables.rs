//! Table definitions, `meta` keys, and the checks and changes of a whole
//! store's format: creation, recognition, upgrade from format 1.

use std::path::Path;

use redb::{ReadTransaction, ReadableTable, TableDefinition, TableHandle, WriteTransaction};

use crate::error::StorageContext;
use crate::{Error, Result};

/// The newest store and manifest format this build reads.
pub(crate) const FORMAT_VERSION: u32 = 6;
/// The format of a store's tables (chunks by id): what a new store is and
/// what a format 1 store is upgraded to when opened for writing.
pub(crate) const TABLES_FORMAT: u32 = 2;
/// The format a store is marked with by its first step with tensors
/// (format 3 manifests, which older builds refuse).
pub(crate) const TENSOR_FORMAT: u32 = 3;
/// The format a store is marked with once it remembers what it replicated
/// (the `replica_*` tables): older builds would replace or remove a step
/// without forgetting that its old content was replicated.
#[cfg_attr(not(feature = "remote"), allow(dead_code))]
pub(crate) const REPLICA_FORMAT: u32 = 4;
/// The format a store is marked with by its first pack file
/// ([`super::packs`]): older builds would find the chunks in it missing.
pub(crate) const PACK_FORMAT: u32 = 5;
/// The format a store is marked with by its first step with a save record
/// (format 4 manifests, which older builds refuse).
pub(crate) const RECORD_FORMAT: u32 = 6;

/// Store-wide facts and counters, under the `META_*` keys below.
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
/// Step number -> manifest.
pub(crate) const STEPS: TableDefinition<u64, &[u8]> = TableDefinition::new("steps");
/// Chunk id -> chunk bytes. Ids are given out in ascending order, so a
/// commit appends its chunks at the right edge of the b-tree: redb never
/// reads an older chunk's page to find where a new one goes.
pub(crate) const CHUNK_DATA: TableDefinition<u64, &[u8]> = TableDefinition::new("chunk_data");
/// Chunk hash -> (chunk id, uses by manifests): the content-addressed
/// index, with small entries only. A chunk with 0 uses is staged.
pub(crate) const CHUNK_INDEX: TableDefinition<&[u8; 32], (u64, u64)> =
    TableDefinition::new("chunk_index");
/// Chunk id -> where the chunk's bytes are in a pack file (an encoded
/// [`PackLoc`](super::packs::PackLoc)), for chunks not in `chunk_data`.
pub(crate) const PACK_CHUNKS: TableDefinition<u64, &[u8]> = TableDefinition::new("pack_chunks");
/// Pack file id -> (its length, the bytes of it live chunks use).
pub(crate) const PACK_FILES: TableDefinition<u32, (u64, u64)> = TableDefinition::new("pack_files");
/// Step number -> summary record ([`super::summary`]): what listings,
/// retention and metric queries read instead of whole manifests.
pub(crate) const SUMMARIES: TableDefinition<u64, &[u8]> = TableDefinition::new("summaries");
/// `(step, piece)` -> a piece of the step's packed small blobs.
pub(crate) const PACKED: TableDefinition<(u64, u32), &[u8]> = TableDefinition::new("packed");
/// Pinned steps: never deleted by retention, remove or rollback.
pub(crate) const PINS: TableDefinition<u64, ()> = TableDefinition::new("pins");

/// Bucket URL -> the bucket's collection mark when the store last listed
/// it: what the store remembers of that bucket (the two tables below)
/// holds while the bucket's mark is the same.
pub(crate) const REPLICA_MARKS: TableDefinition<&str, &[u8]> =
    TableDefinition::new("replica_marks");
/// `(bucket URL, step)` -> the bucket's newest commit of the step
/// (generation u64 little endian, manifest hash) and whether it holds this
/// store's version of the step whole (1) or not (0). Forgotten when the
/// store removes or replaces the step.
pub(crate) const REPLICA_STEPS: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new("replica_steps");
/// `(bucket URL, chunk hash)`: chunks the store knows the bucket holds.
#[cfg_attr(not(feature = "remote"), allow(dead_code))]
pub(crate) const REPLICA_CHUNKS: TableDefinition<(&str, &[u8; 32]), ()> =
    TableDefinition::new("replica_chunks");

/// Format 1: chunk hash -> chunk bytes. Read, and emptied as steps go, in
/// stores written by 0.1; never written to since.
pub(crate) const LEGACY_CHUNKS: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("chunks");
/// Format 1: chunk hash -> number of references.
pub(crate) const LEGACY_REFS: TableDefinition<&[u8; 32], u64> = TableDefinition::new("refs");

/// Tables every store has, whatever its format.
const COMMON_TABLES: [&str; 5] = ["meta", "steps", "summaries", "pins", "packed"];
/// Chunk tables of format 2 ([`CHUNK_DATA`], [`CHUNK_INDEX`]).
const CHUNK_TABLES: [&str; 2] = ["chunk_data", "chunk_index"];
/// Chunk tables of format 1 ([`LEGACY_CHUNKS`], [`LEGACY_REFS`]).
const LEGACY_TABLES: [&str; 2] = ["chunks", "refs"];

/// `meta`: the store's format version (u32, little endian).
pub(crate) const META_FORMAT: &str = "format_version";
/// `meta`: the store's UUID (text).
pub(crate) const META_STORE_ID: &str = "store_id";
/// `meta`: creation time (u64 Unix seconds, little endian).
pub(crate) const META_CREATED: &str = "created_at";
/// `meta`: bytes held in chunks and packed blobs (u64, little endian).
pub(crate) const META_STORED_BYTES: &str = "stored_bytes";
/// `meta`: number of chunks, staged ones excluded (u64, little endian).
pub(crate) const META_STORED_CHUNKS: &str = "stored_chunks";
/// `meta`: the next chunk id to give out (u64, little endian).
pub(crate) const META_NEXT_CHUNK: &str = "next_chunk_id";
/// `meta`: the next pack file id to give out (u64, little endian).
pub(crate) const META_NEXT_PACK: &str = "next_pack_id";
/// `meta`: the tag in the header of every pack file this store writes (16
/// bytes, an owner tag of `format::packs`); written with the first pack
/// file that has a header.
pub(crate) const META_PACK_OWNER: &str = "pack_owner";

/// `meta`: present while a commit stages chunks; a writable open that finds
/// it deletes the staged chunks (an interrupted commit's).
pub(crate) const META_STAGING: &str = "staging";

/// The store's format version (0 when absent or malformed).
pub(crate) fn meta_format(meta: &impl ReadableTable<&'static str, &'static [u8]>) -> Result<u32> {
    Ok(meta
        .get(META_FORMAT)
        .context(|| "reading the format version from table meta".to_owned())?
        .and_then(|v| <[u8; 4]>::try_from(v.value()).ok())
        .map_or(0, u32::from_le_bytes))
}

/// A `u64` of the `meta` table (0 when absent or malformed).
pub(crate) fn meta_u64(
    meta: &impl ReadableTable<&'static str, &'static [u8]>,
    key: &str,
) -> Result<u64> {
    Ok(meta
        .get(key)
        .context(|| format!("reading {key} from table meta"))?
        .and_then(|v| <[u8; 8]>::try_from(v.value()).ok())
        .map_or(0, u64::from_le_bytes))
}

/// Make an empty database a store of the current format.
pub(crate) fn create_tables(txn: &WriteTransaction, what: &dyn Fn() -> String) -> Result<()> {
    let mut meta = txn.open_table(META).context(what)?;
    meta.insert(META_FORMAT, TABLES_FORMAT.to_le_bytes().as_slice())
        .context(what)?;
    let id = uuid::Uuid::new_v4().to_string();
    meta.insert(META_STORE_ID, id.as_bytes()).context(what)?;
    let now = crate::file::unix_now();
    meta.insert(META_CREATED, now.to_le_bytes().as_slice())
        .context(what)?;
    txn.open_table(STEPS).context(what)?;
    txn.open_table(SUMMARIES).context(what)?;
    txn.open_table(PINS).context(what)?;
    txn.open_table(PACKED).context(what)?;
    txn.open_table(CHUNK_DATA).context(what)?;
    txn.open_table(CHUNK_INDEX).context(what)?;
    Ok(())
}

/// Mark a format 1 store as format 2 and add the tables it lacks.
pub(crate) fn upgrade_to_current(txn: &WriteTransaction, what: &dyn Fn() -> String) -> Result<()> {
    txn.open_table(META)
        .context(what)?
        .insert(META_FORMAT, TABLES_FORMAT.to_le_bytes().as_slice())
        .context(what)?;
    txn.open_table(CHUNK_DATA).context(what)?;
    txn.open_table(CHUNK_INDEX).context(what)?;
    Ok(())
}

/// What a database holds, as far as ckptstore is concerned.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// No table at all: a database just created.
    Empty,
    /// A store of this format version (at most [`FORMAT_VERSION`]).
    Store(u32),
}

/// Check that a database is empty or a store of a format this build reads.
///
/// # Errors
/// [`Error::NotAStore`] for any other database, [`Error::UnsupportedFormat`]
/// for a newer store.
pub(crate) fn check_tables(path: &Path, txn: &ReadTransaction) -> Result<Found> {
    let ctx = || format!("listing tables of {}", path.display());
    let names: Vec<String> = txn
        .list_tables()
        .context(ctx)?
        .map(|t| t.name().to_owned())
        .collect();
    if names.is_empty() {
        return Ok(Found::Empty);
    }
    let not_a_store = |reason: String| Error::NotAStore {
        path: path.to_owned(),
        reason,
    };
    if !names.iter().any(|n| n == META.name()) {
        return Err(not_a_store("it has no meta table".into()));
    }
    let meta = txn
        .open_table(META)
        .context(|| format!("reading table meta of {}", path.display()))?;
    let version = meta
        .get(META_FORMAT)
        .context(|| format!("reading table meta of {}", path.display()))?
        .ok_or_else(|| not_a_store("its meta table has no format version".into()))?;
    let bytes: [u8; 4] = version
        .value()
        .try_into()
        .map_err(|_| not_a_store("its format version is not 4 bytes".into()))?;
    let found = u32::from_le_bytes(bytes);
    if found > FORMAT_VERSION {
        return Err(Error::UnsupportedFormat {
            what: format!("store {}", path.display()),
            found,
            supported: FORMAT_VERSION,
        });
    }
    let chunk_tables = if found < 2 {
        LEGACY_TABLES
    } else {
        CHUNK_TABLES
    };
    for table in COMMON_TABLES.iter().chain(&chunk_tables) {
        if !names.iter().any(|n| n == table) {
            return Err(not_a_store(format!("table {table} is missing")));
        }
    }
    Ok(Found::Store(found))
}
