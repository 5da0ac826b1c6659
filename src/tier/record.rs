//! A rank's record of a complete save (`records/step-S.rank-R.json`):
//! the serde body, checked as untrusted input when read.

use std::collections::BTreeMap;
use std::path::Path;

use super::names::{RecordName, StoreKind, StoreName, MAX_RANKS};
use crate::{ContentDigest, Error, Result};

/// The record format this build writes (and the newest it reads): 2, a
/// record of fixed fields per rank. Format 1 (0.4.0) also carried every
/// rank's entry sizes and DCP's metadata ([`Legacy`]); it is still read.
pub const RECORD_FORMAT: u32 = 2;

/// The largest record read (one of format 1 embeds DCP's metadata).
pub const MAX_RECORD_BYTES: u64 = 256 << 20;

/// A save of step `step` is complete on the local tier: every rank's shard
/// (content digest `digests[r]`) and every copy (`copies[r]`: the ranks
/// keeping rank r's) was durable when the record was written. The layout
/// is in docs/design.md ("The local tier").
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The step saved.
    pub step: u64,
    /// The coordinator's clock at the save, in nanoseconds: two saves of
    /// one step differ in it.
    pub saved_at: u64,
    /// The save's place in the order of saves (0 in records of 0.4.0).
    pub seq: u64,
    /// Ranks per node of the job that saved it.
    pub ranks_per_node: u32,
    /// Each rank's shard's content digest (one per rank: the world size).
    pub digests: Vec<ContentDigest>,
    /// The ranks that keep copies of each rank's shard.
    pub copies: Vec<Vec<u32>>,
    /// The save is due for the bucket.
    pub upload: bool,
    /// What the save cost the rank that wrote the record.
    pub cost: Option<Cost>,
    /// What a record of format 1 also carried (None: format 2, whose
    /// metadata and sizes are in the coordinator's shard).
    pub legacy: Option<Legacy>,
}

/// The fields of a record of format 1 (0.4.0) that format 2 leaves to
/// the coordinator's shard.
#[derive(Clone, Debug, PartialEq)]
pub struct Legacy {
    /// Each rank's entries and their sizes in bytes.
    pub sizes: Vec<BTreeMap<String, u64>>,
    /// ckptstore.dcp's DCP metadata (JSON) of the save.
    pub metadata: String,
}

/// What a save cost one rank (`ckptstore.dcp.SaveCost`'s fields).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Cost {
    /// Seconds the caller waited.
    pub blocked_seconds: f64,
    /// Seconds spent copying the state to host memory.
    #[serde(default)]
    pub staging_seconds: f64,
    /// Seconds from the call until the step was complete on the tier.
    pub durable_seconds: f64,
    /// Bytes written anew (the shard and the copies this rank keeps).
    pub bytes_new: u64,
    /// Bytes found already stored.
    pub bytes_deduplicated: u64,
}

/// Which save of which step: `(step, saved_at)`.
pub type SaveKey = (u64, u64);

/// The record as JSON: the fields in the order 0.4.0 wrote them.
#[derive(serde::Serialize, serde::Deserialize)]
struct Body {
    format: u32,
    step: u64,
    saved_at: u64,
    ranks_per_node: u32,
    digests: Vec<String>,
    copies: Vec<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sizes: Option<Vec<BTreeMap<String, u64>>>,
    upload: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    metadata: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cost: Option<Cost>,
    #[serde(default, skip_serializing_if = "is_zero")]
    seq: u64,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's signature
fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Record {
    /// Which save of which step.
    pub fn key(&self) -> SaveKey {
        (self.step, self.saved_at)
    }

    /// The order of saves: later saves sort last, whatever their step
    /// numbers (a run that starts again at step 0 saves newer steps).
    pub fn order(&self) -> (u64, u64, u64) {
        (self.seq, self.saved_at, self.step)
    }

    /// The save's number of ranks.
    pub fn world_size(&self) -> u32 {
        u32::try_from(self.digests.len()).unwrap_or(u32::MAX)
    }

    /// The stores whose step of this save the node directory of `rank`
    /// holds once `rank` recorded it (the record vouches for them):
    /// `rank`'s own shard, and a copy of each rank whose copies it keeps.
    /// Each step's content digest is that rank's in [`digests`](Self::digests).
    pub fn kept_by(&self, rank: u32) -> Vec<StoreName> {
        let own = (rank < self.world_size()).then_some(StoreName {
            kind: StoreKind::Own,
            rank,
        });
        let copies = (0u32..).zip(&self.copies).filter_map(|(src, holders)| {
            (src != rank && holders.contains(&rank)).then_some(StoreName {
                kind: StoreKind::Copies,
                rank: src,
            })
        });
        own.into_iter().chain(copies).collect()
    }

    /// The record's bytes (UTF-8 JSON) to be written at `path` under
    /// `name`, after checking it is one that [`decode`](Self::decode)
    /// takes back.
    pub fn encode(&self, name: &RecordName, path: &Path) -> Result<Vec<u8>> {
        self.check(name).map_err(|reason| Error::TierFile {
            path: path.to_owned(),
            reason: format!("not a record to write: {reason}"),
        })?;
        let body = Body {
            format: if self.legacy.is_some() {
                1
            } else {
                RECORD_FORMAT
            },
            step: self.step,
            saved_at: self.saved_at,
            ranks_per_node: self.ranks_per_node,
            digests: self.digests.iter().map(ToString::to_string).collect(),
            copies: self.copies.clone(),
            sizes: self.legacy.as_ref().map(|l| l.sizes.clone()),
            upload: self.upload,
            metadata: self.legacy.as_ref().map(|l| l.metadata.clone()),
            cost: self.cost,
            seq: self.seq,
        };
        serde_json::to_vec(&body).map_err(|e| Error::Json {
            path: Some(path.to_owned()),
            source: Box::new(e),
        })
    }

    /// The record in `bytes`, read from `path` under `name`: refused
    /// unless it is well-formed, of a known format, and about the step and
    /// one of the ranks its name says.
    pub fn decode(bytes: &[u8], name: &RecordName, path: &Path) -> Result<Self> {
        let damaged = |reason: String| Error::TierFile {
            path: path.to_owned(),
            reason: format!("damaged tier record: {reason}"),
        };
        if bytes.len() as u64 > MAX_RECORD_BYTES {
            return Err(damaged(format!(
                "{} bytes, more than a record's {MAX_RECORD_BYTES}",
                bytes.len()
            )));
        }
        let body: Body =
            serde_json::from_slice(bytes).map_err(|e| damaged(format!("not a record ({e})")))?;
        let legacy = match (body.format, body.sizes, body.metadata) {
            (1, Some(sizes), Some(metadata)) => Some(Legacy { sizes, metadata }),
            (2, None, None) => None,
            (1 | 2, _, _) => {
                return Err(damaged(format!(
                    "a record of format {} {} sizes and metadata",
                    body.format,
                    if body.format == 1 { "without" } else { "with" }
                )))
            }
            (found, _, _) => {
                return Err(damaged(format!(
                    "record format {found}; this build reads formats 1 to {RECORD_FORMAT}"
                )))
            }
        };
        let mut digests = Vec::with_capacity(body.digests.len());
        for (rank, hex) in body.digests.iter().enumerate() {
            digests.push(ContentDigest::from_hex(hex).ok_or_else(|| {
                damaged(format!("rank {rank}'s digest {hex:?} is not 64 hex digits"))
            })?);
        }
        let record = Self {
            step: body.step,
            saved_at: body.saved_at,
            seq: body.seq,
            ranks_per_node: body.ranks_per_node,
            digests,
            copies: body.copies,
            upload: body.upload,
            cost: body.cost,
            legacy,
        };
        record.check(name).map_err(damaged)?;
        Ok(record)
    }

    /// What is wrong with this record under `name`, if anything.
    fn check(&self, name: &RecordName) -> std::result::Result<(), String> {
        let world = self.digests.len();
        if self.step != name.step {
            return Err(format!(
                "it records step {}, its name step {}",
                self.step, name.step
            ));
        }
        if world == 0 || world > MAX_RANKS as usize {
            return Err(format!("a world of {world} ranks (1 to {MAX_RANKS})"));
        }
        if name.rank as usize >= world {
            return Err(format!(
                "written by rank {} of a world of {world}",
                name.rank
            ));
        }
        let sizes = self.legacy.as_ref().map_or(world, |l| l.sizes.len());
        if self.copies.len() != world || sizes != world {
            return Err(format!(
                "{world} digests but {} lists of copies and {sizes} of sizes",
                self.copies.len(),
            ));
        }
        if self.ranks_per_node == 0 {
            return Err("0 ranks per node".into());
        }
        if let Some((src, holder)) = self
            .copies
            .iter()
            .enumerate()
            .find_map(|(src, hs)| hs.iter().find(|&&h| h as usize >= world).map(|h| (src, *h)))
        {
            return Err(format!(
                "rank {src}'s copy is kept by rank {holder}, outside the world"
            ));
        }
        if let Some(c) = self.cost {
            let seconds = [c.blocked_seconds, c.staging_seconds, c.durable_seconds];
            if seconds.iter().any(|s| !s.is_finite() || *s < 0.0) {
                return Err(format!("a cost of {seconds:?} seconds"));
            }
        }
        Ok(())
    }
}
