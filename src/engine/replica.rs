//! What a store remembers of the buckets it replicates to, so that a push
//! asks a bucket only about what changed: per bucket URL, the bucket's
//! collection mark when the store last listed it, and the newest commit of
//! each step it knows of. (The chunks a bucket held as chunk objects were
//! remembered too, before bucket format 3: `replica_chunks` is emptied
//! when a bucket is remembered afresh, and no longer written.)
//!
//! Only ever a shortcut: a push trusts it while the bucket's mark is the
//! one remembered (no collection deleted anything since) and otherwise
//! lists the bucket and remembers afresh. Removing or replacing a step
//! locally marks it as no longer known whole in any bucket.

#[cfg(feature = "remote")]
use std::collections::BTreeMap;

use redb::ReadableTable;

use super::Engine;
#[cfg(feature = "remote")]
use super::View;
use crate::error::StorageContext;
use crate::format::manifest::Hash;
#[cfg(feature = "remote")]
use crate::format::tables::{REPLICA_CHUNKS, REPLICA_FORMAT};
use crate::format::tables::{REPLICA_MARKS, REPLICA_STEPS};
use crate::Result;

/// What a store remembers of one bucket.
#[cfg(feature = "remote")]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Remembered {
    /// The bucket's collection mark when it was last listed (empty: none).
    pub(crate) mark: Vec<u8>,
    /// The bucket's newest commit of each step the store knows of.
    pub(crate) steps: BTreeMap<u64, Pushed>,
}

/// The bucket's newest commit of a step, as the store knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pushed {
    /// The commit's generation.
    pub(crate) generation: u64,
    /// The manifest hash it names.
    pub(crate) hash: Hash,
    /// Whether the bucket holds the store's current version of the step
    /// whole (manifest and chunks): a push then skips it unread.
    pub(crate) whole: bool,
}

const PUSHED_LEN: usize = 8 + 32 + 1;

impl Pushed {
    fn encode(&self) -> [u8; PUSHED_LEN] {
        let mut out = [0u8; PUSHED_LEN];
        out[..8].copy_from_slice(&self.generation.to_le_bytes());
        out[8..40].copy_from_slice(&self.hash);
        out[40] = u8::from(self.whole);
        out
    }

    /// A record of another length or flag is ignored (not remembered).
    fn decode(bytes: &[u8]) -> Option<Pushed> {
        let bytes: &[u8; PUSHED_LEN] = bytes.try_into().ok()?;
        let generation = u64::from_le_bytes(bytes[..8].try_into().ok()?);
        let hash: Hash = bytes[8..40].try_into().ok()?;
        let whole = match bytes[40] {
            0 => false,
            1 => true,
            _ => return None,
        };
        Some(Pushed {
            generation,
            hash,
            whole,
        })
    }
}

#[cfg(feature = "remote")]
impl View {
    /// What the store remembers of the bucket at `url`, if anything.
    pub(crate) fn remembered(&self, url: &str) -> Result<Option<Remembered>> {
        let ctx = || format!("reading what the store remembers of {url}");
        let Some(marks) = self.optional(REPLICA_MARKS)? else {
            return Ok(None);
        };
        let Some(mark) = marks.get(url).context(ctx)? else {
            return Ok(None);
        };
        let mut remembered = Remembered {
            mark: mark.value().to_vec(),
            steps: BTreeMap::new(),
        };
        if let Some(steps) = self.optional(REPLICA_STEPS)? {
            for entry in steps.range((url, 0)..=(url, u64::MAX)).context(ctx)? {
                let (key, value) = entry.context(ctx)?;
                if let Some(p) = Pushed::decode(value.value()) {
                    remembered.steps.insert(key.value().1, p);
                }
            }
        }
        Ok(Some(remembered))
    }
}

impl Engine<'_> {
    #[cfg(feature = "remote")]
    /// Remember `steps` of the bucket at `url` as of `mark`; with
    /// `fresh`, after forgetting everything remembered of it before.
    pub(crate) fn remember(
        &mut self,
        url: &str,
        mark: &[u8],
        fresh: bool,
        steps: &[(u64, Pushed)],
    ) -> Result<()> {
        let ctx = || format!("writing what the store remembers of {url}");
        self.require_format(REPLICA_FORMAT)?;
        let mut marks = self.txn.open_table(REPLICA_MARKS).context(ctx)?;
        let mut step_table = self.txn.open_table(REPLICA_STEPS).context(ctx)?;
        let mut chunk_table = self.txn.open_table(REPLICA_CHUNKS).context(ctx)?;
        if fresh {
            step_table
                .retain_in((url, 0)..=(url, u64::MAX), |_, _| false)
                .context(ctx)?;
            chunk_table
                .retain_in((url, &[0u8; 32])..=(url, &[0xff; 32]), |_, ()| false)
                .context(ctx)?;
        }
        marks.insert(url, mark).context(ctx)?;
        for (step, pushed) in steps {
            step_table
                .insert((url, *step), pushed.encode().as_slice())
                .context(ctx)?;
        }
        Ok(())
    }

    /// The store's version of `step` is going: no bucket is known to hold
    /// it whole any more (the newest commit each bucket has stays known).
    pub(crate) fn forget_replicated(&mut self, step: u64) -> Result<()> {
        let ctx = || format!("forgetting that step {step} was replicated");
        if !self.has_replica_tables()? {
            return Ok(());
        }
        let marks = self.txn.open_table(REPLICA_MARKS).context(ctx)?;
        let mut steps = self.txn.open_table(REPLICA_STEPS).context(ctx)?;
        for entry in marks.iter().context(ctx)? {
            let (url, _) = entry.context(ctx)?;
            let url = url.value();
            let known = steps
                .get((url, step))
                .context(ctx)?
                .and_then(|v| Pushed::decode(v.value()));
            if let Some(p) = known.filter(|p| p.whole) {
                let not_whole = Pushed { whole: false, ..p };
                steps
                    .insert((url, step), not_whole.encode().as_slice())
                    .context(ctx)?;
            }
        }
        Ok(())
    }

    /// Whether the store has ever remembered a bucket (the tables exist).
    fn has_replica_tables(&mut self) -> Result<bool> {
        if self.replica_tables.is_none() {
            let ctx = || "listing the store's tables".to_owned();
            let found = self
                .txn
                .list_tables()
                .context(ctx)?
                .any(|t| redb::TableHandle::name(&t) == "replica_marks");
            self.replica_tables = Some(found);
        }
        Ok(self.replica_tables == Some(true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushed_records_round_trip_and_odd_ones_are_ignored() {
        let p = Pushed {
            generation: 7,
            hash: [3; 32],
            whole: true,
        };
        assert_eq!(Pushed::decode(&p.encode()), Some(p));
        let mut bad = p.encode();
        bad[40] = 2;
        assert_eq!(Pushed::decode(&bad), None);
        assert_eq!(Pushed::decode(&bad[..40]), None);
    }
}
