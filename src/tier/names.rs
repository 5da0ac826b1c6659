//! The names of a node's directory of the local tier: its stores, its
//! records and its in-bucket marks. Each name is written by `Display` and
//! read back by `FromStr`, which takes only the canonical spelling (a
//! rank of at least five digits without extra leading zeros, a step of
//! twenty), so that one file has one name and a temporary file or a
//! stranger's is never taken for one of ours.

use std::fmt;
use std::str::FromStr;

/// The folder of a node's directory that holds the records and marks.
pub const RECORDS: &str = "records";

/// The most ranks a save of the local tier may have (as many as a global
/// step in a bucket).
pub const MAX_RANKS: u32 = 1_000_000;

/// Whose shards a store of a node's directory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StoreKind {
    /// A rank's own shards: `rank-RRRRR.ckpt`.
    Own,
    /// Copies of another rank's shards kept on this node:
    /// `copies-of-RRRRR.ckpt`.
    Copies,
}

/// A store of a node's directory: step `S` of it is rank `rank`'s shard
/// (or a copy of it) of the save of step `S`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StoreName {
    /// Own shards or copies.
    pub kind: StoreKind,
    /// The rank whose shards they are.
    pub rank: u32,
}

/// `records/step-<S:020>.rank-<R:05>.json`: rank `rank`'s record of a
/// save of step `step`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RecordName {
    /// The step saved.
    pub step: u64,
    /// The rank that wrote the record.
    pub rank: u32,
}

/// `records/step-<S:020>.in-bucket`: the save of step `step` whose
/// `saved_at` the file holds is whole in the bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MarkName {
    /// The step uploaded.
    pub step: u64,
}

impl fmt::Display for StoreName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            StoreKind::Own => write!(f, "rank-{:05}.ckpt", self.rank),
            StoreKind::Copies => write!(f, "copies-of-{:05}.ckpt", self.rank),
        }
    }
}

impl fmt::Display for RecordName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step-{:020}.rank-{:05}.json", self.step, self.rank)
    }
}

impl fmt::Display for MarkName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step-{:020}.in-bucket", self.step)
    }
}

/// A name that is not one of the tier's (the caller skips the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotOurs;

impl FromStr for StoreName {
    type Err = NotOurs;

    fn from_str(name: &str) -> Result<Self, NotOurs> {
        let stem = name.strip_suffix(".ckpt").ok_or(NotOurs)?;
        let (kind, rank) = if let Some(rank) = stem.strip_prefix("copies-of-") {
            (StoreKind::Copies, rank)
        } else {
            (StoreKind::Own, stem.strip_prefix("rank-").ok_or(NotOurs)?)
        };
        Ok(Self {
            kind,
            rank: rank_of(rank)?,
        })
    }
}

impl FromStr for RecordName {
    type Err = NotOurs;

    fn from_str(name: &str) -> Result<Self, NotOurs> {
        let rest = name.strip_prefix("step-").ok_or(NotOurs)?;
        let (step, rest) = rest.split_once(".rank-").ok_or(NotOurs)?;
        let rank = rest.strip_suffix(".json").ok_or(NotOurs)?;
        Ok(Self {
            step: step_of(step)?,
            rank: rank_of(rank)?,
        })
    }
}

impl FromStr for MarkName {
    type Err = NotOurs;

    fn from_str(name: &str) -> Result<Self, NotOurs> {
        let step = name
            .strip_prefix("step-")
            .and_then(|n| n.strip_suffix(".in-bucket"))
            .ok_or(NotOurs)?;
        Ok(Self {
            step: step_of(step)?,
        })
    }
}

/// A step of exactly twenty digits.
fn step_of(text: &str) -> Result<u64, NotOurs> {
    if text.len() != 20 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(NotOurs);
    }
    text.parse().map_err(|_| NotOurs)
}

/// A rank below [`MAX_RANKS`], spelled as `{rank:05}` spells it.
fn rank_of(text: &str) -> Result<u32, NotOurs> {
    if text.len() < 5 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(NotOurs);
    }
    let rank: u32 = text.parse().map_err(|_| NotOurs)?;
    if rank >= MAX_RANKS || format!("{rank:05}") != text {
        return Err(NotOurs);
    }
    Ok(rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back_as_written_and_only_so() {
        for name in [
            StoreName {
                kind: StoreKind::Own,
                rank: 3,
            },
            StoreName {
                kind: StoreKind::Copies,
                rank: 123_456,
            },
        ] {
            assert_eq!(name.to_string().parse(), Ok(name));
        }
        let record = RecordName { step: 42, rank: 7 };
        assert_eq!(
            record.to_string(),
            "step-00000000000000000042.rank-00007.json"
        );
        assert_eq!(record.to_string().parse(), Ok(record));
        let mark = MarkName { step: u64::MAX };
        assert_eq!(mark.to_string().parse(), Ok(mark));
        for bad in [
            "rank-7.ckpt",
            "rank-000007.ckpt",
            "rank-0000x.ckpt",
            "rank-00007.ckpt.tmp-12",
            "copies-of-1000000.ckpt",
            "step-42.rank-00007.json",
            "step-00000000000000000042.rank-00007.json.tmp-9",
            "step-99999999999999999999.in-bucket",
            ".step-00000000000000000042.rank-00007.json.tmp-1",
        ] {
            assert!(
                bad.parse::<StoreName>().is_err()
                    && bad.parse::<RecordName>().is_err()
                    && bad.parse::<MarkName>().is_err(),
                "{bad}"
            );
        }
    }
}
