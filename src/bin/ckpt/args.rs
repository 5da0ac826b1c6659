//! The command line: subcommands, their arguments and flags.

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ckpt",
    version,
    about = "Inspect and manage ckptstore checkpoint stores",
    after_help = "Only `import` and `pull` create a store. `rm`, `gc` and `compact` change \
                  one; every other command only reads, beside a training run that writes.\n\
                  `ls`, `show`, `verify` and `gc` also take a bucket URL instead of a store: \
                  s3://BUCKET/PREFIX (credentials, endpoint and region from the AWS_* \
                  variables) or file:///DIR."
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// How long a request to a bucket that fails (a server down or
    /// restarting) is retried before the command fails, in seconds.
    #[arg(long, global = true, value_name = "SECS", default_value_t = 30)]
    pub(crate) retry_window: u64,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// List the steps: time, loss CID, metrics, size. Reads.
    Ls {
        /// The store file, a bucket URL, or a node's directory of a local
        /// tier (`ckptstore.dcp.Tiers`: its steps, shards and copies).
        store: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// For a bucket: also list global steps not complete, with the
        /// ranks missing.
        #[arg(long)]
        all: bool,
    },
    /// Show one step's manifest: graph summary, blobs and sizes. Reads.
    Show {
        /// The store file, or a bucket URL.
        store: String,
        /// A step number, or `latest`.
        step: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write one step to a file: safetensors (`.safetensors`) or the
    /// original JSON checkpoint format (any other name). A step that
    /// `ckptstore.dcp` saved in a bucket is consolidated: whole tensors
    /// under their fully qualified names. Reads.
    Export {
        /// The store file, or a bucket URL (a DCP step).
        store: String,
        /// A step number, or `latest`.
        step: String,
        /// The file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// The file's format, instead of guessing it from its name.
        #[arg(long, value_enum)]
        format: Option<Format>,
        /// For a DCP step, or with --hf: only the tensors whose names
        /// start with this, the prefix stripped (`model.` gives a model's
        /// state dict).
        #[arg(long)]
        prefix: Option<String>,
        /// Write a Hugging Face checkpoint into the directory --output
        /// (created if missing): safetensors shards and
        /// model.safetensors.index.json (one shard: model.safetensors).
        #[arg(long)]
        hf: bool,
        /// With --hf: the largest shard, as Hugging Face writes it
        /// (`5GB`, `500MB`, `2GiB`, or bytes).
        #[arg(long, default_value = "5GB", value_parser = parse_size, requires = "hf")]
        max_shard_size: u64,
        /// With --hf: cast floating tensors to this dtype (bf16, f16,
        /// f32); lossy when it narrows.
        #[arg(long, value_parser = parse_dtype, requires = "hf")]
        dtype: Option<ckptstore::Dtype>,
    },
    /// Commit checkpoints from files: JSON of the original format, or
    /// safetensors (`.safetensors`, with --step). Creates the store if it
    /// is missing (the only command that does).
    Import {
        /// The store file (created if missing).
        store: PathBuf,
        /// The files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Replace steps that are already stored.
        #[arg(long)]
        replace: bool,
        /// The step a safetensors file is stored as (one file only).
        #[arg(long)]
        step: Option<u64>,
        /// The files' format, instead of guessing it from their names.
        #[arg(long, value_enum)]
        format: Option<Format>,
    },
    /// Check every hash and reference count; exit 3 on any damage. Reads.
    Verify {
        /// The store file, a bucket URL, or a node's directory of a local
        /// tier (every shard and copy read, hash-checked and compared with
        /// the records).
        store: String,
        /// Also check redb's page checksums (reads the whole file; changes
        /// nothing).
        #[arg(long)]
        pages: bool,
    },
    /// Remove steps, all or none. Writes.
    Rm {
        /// The store file.
        store: PathBuf,
        /// The steps to remove.
        #[arg(required = true)]
        steps: Vec<u64>,
    },
    /// Apply a retention policy: keep what any rule keeps, delete the rest.
    /// Writes (reads only, with --dry-run). In a bucket, also deletes the
    /// chunks no remaining step needs (unless a push is in flight).
    Gc {
        /// The store file, or a bucket URL.
        store: String,
        /// Keep the N highest steps (N >= 1).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        keep_last: Option<u64>,
        /// Keep every step that is a multiple of N (N >= 1).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        keep_every: Option<u64>,
        /// Keep the last step of each interval of this many seconds.
        #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
        keep_one_per: Option<u64>,
        /// Keep the K best steps by a metric, as METRIC:K:min or METRIC:K:max (K >= 1).
        #[arg(long, value_name = "METRIC:K:min|max")]
        keep_best: Vec<String>,
        /// Show what would be deleted without deleting (reads only).
        #[arg(long)]
        dry_run: bool,
        /// For a bucket: collect unreferenced chunks older than this (and
        /// let a push's lock count this long; default 600).
        #[arg(long, value_name = "SECS")]
        grace_period: Option<u64>,
    },
    /// Copy a store (its file and its pack files) to a new store: every
    /// step, hash-checked. Safe while the store is being written. Reads.
    Cp {
        /// The store file.
        store: PathBuf,
        /// The new store (must not exist).
        to: PathBuf,
    },
    /// Hand free space in the file back to the filesystem. Writes.
    Compact {
        /// The store file.
        store: PathBuf,
        /// While other processes are reading the store, wait up to this
        /// many seconds for them to finish (default: fail at once).
        #[arg(long, value_name = "SECS", default_value_t = 0)]
        wait: u64,
    },
    /// Upload every step the bucket lacks (deduplicated by content;
    /// resumable: rerun after any failure). Reads the store.
    Push {
        /// The store file.
        store: PathBuf,
        /// The bucket: `s3://BUCKET/PREFIX` or `file:///DIR`.
        url: String,
        /// Take the prefix over from the store whose run it holds (a store
        /// restored from a backup, or a run continued by a new store).
        #[arg(long)]
        adopt: bool,
        /// List the bucket rather than trust what the store remembers of
        /// it: also repairs steps whose objects were deleted by hand.
        #[arg(long)]
        repair: bool,
        /// Store new chunks compressed where that saves bytes (bucket
        /// format 4, which builds before 0.5 cannot read): the default
        /// for `s3://`.
        #[arg(long, conflicts_with = "no_compress")]
        compress: bool,
        /// Store new chunks as they are (bucket format 3, which 0.4
        /// reads): the default for `file://`.
        #[arg(long)]
        no_compress: bool,
    },
    /// Copy a step from a bucket into a store (created if missing).
    Pull {
        /// The bucket: `s3://BUCKET/PREFIX` or `file:///DIR`.
        url: String,
        /// The store file (created if missing).
        store: PathBuf,
        /// A step number, or `latest`.
        #[arg(long, default_value = "latest")]
        step: String,
    },
    /// Commit a directory (any framework's checkpoint folder) as one
    /// step: each regular file an entry, unchanged chunks not stored
    /// again. Creates a store file that is missing.
    SaveDir {
        /// The store file, or a bucket URL.
        store: PathBuf,
        /// The step to store it as.
        step: u64,
        /// The directory.
        dir: PathBuf,
    },
    /// Write a step saved by `save-dir` into a directory (which must not
    /// exist, or be empty), whole or not at all. Reads.
    LoadDir {
        /// The store file, or a bucket URL.
        store: PathBuf,
        /// The step (`latest`: the newest).
        step: String,
        /// The directory to write.
        dir: PathBuf,
    },
    /// Steps, sizes, deduplication ratio, file size (of a bucket: bytes
    /// stored against the steps' own). Reads.
    Stats {
        /// The store file, or a bucket URL.
        store: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Compare write throughput: seed JSON, raw write+fsync, ckptstore.
    Bench {
        /// Workloads to run: small, medium, large.
        #[arg(long, value_delimiter = ',', default_value = "small,medium")]
        sizes: Vec<String>,
        /// Where to write the benchmark files (default: a temporary folder).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

/// A file format of `export` and `import`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Format {
    /// safetensors: tensors every ML framework reads.
    Safetensors,
    /// The original one-JSON-file-per-step format.
    Json,
}

impl Format {
    /// `given`, or the format `path`'s name says.
    pub(crate) fn of(path: &Path, given: Option<Format>) -> Format {
        given.unwrap_or_else(|| {
            let safetensors = path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
            if safetensors {
                Format::Safetensors
            } else {
                Format::Json
            }
        })
    }
}

/// A size as Hugging Face writes it: `5GB` (10^9), `2GiB` (2^30), `500MB`,
/// `64KiB`, or plain bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(digits);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (5GB, 500MB, 2GiB, bytes)"))?;
    let scale: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        "TIB" => 1 << 40,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            ))
        }
    };
    match n.checked_mul(scale) {
        Some(0) | None => Err(format!("{text:?} is not a size above 0 bytes")),
        Some(bytes) => Ok(bytes),
    }
}

fn parse_dtype(text: &str) -> Result<ckptstore::Dtype, String> {
    ckptstore::cast_dtype(text).ok_or_else(|| format!("{text:?}: cast to bf16, f16 or f32"))
}

/// The options of `ckpt export --hf`.
pub(crate) struct HfOptions<'a> {
    pub(crate) max_shard: u64,
    pub(crate) prefix: Option<&'a str>,
    pub(crate) dtype: Option<ckptstore::Dtype>,
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_read_as_hugging_face_writes_them() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("500mb"), Ok(500_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err());
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("99999999999999TB").is_err());
    }
}
