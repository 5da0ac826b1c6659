//! The bucket's errors (`remote`): one type, [`BucketError`], wrapped by
//! one variant of the crate's error ([`Error::Bucket`](crate::Error::Bucket)),
//! and kept beside it so that the error layer names nothing above it; each
//! object store's failures are mapped to it in one place (`remote/s3.rs`
//! and `remote/bucket/`, the one place requests are made), never by
//! message text.

use super::Cause;

/// What went wrong with a bucket. `#[non_exhaustive]`: match the variants
/// you handle and keep a catch-all arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BucketError {
    /// An object store (a bucket, or a directory used as one) failed or
    /// refused a request, after bounded retries.
    #[error("{op} {url}: {reason}")]
    Request {
        /// What was being done ("listing", "writing to", ...).
        op: String,
        /// The object's URL (`file:///DIR/steps/...`, `s3://BUCKET/...`),
        /// or the remote's when no one object was involved.
        url: String,
        /// What the store answered, without its own form of the path.
        reason: String,
        /// The object store's error.
        #[source]
        source: Cause,
    },

    /// Background replication ([`StoreOptions::replicate_to`](crate::StoreOptions::replicate_to))
    /// failed; it goes on retrying with backoff.
    #[error("replication to {url} failed (retrying in the background; steps not yet there: {steps:?}): {source}")]
    ReplicationFailed {
        /// The remote's URL.
        url: String,
        /// The steps committed here that are not confirmed in the bucket.
        steps: Vec<u64>,
        /// The last push's error, shared by every `flush` that reports it.
        #[source]
        source: std::sync::Arc<crate::Error>,
    },

    /// A global step of several ranks, asked for as one checkpoint.
    #[error(
        "step {step} is a global step of {world_size} shards: read each with get_shard(step, rank)"
    )]
    ShardedStep {
        /// The step.
        step: u64,
        /// Its number of ranks.
        world_size: u32,
    },

    /// Ranks disagree on the number of ranks of a global step.
    #[error(
        "step {step}: this rank says {ours} ranks, the bucket {url} has shards of {theirs} ranks"
    )]
    WorldSizeMismatch {
        /// The bucket.
        url: String,
        /// The step.
        step: u64,
        /// The world size this rank gave.
        ours: u32,
        /// The world size another rank's shard has.
        theirs: u32,
    },

    /// The bucket is held by another process's operation (a garbage
    /// collection a push must not overlap) for longer than it may be.
    #[error("{url}: {detail}")]
    Busy {
        /// The remote's URL.
        url: String,
        /// Who holds it, and what to do.
        detail: String,
    },

    /// There is no bucket at the URL (S3 answered "no such bucket", or a
    /// `file://` bucket's directory is missing).
    #[error(
        "no bucket at {url}: check the URL, or create the bucket (a file:// directory is \
         created by the first push){}", source.as_ref().map(|s| format!(" ({s})")).unwrap_or_default()
    )]
    NoBucket {
        /// The remote's URL.
        url: String,
        /// The object store's answer, when there was one.
        source: Option<Cause>,
    },

    /// The bucket prefix holds the run of another store: a push from this
    /// one would mix two runs' steps.
    #[error(
        "{url} holds the run of store {owner}, and this store is {ours}: push to another \
         prefix, or adopt this one (`ckpt push --adopt`, `Remote::adopt`) if this store \
         continues that run"
    )]
    PrefixOwned {
        /// The remote's URL.
        url: String,
        /// The store whose run the prefix holds.
        owner: String,
        /// This store.
        ours: String,
    },

    /// A remote URL that cannot be used.
    #[error("{url}: {reason}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// Why it cannot be used.
        reason: String,
    },
}
