//! Which store's run a prefix holds: `owner/<store uuid>`, written by the
//! first push into the prefix. A push from another store is refused, so two
//! runs never mix their steps in one prefix; global steps' shards are the
//! one case of several writers, by design, and claim nothing.
//!
//! No conditional PUT is assumed. A store that finds no owner writes a
//! claim (`owner/claim-<uuid>`) and lists the folder: only a store that
//! finds its claim alone there writes `owner/<uuid>`. Of two claims that
//! overlap, at most one is alone when listed (the one listed first was
//! written before the other was listed); when neither is, both withdraw
//! and try again after a random wait.

use crate::remote::coordination::locks::lock_body;
use crate::remote::coordination::Shared;
use crate::remote::format::layout::OWNER;
use crate::remote::BucketError;
use crate::{CheckpointStore, Result};

/// The name of a claim starts so.
const CLAIM: &str = "claim-";
/// Rounds of claims before a push gives up on a contested prefix.
const CLAIM_ATTEMPTS: u32 = 8;

impl Shared<'_> {
    /// Does the work of [`Remote::owner`](crate::Remote::owner).
    pub(crate) fn owner(&self) -> Result<Option<String>> {
        let mut owners: Vec<String> = self
            .bucket
            .list_names(OWNER)?
            .into_iter()
            .filter(|n| !n.starts_with(CLAIM))
            .collect();
        owners.sort();
        Ok(owners.into_iter().next())
    }

    /// Claim the prefix for the store `id` unless it holds another run.
    ///
    /// # Errors
    /// [`BucketError::PrefixOwned`](crate::BucketError::PrefixOwned) when
    /// another store's run is there;
    /// [`BucketError::Busy`](crate::BucketError::Busy) when other stores keep
    /// claiming it at the same moment.
    pub(crate) fn claim(&self, id: &str) -> Result<()> {
        let own_claim = format!("{CLAIM}{id}");
        for attempt in 1..=CLAIM_ATTEMPTS {
            if let Some(owner) = self.owner()? {
                if owner == id {
                    return Ok(());
                }
                return Err(BucketError::PrefixOwned {
                    url: self.bucket.url.clone(),
                    owner,
                    ours: id.to_owned(),
                }
                .into());
            }
            let claim = self.bucket.layout.owner(&own_claim);
            self.bucket.put(&claim, lock_body())?;
            let alone = self
                .bucket
                .list_names(OWNER)?
                .iter()
                .all(|n| *n == own_claim);
            if alone {
                self.bucket
                    .put(&self.bucket.layout.owner(id), lock_body())?;
            }
            self.bucket.delete(&claim)?;
            if alone {
                return Ok(());
            }
            let jitter = uuid::Uuid::new_v4().as_u128() % 200;
            let wait = u64::try_from(jitter).unwrap_or(0) + 20 * u64::from(attempt);
            std::thread::sleep(std::time::Duration::from_millis(wait));
        }
        Err(BucketError::Busy {
            url: self.bucket.url.clone(),
            detail: "other stores claimed this prefix at the same moment, again and again; \
                     push again"
                .into(),
        }
        .into())
    }

    /// Does the work of [`Remote::adopt`](crate::Remote::adopt).
    pub(crate) fn adopt(&self, store: &CheckpointStore) -> Result<()> {
        let id = store.store_id()?;
        self.bucket
            .put(&self.bucket.layout.owner(&id), lock_body())?;
        for name in self.bucket.list_names(OWNER)? {
            if name != id && !name.starts_with(CLAIM) {
                self.bucket.delete(&self.bucket.layout.owner(&name))?;
            }
        }
        // Another store's pushes follow: what any store remembered of the
        // bucket no longer holds.
        self.new_collection_mark().map(drop)
    }
}
