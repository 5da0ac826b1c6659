//! A bucket's listings: the names, times and sizes of objects in a folder
//! or under a key prefix, a page at a time, and what they say of the
//! bucket's steps, shards and objects.

use std::collections::HashSet;

use futures::TryStreamExt;
use object_store::list::PaginatedListOptions;
use object_store::path::Path;
use object_store::ObjectStoreExt;

use super::Bucket;
use crate::format::manifest::Hash;
use crate::remote::format;
use crate::remote::format::layout::{parse_chunk, ShardName, StepHash, DELETED, MANIFESTS, SHARDS};
use crate::Result;

impl Bucket {
    /// Names of the objects in `folder`.
    pub(crate) fn list_names(&self, folder: &str) -> Result<Vec<String>> {
        self.list_keys(&self.layout.folder(folder))
    }

    /// The name of each object directly in folder `prefix` (not in a
    /// folder below it: another prefix's objects may be there).
    pub(crate) fn list_keys(&self, prefix: &Path) -> Result<Vec<String>> {
        Ok(self
            .list_under(prefix, 1)?
            .into_iter()
            .map(|(mut parts, _)| parts.remove(0))
            .collect())
    }

    /// Each object `depth` folders down from `prefix`: its name's parts
    /// below `prefix`, and its metadata. A `file://` bucket whose
    /// directory is missing is empty (and not created).
    pub(crate) fn list_under(
        &self,
        prefix: &Path,
        depth: usize,
    ) -> Result<Vec<(Vec<String>, object_store::ObjectMeta)>> {
        if self.dir.as_ref().is_some_and(|d| !d.is_dir()) {
            return Ok(Vec::new());
        }
        let found: Vec<object_store::ObjectMeta> = self.block_on("listing", prefix, async {
            self.store.list(Some(prefix)).try_collect().await
        })?;
        Ok(found
            .into_iter()
            .filter_map(|meta| {
                let parts: Vec<String> = meta
                    .location
                    .prefix_match(prefix)?
                    .map(|p| p.as_ref().to_owned())
                    .collect();
                (parts.len() == depth).then_some((parts, meta))
            })
            .collect())
    }

    /// The (step, hash) of every manifest object.
    pub(crate) fn manifest_names(&self) -> Result<HashSet<(u64, Hash)>> {
        Ok(self
            .list_names(MANIFESTS)?
            .iter()
            .filter_map(|n| n.strip_suffix(".json")?.parse::<StepHash>().ok())
            .map(|n| (n.step, n.hash))
            .collect())
    }

    /// The (step, manifest hash) of every step retention deleted.
    pub(crate) fn deleted(&self) -> Result<Vec<(u64, Hash)>> {
        Ok(self
            .list_names(DELETED)?
            .iter()
            .filter_map(|n| n.parse::<StepHash>().ok())
            .map(|n| (n.step, n.hash))
            .collect())
    }

    /// Name, last modification (ms since the epoch) and size of each object
    /// in `folder`.
    pub(crate) fn list_meta(&self, folder: &str) -> Result<Vec<(String, i64, u64)>> {
        let found = self.list_under(&self.layout.folder(folder), 1)?;
        Ok(found
            .into_iter()
            .map(|(mut parts, meta)| {
                let modified = meta.last_modified.timestamp_millis();
                (parts.remove(0), modified, meta.size)
            })
            .collect())
    }

    /// Whether a listing returns keys in ascending order (S3's, by UTF-8
    /// bytes), so that one may stop where a name sorts past those sought;
    /// a directory's is in no order.
    pub(crate) fn lists_in_order(&self) -> bool {
        self.s3_name.is_some()
    }

    /// Each object directly in `folder` whose name starts with `start`
    /// (its name, its last modification in ms since the epoch): on S3, a
    /// listing of that key prefix alone (one request for a page of them,
    /// however many other objects the folder holds); elsewhere, of the
    /// folder.
    pub(crate) fn list_starting(&self, folder: &str, start: &str) -> Result<Vec<(String, i64)>> {
        let Some(pages) = &self.pages else {
            let all = self.list_meta(folder)?;
            let wanted = all
                .into_iter()
                .filter(|(name, _, _)| name.starts_with(start));
            return Ok(wanted.map(|(name, t, _)| (name, t)).collect());
        };
        let dir = self.layout.folder(folder);
        let prefix = format!("{dir}/{start}");
        let mut found = Vec::new();
        let mut opts = PaginatedListOptions::default();
        loop {
            let page = self.block_on(
                "listing",
                &dir,
                pages.list_paginated(Some(&prefix), opts.clone()),
            )?;
            for meta in page.result.objects {
                let mut parts = meta.location.prefix_match(&dir).into_iter().flatten();
                if let (Some(name), None) = (parts.next(), parts.next()) {
                    found.push((
                        name.as_ref().to_owned(),
                        meta.last_modified.timestamp_millis(),
                    ));
                }
            }
            match page.page_token {
                Some(token) => opts.page_token = Some(token),
                None => return Ok(found),
            }
        }
    }

    /// When the object at `key` was last written (ms since the epoch, the
    /// server's clock; a HEAD), if there is one.
    pub(crate) fn modified(&self, key: &Path) -> Result<Option<i64>> {
        self.block_on("looking for", key, async {
            match self.store.head(key).await {
                Ok(meta) => Ok(Some(meta.last_modified.timestamp_millis())),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        })
    }

    /// Each object directly in `folder` (by name, with its last
    /// modification in ms since the epoch), from the first whose name sorts
    /// after `after` (a key in `folder`) where given, handed to `each` in
    /// the order listed until it answers `false`.
    pub(crate) fn scan(
        &self,
        folder: &Path,
        after: Option<&Path>,
        each: &mut dyn FnMut(&str, i64) -> bool,
    ) -> Result<()> {
        if self.dir.as_ref().is_some_and(|d| !d.is_dir()) {
            return Ok(());
        }
        self.block_on("listing", folder, async {
            let mut listing = match after {
                None => self.store.list(Some(folder)),
                Some(offset) => self.store.list_with_offset(Some(folder), offset),
            };
            while let Some(meta) = listing.try_next().await? {
                let Some(mut parts) = meta.location.prefix_match(folder) else {
                    continue;
                };
                let (Some(name), None) = (parts.next(), parts.next()) else {
                    continue;
                };
                if !each(name.as_ref(), meta.last_modified.timestamp_millis()) {
                    break;
                }
            }
            Ok(())
        })
    }

    /// Every shard in the bucket: its step, its name, its last
    /// modification (ms since the epoch).
    pub(crate) fn list_shards(&self) -> Result<Vec<(u64, ShardName, i64)>> {
        let found = self.list_under(&self.layout.folder(SHARDS), 2)?;
        Ok(found
            .into_iter()
            .filter_map(|(parts, meta)| {
                let step = parts[0].parse().ok()?;
                let id: ShardName = parts[1].parse().ok()?;
                Some((step, id, meta.last_modified.timestamp_millis()))
            })
            .collect())
    }

    /// Every chunk and pack object in the bucket: what a manifest may
    /// need ([`RemoteManifest::objects`](format::manifest::RemoteManifest::objects)).
    pub(crate) fn objects(&self) -> Result<HashSet<format::pack_format::Object>> {
        let chunks = self
            .chunk_hashes()?
            .into_iter()
            .map(format::pack_format::Object::Chunk);
        let packs = self
            .pack_names()?
            .into_iter()
            .map(format::pack_format::Object::Pack);
        Ok(chunks.chain(packs).collect())
    }

    /// The names of every pack in the bucket.
    pub(crate) fn pack_names(&self) -> Result<HashSet<Hash>> {
        Ok(self
            .list_names(format::layout::PACKS)?
            .iter()
            .filter_map(|n| parse_chunk(n))
            .collect())
    }

    /// The hashes of every chunk in the bucket.
    pub(crate) fn chunk_hashes(&self) -> Result<HashSet<Hash>> {
        Ok(self
            .list_names(format::layout::CHUNKS)?
            .iter()
            .filter_map(|n| parse_chunk(n))
            .collect())
    }
}
