//! The bucket's layout, under the remote's prefix, all plain names:
//!
//! ```text
//! chunks/<blake3 hex>                      chunk bytes (and a step's packed small blobs)
//! packs/<blake3 hex>                       chunks back to back (format 3 shards); the hash
//!                                          is of the chunk list ([`pack_name`](crate::remote::format::pack_format::pack_name))
//! manifests/<step:020>-<blake3 hex>.json   a step's manifest (JSON); the hash is of its bytes;
//!                                          for a global step of N ranks, the list of its shards
//! shards/<step:020>/<rank:06>-of-<N:06>-<blake3 hex>.json
//!                                          one rank's shard of a global step: a manifest
//!                                          (format 2: large blobs' small ends in its packed chunk)
//! commits/<step:020>-<gen:020>-<blake3 hex>
//!                                          written last: the step is visible; names its manifest
//! deleted/<step:020>-<blake3 hex>          that step was deleted by retention: push skips it;
//!                                          named by its manifest's hash and, for a pushed
//!                                          format-3 step, by its unpacked manifest's too
//!                                          ([`unpacked_hash`](super::manifest::RemoteManifest::unpacked_hash))
//! locks/<push|gc>-<uuid>                   a push or a garbage collection in progress
//! owner/<store uuid>                       the store whose run this prefix holds
//! collections/latest                       a random id, rewritten by each garbage collection
//!                                          before it deletes anything (what stores remember
//!                                          of the bucket holds while it is unchanged)
//! hints/latest                             the step of the last commit written: where a
//!                                          search for the newest step starts listing
//! ```
//!
//! A step committed again with other content (a rollback and redo) gets a
//! commit of a higher generation; readers take the newest generation whose
//! step checks out, and garbage collection deletes the commits it
//! supersedes. Commit names without a generation (written by 0.3) are
//! generation 0. An attempt at a global step is the set of shards written
//! after its newest commit (see [`shards`](crate::remote::global::shards)).
//!
//! Every key but the locks, the owner and the hint is written once with bytes that
//! are a function of its name (content addressing), so no conditional PUT
//! is needed: a rewrite puts the same bytes back.
//!
//! Objects in a bucket are untrusted input: every count, length and name
//! is checked against the caps below before anything is allocated or
//! added up
//! ([`RemoteManifest::check`](super::manifest::RemoteManifest::check));
//! the same caps hold when pushing, so nothing this crate writes is
//! refused when read back.

use std::fmt;
use std::str::FromStr;

use object_store::path::Path;
use serde::{Deserialize, Serialize};

use crate::format::manifest::{hex, Hash};
pub(crate) use crate::remote::format::hash::parse_hex;
use crate::remote::format::hash::HexHash;

/// The folder of content-addressed chunks.
pub(crate) const CHUNKS: &str = "chunks";
/// The folder of pack objects (format 3).
pub(crate) const PACKS: &str = "packs";
/// The folder of step manifests.
pub(crate) const MANIFESTS: &str = "manifests";
/// The folder of commit objects.
pub(crate) const COMMITS: &str = "commits";
/// The folder of the shards of global steps, a folder per step.
pub(crate) const SHARDS: &str = "shards";
/// The folder of markers of steps deleted by retention.
pub(crate) const DELETED: &str = "deleted";
/// The folder of locks.
pub(crate) const LOCKS: &str = "locks";
/// The folder that names the prefix's owner.
pub(crate) const OWNER: &str = "owner";
/// The folder of the collection mark.
pub(crate) const COLLECTIONS: &str = "collections";
/// The folder of the latest-step hint.
pub(crate) const HINTS: &str = "hints";
/// The largest hint object read.
pub(crate) const MAX_HINT_BYTES: u64 = 4096;
/// The version of a global manifest's JSON, and of a commit's.
pub(crate) const MANIFEST_FORMAT: u32 = 1;

/// The most ranks a global step may have.
pub const MAX_WORLD_SIZE: u32 = 1_000_000;
/// The largest manifest (or shard manifest) object read or written.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// The most dimensions a tensor's shape may have.
pub(crate) const MAX_DIMS: usize = 64;

/// A commit object: the step it makes visible, its generation, and the
/// hash of the manifest it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Commit {
    pub(crate) step: u64,
    /// Orders commits of one step: a redone step's commit is newer.
    pub(crate) generation: u64,
    /// The hash of the step's manifest.
    pub(crate) hash: Hash,
}

/// A name in the bucket that is not of the form its folder's names take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NotAName;

impl fmt::Display for NotAName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not a name of this bucket's form")
    }
}

/// The commit a name in `commits/` stands for:
/// `SSSSSSSSSSSSSSSSSSSS[-GGGGGGGGGGGGGGGGGGGG]-HASH`.
impl FromStr for Commit {
    type Err = NotAName;

    fn from_str(name: &str) -> Result<Commit, NotAName> {
        let parse = || {
            let (step, rest) = name.split_once('-')?;
            if step.len() != 20 {
                return None;
            }
            let (generation, hash) = match rest.split_once('-') {
                Some((g, hash)) if g.len() == 20 => (g.parse().ok()?, hash),
                Some(_) => return None,
                None => (0, rest),
            };
            Some(Commit {
                step: step.parse().ok()?,
                generation,
                hash: parse_hex(hash)?,
            })
        };
        parse().ok_or(NotAName)
    }
}

/// Its name in `commits/` (generation 0, written before generations,
/// without one).
impl fmt::Display for Commit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.generation == 0 {
            write!(f, "{:020}-{}", self.step, hex(&self.hash))
        } else {
            write!(
                f,
                "{:020}-{:020}-{}",
                self.step,
                self.generation,
                hex(&self.hash)
            )
        }
    }
}

impl Commit {
    /// The commit that makes `hash` step `step`'s content, given the
    /// step's newest commit: that one again if it names the same manifest
    /// (a repair rewrites it), else one generation newer.
    pub(crate) fn after(newest: Option<Commit>, step: u64, hash: Hash) -> Commit {
        match newest {
            Some(c) if c.step == step && c.hash == hash => c,
            _ => Commit {
                step,
                generation: newest.map_or(1, |c| c.generation + 1),
                hash,
            },
        }
    }

    /// The body of its object: redundant with its name, for a reader of
    /// the bucket by hand.
    pub(crate) fn body(&self) -> CommitBody {
        CommitBody {
            format: 1,
            step: self.step,
            generation: self.generation,
            manifest: hex(&self.hash),
        }
    }
}

/// The body of a commit object (readers go by its name).
#[derive(Serialize)]
pub(crate) struct CommitBody {
    format: u32,
    step: u64,
    generation: u64,
    manifest: String,
}

/// The body of the latest-step hint. A hint only: commits are written
/// with it by several writers in any order, so it may name an older step
/// than the newest, or a step since deleted; readers list the commits from
/// it on and fall back to all of them.
#[derive(Serialize, Deserialize)]
pub(crate) struct LatestHint {
    pub(crate) format: u32,
    pub(crate) step: u64,
}

/// Where things are under one prefix.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub(crate) prefix: Path,
}

impl Layout {
    /// `key` as a URL below `url`, the URL that names this prefix: what
    /// errors print (an object path has no leading `/`; `file:///DIR/...`
    /// and `s3://BUCKET/...` do).
    pub(crate) fn url_of(&self, url: &str, key: &Path) -> String {
        let below: Vec<String> = match key.prefix_match(&self.prefix) {
            Some(parts) => parts.map(|p| p.as_ref().to_owned()).collect(),
            None => return format!("{}/{key}", url.trim_end_matches('/')),
        };
        if below.is_empty() {
            return url.to_owned();
        }
        format!("{}/{}", url.trim_end_matches('/'), below.join("/"))
    }

    fn key(&self, folder: &str, name: &str) -> Path {
        self.prefix.clone().join(folder).join(name)
    }

    pub(crate) fn folder(&self, folder: &str) -> Path {
        self.prefix.clone().join(folder)
    }

    pub(crate) fn chunk(&self, hash: &Hash) -> Path {
        self.key(CHUNKS, &hex(hash))
    }

    pub(crate) fn pack(&self, hash: &Hash) -> Path {
        self.key(PACKS, &hex(hash))
    }

    /// The key of `object`.
    pub(crate) fn object(&self, object: &crate::remote::format::pack_format::Object) -> Path {
        match object {
            crate::remote::format::pack_format::Object::Chunk(hash) => self.chunk(hash),
            crate::remote::format::pack_format::Object::Pack(hash) => self.pack(hash),
        }
    }

    pub(crate) fn manifest(&self, step: u64, hash: &Hash) -> Path {
        self.key(
            MANIFESTS,
            &format!("{}.json", StepHash { step, hash: *hash }),
        )
    }

    pub(crate) fn commit(&self, commit: &Commit) -> Path {
        self.key(COMMITS, &commit.to_string())
    }

    pub(crate) fn owner(&self, store_id: &str) -> Path {
        self.key(OWNER, store_id)
    }

    pub(crate) fn shard_folder(&self, step: u64) -> Path {
        self.prefix.clone().join(SHARDS).join(format!("{step:020}"))
    }

    pub(crate) fn shard(&self, step: u64, id: &ShardName) -> Path {
        self.shard_folder(step).join(id.to_string())
    }

    pub(crate) fn deleted(&self, step: u64, hash: &Hash) -> Path {
        self.key(DELETED, &StepHash { step, hash: *hash }.to_string())
    }

    pub(crate) fn lock(&self, name: &str) -> Path {
        self.key(LOCKS, name)
    }

    /// The latest-step hint: rewritten by every commit.
    pub(crate) fn latest_hint(&self) -> Path {
        self.key(HINTS, "latest")
    }

    /// The collection mark: rewritten by every garbage collection.
    pub(crate) fn collection_mark(&self) -> Path {
        self.key(COLLECTIONS, "latest")
    }
}

/// The step and manifest hash a deletion marker's (or a manifest's without
/// its `.json`) name carries: `SSSSSSSSSSSSSSSSSSSS-HASH`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct StepHash {
    pub(crate) step: u64,
    pub(crate) hash: Hash,
}

impl FromStr for StepHash {
    type Err = NotAName;

    fn from_str(name: &str) -> Result<StepHash, NotAName> {
        let (step, hash) = name.split_once('-').ok_or(NotAName)?;
        if step.len() != 20 {
            return Err(NotAName);
        }
        Ok(StepHash {
            step: step.parse().map_err(|_| NotAName)?,
            hash: parse_hex(hash).ok_or(NotAName)?,
        })
    }
}

impl fmt::Display for StepHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:020}-{}", self.step, hex(&self.hash))
    }
}

/// One rank's shard manifest, as its name in a step's shard folder says:
/// `RRRRRR-of-WWWWWW-HASH.json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ShardName {
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) hash: Hash,
}

impl fmt::Display for ShardName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:06}-of-{:06}-{}.json",
            self.rank,
            self.world_size,
            hex(&self.hash)
        )
    }
}

/// Refused: a name of another form, a world size over
/// [`MAX_WORLD_SIZE`] or a rank not below it.
impl FromStr for ShardName {
    type Err = NotAName;

    fn from_str(name: &str) -> Result<ShardName, NotAName> {
        let parse = || {
            let stem = name.strip_suffix(".json")?;
            let (rank, rest) = stem.split_once("-of-")?;
            let (world, hash) = rest.split_once('-')?;
            let id = ShardName {
                rank: rank.parse().ok()?,
                world_size: world.parse().ok()?,
                hash: parse_hex(hash)?,
            };
            let sane = id.world_size <= MAX_WORLD_SIZE && id.rank < id.world_size;
            sane.then_some(id)
        };
        parse().ok_or(NotAName)
    }
}

/// The manifest of a global step: its world size and each rank's shard
/// manifest hash, by rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct GlobalManifest {
    pub(crate) format: u32,
    pub(crate) step: u64,
    pub(crate) world_size: u32,
    pub(crate) shards: Vec<HexHash>,
}

impl GlobalManifest {
    /// The manifest of global step `step` made of the shards `ids`, by
    /// rank (every one of the same world size): the one constructor.
    pub(crate) fn of(step: u64, ids: &[ShardName]) -> GlobalManifest {
        GlobalManifest {
            format: MANIFEST_FORMAT,
            step,
            world_size: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            shards: ids.iter().map(|id| HexHash(id.hash)).collect(),
        }
    }
}

/// A chunk object's hash, from its name.
pub(crate) fn parse_chunk(name: &str) -> Option<Hash> {
    parse_hex(name)
}

/// The bytes of a manifest (JSON) and their hash, which names it.
/// Refused (as step `step`'s) when larger than [`MAX_MANIFEST_BYTES`].
pub(crate) fn encode(step: u64, manifest: &impl Serialize) -> crate::Result<(Vec<u8>, Hash)> {
    let bytes = serde_json::to_vec(manifest).map_err(|e| crate::Error::Json {
        path: None,
        source: Box::new(e),
    })?;
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(crate::Error::InvalidCheckpoint {
            step,
            reason: format!(
                "its manifest for the bucket is {} bytes (at most {MAX_MANIFEST_BYTES}): \
                 the graph or metadata is too large to push",
                bytes.len()
            ),
        });
    }
    let hash = *blake3::hash(&bytes).as_bytes();
    Ok((bytes, hash))
}

/// `value` with every object's keys in order, whatever map type
/// `serde_json` was built with: the same value encodes to the same bytes.
pub(crate) fn canonical(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, canonical(v)))
                    .collect(),
            )
        }
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(canonical).collect())
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_are_named_below_the_url() {
        let layout = Layout {
            prefix: Path::from("tmp/bucket"),
        };
        let key = layout.chunk(&[0xab; 32]);
        let url = "file:///tmp/bucket";
        let named = layout.url_of(url, &key);
        assert_eq!(
            named,
            format!("file:///tmp/bucket/chunks/{}", hex(&[0xab; 32]))
        );
        assert_eq!(
            layout.url_of("file:///tmp/bucket/", &layout.folder(CHUNKS)),
            "file:///tmp/bucket/chunks"
        );
        assert_eq!(layout.url_of(url, &layout.prefix), url);
        assert_eq!(
            layout.url_of("s3://b/run", &Path::from("elsewhere/x")),
            "s3://b/run/elsewhere/x"
        );
    }

    #[test]
    fn names_parse_back() {
        let layout = Layout {
            prefix: Path::from("runs/a"),
        };
        let h = [0xab; 32];
        let legacy = Commit {
            step: 42,
            generation: 0,
            hash: h,
        };
        let c = layout.commit(&legacy);
        assert_eq!(c.as_ref(), format!("runs/a/commits/{:020}-{}", 42, hex(&h)));
        let name = c.filename().expect("has a name");
        assert_eq!(name.parse(), Ok(legacy));
        assert_eq!(name.parse(), Ok(StepHash { step: 42, hash: h }));
        let redo = Commit {
            generation: 3,
            ..legacy
        };
        let name = layout.commit(&redo);
        assert_eq!(name.filename().expect("named").parse(), Ok(redo));
        assert_eq!("42-ab".parse::<StepHash>(), Err(NotAName));
        assert_eq!(
            format!("{:020}-7-{}", 1, hex(&h)).parse::<Commit>(),
            Err(NotAName)
        );
        let shard = ShardName {
            rank: 1,
            world_size: 4,
            hash: h,
        };
        let key = layout.shard(9, &shard);
        assert_eq!(key.filename().expect("named").parse(), Ok(shard));
        let absurd = format!("000000-of-1000000000-{}.json", hex(&h));
        assert_eq!(absurd.parse::<ShardName>(), Err(NotAName));
        let outside = format!("000004-of-000004-{}.json", hex(&h));
        assert_eq!(outside.parse::<ShardName>(), Err(NotAName));
        assert_eq!(parse_chunk(&hex(&h)), Some(h));
        assert_eq!(parse_chunk("zz"), None);
        let name = layout.manifest(7, &h);
        assert_eq!(name.extension(), Some("json"));
        let deleted = layout.deleted(7, &h);
        assert_eq!(
            deleted.filename().expect("named").parse(),
            Ok(StepHash { step: 7, hash: h })
        );
        // Every name reads back as what made it.
        for step in [0, 1, u64::MAX] {
            for generation in [0, 1, u64::MAX] {
                let c = Commit {
                    step,
                    generation,
                    hash: h,
                };
                assert_eq!(c.to_string().parse(), Ok(c));
            }
            let n = StepHash { step, hash: h };
            assert_eq!(n.to_string().parse(), Ok(n));
        }
    }

    #[test]
    fn canonical_json_sorts_keys() {
        let v: serde_json::Value =
            serde_json::json!({"b": 1, "a": {"d": [1, {"z": 0, "y": 1}], "c": 2}});
        let bytes = serde_json::to_vec(&canonical(v)).expect("encodes");
        assert_eq!(
            String::from_utf8(bytes).expect("utf-8"),
            r#"{"a":{"c":2,"d":[1,{"y":1,"z":0}]},"b":1}"#
        );
    }

    #[test]
    fn a_step_saved_again_is_one_generation_newer_unless_its_manifest_is_the_same() {
        let (a, b) = ([1; 32], [2; 32]);
        let first = Commit::after(None, 5, a);
        assert_eq!((first.step, first.generation, first.hash), (5, 1, a));
        // The same manifest again (a repair): the same commit.
        assert_eq!(Commit::after(Some(first), 5, a), first);
        // Other content: newer, and its name sorts after.
        let second = Commit::after(Some(first), 5, b);
        assert_eq!((second.generation, second.hash), (2, b));
        assert!(second.to_string() > first.to_string() && second > first);
        // A commit of 0.3 (generation 0) is followed by generation 1.
        let legacy = Commit {
            step: 5,
            generation: 0,
            hash: a,
        };
        assert_eq!(Commit::after(Some(legacy), 5, b).generation, 1);
        // Ordered as commits (a listing sorts what it parsed), not by name:
        // a name without a generation may sort after one with.
        assert!(legacy < Commit::after(Some(legacy), 5, b));
    }
}
