//! Verification in one read transaction: every step's hashes, then every
//! reference count and counter against what the manifests say.

use std::collections::HashMap;

use crate::error::StorageContext;
use crate::format::manifest::{decode_manifest, hex, ChunkUse, Hash};
use crate::format::packs::{pack_name, PackLoc};
use crate::format::tables::{
    meta_u64, CHUNK_DATA, CHUNK_INDEX, LEGACY_CHUNKS, LEGACY_REFS, META, META_NEXT_PACK,
    META_STORED_BYTES, META_STORED_CHUNKS, PACKED, PACK_CHUNKS, PACK_FILES,
};
use crate::{Result, VerifyReport};

use super::View;

/// What the manifests say the chunk tables hold.
#[derive(Default)]
pub(crate) struct Expected {
    /// Hash -> (id, uses) of format 2 chunks.
    chunks: HashMap<Hash, (u64, u64)>,
    /// Hash -> uses of format 1 chunks.
    legacy: HashMap<Hash, u64>,
    /// Hashes that manifests give two different ids: (hash, one, other).
    mismatched: Vec<(Hash, u64, u64)>,
}

/// One step's verdict.
pub(crate) enum Checked {
    /// Every hash checked out: the step's blob bytes.
    Ok(u64),
    /// The first problem found.
    Damaged(crate::Error),
}

impl View {
    /// Check every step, calling `each(step, verdict)` after each; stop
    /// when it returns `false`. Then, if nothing was damaged, check the
    /// accounting. Fills `report`.
    pub(crate) fn verify(
        &self,
        report: &mut VerifyReport,
        each: &mut dyn FnMut(u64, &Checked) -> bool,
    ) -> Result<()> {
        let steps = self.steps_table()?;
        let mut expected = Expected::default();
        let ctx = || "reading table steps".to_owned();
        for entry in steps.range::<u64>(..).context(ctx)? {
            let (key, bytes) = entry.context(ctx)?;
            let step = key.value();
            let checked = match decode_manifest(step, bytes.value()).and_then(|m| {
                expected.record(m.chunk_uses());
                self.check_step(m)
            }) {
                Ok(bytes) => Checked::Ok(bytes),
                Err(e) => Checked::Damaged(e),
            };
            let go_on = each(step, &checked);
            match checked {
                Checked::Ok(bytes) => {
                    report.steps_ok += 1;
                    report.bytes_checked += bytes;
                }
                Checked::Damaged(e) => report.damaged.push((step, e)),
            }
            if !go_on {
                return Ok(());
            }
        }
        // A step whose pack file a writer deleted meanwhile leaves the
        // snapshot's records whole: the accounting is still checked.
        let gone = |e: &crate::Error| {
            self.packs
                .as_ref()
                .is_some_and(|dir| super::packs::is_missing_pack(e, &dir.path))
        };
        if report.damaged.iter().all(|(_, e)| gone(e)) {
            let (problems, missing) = (&mut report.accounting, &mut report.missing_packs);
            report.staged_chunks = self.check_accounting(expected, problems, missing)?;
        }
        self.pack_structure(report)
    }

    /// Check every blob of a step against its hashes, a few chunks in
    /// memory at a time; returns the bytes checked.
    fn check_step(&self, manifest: crate::format::manifest::Manifest) -> Result<u64> {
        let (step, packed) = (manifest.step, manifest.packed.clone());
        let (_, blobs, _) = manifest.into_parts();
        self.step_data(step, packed, blobs)?.check_all()
    }

    /// Compare the chunk index, the chunks and the counters with what the
    /// manifests say; adds each discrepancy to `problems` (a recorded pack
    /// file that is not there to `missing`, for the caller to settle: a
    /// writer may have deleted it since), returns the number of staged
    /// chunks.
    fn check_accounting(
        &self,
        mut expected: Expected,
        problems: &mut Vec<String>,
        missing: &mut Vec<(u32, String)>,
    ) -> Result<u64> {
        problems.extend(
            expected.mismatched.iter().map(|(hash, a, b)| {
                format!("chunk {} has ids {a} and {b} in manifests", hex(hash))
            }),
        );
        let (indexed, staged) = self.check_index(&mut expected, problems)?;
        let (mut bytes, mut count) = self.check_chunk_data(indexed, problems, missing)?;
        let (legacy_bytes, legacy_count) = self.check_legacy(&mut expected, problems)?;
        bytes += legacy_bytes;
        count += legacy_count;

        let ctx = || "reading table packed".to_owned();
        let packed = self.txn.open_table(PACKED).context(ctx)?;
        for entry in packed.range::<(u64, u32)>(..).context(ctx)? {
            let (_, value) = entry.context(ctx)?;
            bytes += value.value().len() as u64;
        }
        let meta = self
            .txn
            .open_table(META)
            .context(|| "opening table meta".to_owned())?;
        for (key, actual) in [(META_STORED_BYTES, bytes), (META_STORED_CHUNKS, count)] {
            let recorded = meta_u64(&meta, key)?;
            if recorded != actual {
                problems.push(format!(
                    "meta {key} says {recorded}, the chunks hold {actual}"
                ));
            }
        }
        Ok(staged)
    }

    /// Check the index against the manifests; returns id -> (hash, staged)
    /// and the number of staged chunks.
    #[allow(clippy::type_complexity)]
    fn check_index(
        &self,
        expected: &mut Expected,
        problems: &mut Vec<String>,
    ) -> Result<(HashMap<u64, (Hash, bool)>, u64)> {
        let ctx = || "reading table chunk_index".to_owned();
        let mut indexed: HashMap<u64, (Hash, bool)> = HashMap::new();
        let mut staged_chunks = 0;
        let Some(index) = self.optional(CHUNK_INDEX)? else {
            return Ok((indexed, 0));
        };
        for entry in index.range::<&[u8; 32]>(..).context(ctx)? {
            let (hash, value) = entry.context(ctx)?;
            let (hash, (id, uses)) = (*hash.value(), value.value());
            // Written by a commit still under way: used by no step, not
            // counted yet.
            let staged = uses == 0 && !expected.chunks.contains_key(&hash);
            if let Some((other, _)) = indexed.insert(id, (hash, staged)) {
                problems.push(format!(
                    "chunks {} and {} share id {id}",
                    hex(&other),
                    hex(&hash)
                ));
            }
            if staged {
                staged_chunks += 1;
                continue;
            }
            let want = expected.chunks.remove(&hash);
            if want != Some((id, uses)) {
                let (want_id, want_uses) =
                    want.map_or(("none".to_owned(), 0), |(i, u)| (i.to_string(), u));
                problems.push(format!(
                    "chunk {} is indexed as id {id} with {uses} uses, manifests say id {want_id} with {want_uses}",
                    hex(&hash)
                ));
            }
        }
        for hash in expected.chunks.keys() {
            problems.push(format!("chunk {} is used but not indexed", hex(hash)));
        }
        Ok((indexed, staged_chunks))
    }

    /// Check `chunk_data` and the pack files against the index; returns
    /// the bytes and chunks held by chunks in use.
    fn check_chunk_data(
        &self,
        mut indexed: HashMap<u64, (Hash, bool)>,
        problems: &mut Vec<String>,
        missing: &mut Vec<(u32, String)>,
    ) -> Result<(u64, u64)> {
        let ctx = || "reading table chunk_data".to_owned();
        let (mut bytes, mut count) = (0, 0);
        if let Some(data) = self.optional(CHUNK_DATA)? {
            for entry in data.range::<u64>(..).context(ctx)? {
                let (id, value) = entry.context(ctx)?;
                match indexed.remove(&id.value()) {
                    Some((_, true)) => {}
                    Some((_, false)) => {
                        bytes += value.value().len() as u64;
                        count += 1;
                    }
                    None => {
                        problems.push(format!("chunk id {} is stored but not indexed", id.value()));
                    }
                }
            }
        }
        let (pack_bytes, pack_count) = self.check_packs(&mut indexed, problems, missing)?;
        for (id, (hash, _)) in indexed {
            problems.push(format!(
                "chunk {} (id {id}) is indexed but not stored",
                hex(&hash)
            ));
        }
        Ok((bytes + pack_bytes, count + pack_count))
    }

    /// Check `pack_chunks` against the index (taking the chunks it holds
    /// out of `indexed`) and `pack_files` against both and the files on
    /// disk; returns the bytes and chunks held by pack chunks in use.
    fn check_packs(
        &self,
        indexed: &mut HashMap<u64, (Hash, bool)>,
        problems: &mut Vec<String>,
        missing: &mut Vec<(u32, String)>,
    ) -> Result<(u64, u64)> {
        let (mut bytes, mut count) = (0, 0);
        let Some(chunks) = self.optional(PACK_CHUNKS)? else {
            return Ok((0, 0));
        };
        // Pack file -> (bytes of live chunks, end of the last chunk).
        let mut packs: HashMap<u32, (u64, u64)> = HashMap::new();
        let ctx = || "reading table pack_chunks".to_owned();
        for entry in chunks.range::<u64>(..).context(ctx)? {
            let (id, value) = entry.context(ctx)?;
            let id = id.value();
            let loc = PackLoc::decode(id, value.value())?;
            let pack = packs.entry(loc.pack).or_default();
            pack.0 += u64::from(loc.len);
            pack.1 = pack.1.max(loc.end());
            match indexed.remove(&id) {
                Some((hash, staged)) => {
                    if hash != loc.hash {
                        problems.push(format!(
                            "chunk id {id} is indexed as {} and packed as {}",
                            hex(&hash),
                            hex(&loc.hash)
                        ));
                    }
                    if !staged {
                        bytes += u64::from(loc.len);
                        count += 1;
                    }
                }
                None => problems.push(format!("chunk id {id} is packed but not indexed")),
            }
        }
        let ctx = || "reading table pack_files".to_owned();
        let mut recorded = HashMap::new();
        if let Some(files) = self.optional(PACK_FILES)? {
            for entry in files.range::<u32>(..).context(ctx)? {
                let (pack, value) = entry.context(ctx)?;
                recorded.insert(pack.value(), value.value());
            }
        }
        for (pack, (live, end)) in &packs {
            let name = pack_name(*pack);
            match recorded.remove(pack) {
                None => problems.push(format!("pack file {name} holds chunks but is not recorded")),
                Some((len, recorded_live)) => {
                    if recorded_live != *live || *end > len {
                        problems.push(format!(
                            "pack file {name} is recorded with {recorded_live} live bytes of \
                             {len}; its chunks hold {live} and end at {end}"
                        ));
                    }
                    self.check_pack_file(*pack, len, problems, missing);
                }
            }
        }
        for pack in recorded.keys() {
            problems.push(format!(
                "pack file {} is recorded but holds no chunk",
                pack_name(*pack)
            ));
        }
        Ok((bytes, count))
    }

    /// The recorded pack files, their bytes, and the files no record names.
    fn pack_structure(&self, report: &mut VerifyReport) -> Result<()> {
        let mut recorded = Vec::new();
        if let Some(files) = self.optional(PACK_FILES)? {
            let ctx = || "reading table pack_files".to_owned();
            for entry in files.range::<u32>(..).context(ctx)? {
                let (id, value) = entry.context(ctx)?;
                let (len, live) = value.value();
                recorded.push(id.value());
                report.pack_bytes += len;
                report.pack_live_bytes += live;
            }
        }
        report.pack_files = recorded.len() as u64;
        let Some(dir) = &self.packs else {
            return Ok(());
        };
        // Ids are given out in ascending order: a file at or past the next
        // one belongs to a transaction that had not committed when this
        // read began (under way, or killed before its commit).
        let meta = self
            .txn
            .open_table(META)
            .context(|| "opening table meta".to_owned())?;
        let next = meta_u64(&meta, META_NEXT_PACK)?;
        for (id, path) in super::packs::unrecorded(dir, &recorded)? {
            if u64::from(id) >= next {
                report.in_flight_pack_files += 1;
            } else {
                report.stray_packs.push(path);
            }
        }
        Ok(())
    }

    /// Check that pack file `pack` is at least `len` bytes long (a file
    /// not there goes to `missing`).
    fn check_pack_file(
        &self,
        pack: u32,
        len: u64,
        problems: &mut Vec<String>,
        missing: &mut Vec<(u32, String)>,
    ) {
        let Some(dir) = &self.packs else {
            return;
        };
        let path = dir.file(pack);
        match dir.io.len(&path) {
            Ok(n) if n >= len => {}
            Ok(n) => problems.push(format!(
                "pack file {} is {n} bytes, its record says {len}",
                path.display()
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                missing.push((pack, format!("pack file {} is missing", path.display())));
            }
            Err(e) => problems.push(format!("pack file {}: {e}", path.display())),
        }
    }

    /// Check format 1's chunks and counts; returns the bytes and chunks
    /// they hold.
    fn check_legacy(
        &self,
        expected: &mut Expected,
        problems: &mut Vec<String>,
    ) -> Result<(u64, u64)> {
        let (mut bytes, mut count) = (0, 0);
        if let Some(refs) = self.optional(LEGACY_REFS)? {
            let ctx = || "reading table refs".to_owned();
            for entry in refs.range::<&[u8; 32]>(..).context(ctx)? {
                let (hash, uses) = entry.context(ctx)?;
                let (hash, uses) = (*hash.value(), uses.value());
                let want = expected.legacy.remove(&hash).unwrap_or(0);
                if want != uses {
                    problems.push(format!(
                        "format 1 chunk {} has {uses} references recorded, {want} in manifests",
                        hex(&hash)
                    ));
                }
            }
            let ctx = || "reading table chunks".to_owned();
            if let Some(chunks) = self.optional(LEGACY_CHUNKS)? {
                for entry in chunks.range::<&[u8; 32]>(..).context(ctx)? {
                    let (hash, value) = entry.context(ctx)?;
                    bytes += value.value().len() as u64;
                    count += 1;
                    if refs.get(hash.value()).context(ctx)?.is_none() {
                        problems.push(format!(
                            "format 1 chunk {} is stored but unreferenced",
                            hex(hash.value())
                        ));
                    }
                }
            }
        }
        for hash in expected.legacy.keys() {
            problems.push(format!(
                "format 1 chunk {} is used but has no reference count",
                hex(hash)
            ));
        }
        Ok((bytes, count))
    }
}

impl Expected {
    fn record<'m>(&mut self, uses: impl Iterator<Item = ChunkUse<'m>>) {
        for chunk in uses {
            match chunk {
                ChunkUse::Current(c) => {
                    let e = self.chunks.entry(c.hash).or_insert((c.id, 0));
                    e.1 += 1;
                    if e.0 != c.id {
                        self.mismatched.push((c.hash, e.0, c.id));
                    }
                }
                ChunkUse::Format1(hash) => *self.legacy.entry(*hash).or_insert(0) += 1,
            }
        }
    }
}
