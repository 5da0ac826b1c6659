//! The bucket's collection mark: a token that changes whenever what a
//! store remembers of the bucket (where chunks lie in its packs) stops
//! holding — a collection about to delete, another store taking the
//! prefix over. Writers and readers remember pack positions under it.

use crate::remote::coordination::Shared;
use crate::Result;

impl Shared<'_> {
    /// The bucket's collection mark, written first if there is none: it
    /// also tells this bucket from another one later found at the same URL
    /// (a prefix emptied or a bucket made again), whose mark differs.
    pub(crate) fn collection_mark(&self) -> Result<Vec<u8>> {
        let key = self.bucket.layout.collection_mark();
        if let Some(mark) = self.bucket.get_bytes(&key, 1024)? {
            return Ok(mark.to_vec());
        }
        self.new_collection_mark()
    }

    /// The bucket's collection mark, if it has one (nothing is written).
    pub(crate) fn current_mark(&self) -> Result<Option<Vec<u8>>> {
        let key = self.bucket.layout.collection_mark();
        Ok(self.bucket.get_bytes(&key, 1024)?.map(|m| m.to_vec()))
    }

    /// Write a new collection mark: what any store remembers of the bucket
    /// no longer holds (a collection is about to delete, another store
    /// takes the prefix over, or a store pushed what it cannot remember).
    pub(crate) fn new_collection_mark(&self) -> Result<Vec<u8>> {
        let mark = uuid::Uuid::new_v4().simple().to_string().into_bytes();
        self.bucket
            .put(&self.bucket.layout.collection_mark(), mark.clone())?;
        Ok(mark)
    }
}
