//! What a reader checks of the bucket's manifests before it relies on
//! them (objects in a bucket are untrusted input): every count, length,
//! name and world size against the caps in [`layout`](crate::remote::format::layout),
//! before anything is allocated from them or added up.

use crate::checkpoint::MAX_TEXT_BYTES;
use crate::format::layout::{chunk_count, small_tail};
use crate::remote::format::hash::HexHash;
use crate::remote::format::layout::{GlobalManifest, MANIFEST_FORMAT, MAX_DIMS, MAX_WORLD_SIZE};
use crate::remote::format::manifest::{
    ManifestFormat, RemoteBlob, RemoteManifest, RemotePlace, RemoteTail, RemoteTensor,
};
use crate::remote::format::stored::Stored;
use crate::{Dtype, Tensor};

impl RemoteManifest {
    /// [`check`](Self::check) of a manifest about to be written: what the
    /// bucket's readers would refuse is refused before anything is put.
    pub(crate) fn check_to_write(&self, step: u64) -> crate::Result<()> {
        self.check(step)
            .map(drop)
            .map_err(|reason| crate::Error::InvalidCheckpoint {
                step,
                reason: format!("the bucket's readers would refuse it: {reason}"),
            })
    }

    /// Why a reader cannot rely on this manifest as step `step`'s, if it
    /// cannot: checked before anything is allocated from its numbers or
    /// added up. Else the step's logical bytes.
    pub(crate) fn check(&self, step: u64) -> std::result::Result<u64, String> {
        let tails = self.blobs.values().any(|b| b.tail().is_some());
        if tails && self.format < ManifestFormat::Tails {
            return Err(format!(
                "a blob tail in a manifest of format {}",
                self.format
            ));
        }
        if self.step != step {
            return Err(format!("the manifest is of step {}", self.step));
        }
        check_text("its loss CID", self.loss_cid.as_deref().unwrap_or_default())?;
        for name in self.metrics.keys() {
            check_text("a metric name", name)?;
        }
        for name in &self.save_record.names {
            check_text("a name of its save record", name)?;
        }
        if let Err(e) = self.save_record.check(step) {
            return Err(match e {
                crate::Error::InvalidCheckpoint { reason, .. } => reason,
                e => e.to_string(),
            });
        }
        // Hashes were decoded with the body (`HexHash`): none is checked here.
        let packed_len = self.packed.as_ref().map(|p| p.len);
        let mut total: u64 = 0;
        for (name, blob) in &self.blobs {
            check_text("a blob name", name)?;
            blob.check(name, packed_len)?;
            total = total
                .checked_add(blob.len)
                .ok_or("its blob lengths add up to more than 2^64 bytes")?;
        }
        self.check_packs()?;
        Ok(total)
    }

    /// Formats 3 and 4: every chunk it names lies inside a pack it lists,
    /// stored compressed only in format 4 and then in fewer bytes than its
    /// own; other formats list no packs.
    fn check_packs(&self) -> std::result::Result<(), String> {
        let (packs, index) = match (&self.packs, &self.index) {
            (None, None) if !self.format.has_packs() => return Ok(()),
            (Some(packs), Some(index)) if self.format.has_packs() => (packs, index),
            _ => {
                return Err(format!(
                    "packs and an index belong to manifest formats {} and {}, not {}",
                    ManifestFormat::Packs,
                    ManifestFormat::Compressed,
                    self.format
                ))
            }
        };
        if packs.len() > index.len() {
            return Err(format!("{} packs for {} chunks", packs.len(), index.len()));
        }
        let compressed = self.format == ManifestFormat::Compressed;
        let mut named = 0usize;
        let mut check = |hash: &HexHash, len: u64| -> std::result::Result<(), String> {
            named += 1;
            let Some(entry) = index.get(hash) else {
                return Err(format!("chunk {hash} is in no pack"));
            };
            if let Stored::Zstd { len: n, .. } = entry.stored {
                if !compressed || n == 0 || n >= len {
                    return Err(format!(
                        "chunk {hash} of {len} bytes is stored compressed in {n} (manifest format {})",
                        self.format
                    ));
                }
            }
            let stored = entry.stored.len(len);
            let inside = usize::try_from(entry.pack)
                .ok()
                .and_then(|p| packs.get(p))
                .is_some_and(|p| entry.at.checked_add(stored).is_some_and(|end| end <= p.len));
            if !inside {
                return Err(format!("chunk {hash} lies outside its pack"));
            }
            Ok(())
        };
        for blob in self.blobs.values() {
            for (hash, len) in blob.chunks().iter().zip(blob.chunk_lengths()) {
                check(hash, len as u64)?;
            }
        }
        if let Some(p) = &self.packed {
            check(&p.hash, p.len)?;
        }
        if index.len() > named {
            return Err(format!(
                "an index of {} chunks for {named} named",
                index.len()
            ));
        }
        Ok(())
    }
}

impl RemoteBlob {
    fn check(&self, name: &str, packed_len: Option<u64>) -> std::result::Result<(), String> {
        match &self.place {
            RemotePlace::Chunks { hashes, tail } => {
                let len = usize::try_from(self.len).ok();
                let expected = match tail {
                    None => len.map(chunk_count),
                    Some(tail) => {
                        let pieces = tail.check(name, len, packed_len)?;
                        len.map(|n| chunk_count(n) - pieces)
                    }
                };
                if expected != Some(hashes.len()) {
                    return Err(format!(
                        "blob {name:?}: {} bytes cannot lie in {} chunks",
                        self.len,
                        hashes.len()
                    ));
                }
            }
            RemotePlace::Packed { offset } => {
                let end = offset.checked_add(self.len);
                if packed_len.is_none_or(|p| end.is_none_or(|end| end > p)) {
                    return Err(format!("blob {name:?} lies outside the packed bytes"));
                }
            }
        }
        let Some(RemoteTensor { dtype, shape }) = &self.tensor else {
            return Ok(());
        };
        let dtype = Dtype::from_name(dtype)
            .ok_or_else(|| format!("tensor {name:?}: unknown dtype {dtype:.32?}"))?;
        if shape.len() > MAX_DIMS {
            return Err(format!(
                "tensor {name:?} has more than {MAX_DIMS} dimensions"
            ));
        }
        let want = Tensor::expected_bytes(dtype, shape)
            .map_err(|reason| format!("tensor {name:?}: {reason}"))?;
        if want != self.len {
            return Err(format!(
                "tensor {name:?}: shape {shape:?} of {dtype} needs {want} bytes, \
                 the manifest says {}",
                self.len
            ));
        }
        Ok(())
    }
}

impl RemoteTail {
    /// Why the tail of blob `name` (of `len` bytes) cannot be read from
    /// packed bytes of `packed_len`; else how many pieces it holds.
    fn check(
        &self,
        name: &str,
        len: Option<usize>,
        packed_len: Option<u64>,
    ) -> std::result::Result<usize, String> {
        let (pieces, bytes) = len.map_or((0, 0), small_tail);
        let end = self.offset.checked_add(bytes as u64);
        if pieces == 0 || packed_len.is_none_or(|p| end.is_none_or(|e| e > p)) {
            return Err(format!(
                "blob {name:?}: its tail lies outside the packed bytes"
            ));
        }
        Ok(pieces)
    }
}

impl GlobalManifest {
    /// Why a reader cannot rely on this as step `step`'s list of shards.
    pub(crate) fn check(&self, step: u64) -> std::result::Result<(), String> {
        if self.format != MANIFEST_FORMAT || self.step != step {
            return Err(format!(
                "a global manifest of format {} and step {}",
                self.format, self.step
            ));
        }
        if self.world_size == 0 || self.world_size > MAX_WORLD_SIZE {
            return Err(format!(
                "a world size of {} (at most {MAX_WORLD_SIZE})",
                self.world_size
            ));
        }
        if usize::try_from(self.world_size).ok() != Some(self.shards.len()) {
            return Err(format!(
                "{} shards for a world size of {}",
                self.shards.len(),
                self.world_size
            ));
        }
        Ok(())
    }
}

/// Refuse a metadata string longer than [`MAX_TEXT_BYTES`].
fn check_text(what: &str, text: &str) -> std::result::Result<(), String> {
    if text.len() > MAX_TEXT_BYTES {
        return Err(format!(
            "{what} is {} bytes long (at most {MAX_TEXT_BYTES})",
            text.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard of one 1 MiB blob: a chunk and a 128-byte tail at `offset`
    /// of packed bytes of `packed` bytes.
    fn manifest(format: u32, offset: u64, packed: u64, tail_hash: &str) -> RemoteManifest {
        serde_json::from_value(json(format, offset, packed, tail_hash)).expect("a manifest")
    }

    fn json(format: u32, offset: u64, packed: u64, tail_hash: &str) -> serde_json::Value {
        let h = "ab".repeat(32);
        serde_json::json!({
            "format": format, "step": 1, "timestamp": 0, "loss_cid": null, "metrics": {},
            "graph": {"edges": [], "nodes": {}},
            "blobs": {"w": {"len": 1 << 20, "chunks": [h], "tail": {"offset": offset, "hash": tail_hash}}},
            "packed": {"len": packed, "hash": h},
        })
    }

    #[test]
    fn a_tail_is_checked_before_it_is_read() {
        let h = "cd".repeat(32);
        assert_eq!(manifest(2, 100, 228, &h).check(1), Ok(1 << 20));
        let outside = manifest(2, 101, 228, &h).check(1).expect_err("outside");
        assert!(outside.contains("outside the packed bytes"), "{outside}");
        let old = manifest(1, 100, 228, &h).check(1).expect_err("format 1");
        assert!(old.contains("format 1"), "{old}");
        // A hash that is not one is refused as the body is decoded.
        let bad = serde_json::from_value::<RemoteManifest>(json(2, 100, 228, "zz"))
            .expect_err("bad hash")
            .to_string();
        assert!(bad.contains("64 lowercase hex digits"), "{bad}");
        let huge = manifest(2, u64::MAX, 228, &h)
            .check(1)
            .expect_err("overflow");
        assert!(huge.contains("outside"), "{huge}");
        // A format this build does not know is refused as it is decoded.
        for unknown in [0, 5, u32::MAX] {
            let newer = serde_json::from_value::<RemoteManifest>(json(unknown, 100, 228, &h))
                .expect_err("an unknown format")
                .to_string();
            assert!(
                newer.contains(&format!(
                    "manifest format {unknown} (this build reads 1 to 4)"
                )),
                "{newer}"
            );
        }
        let bare = manifest(3, 100, 228, &h).check(1).expect_err("no packs");
        assert!(bare.contains("packs and an index"), "{bare}");
    }

    /// A step of one blob of one 1 MiB - 128 B chunk in a pack of
    /// `pack_len` bytes, at index entry `entry`.
    fn packed(format: u32, entry: &serde_json::Value, pack_len: u64) -> RemoteManifest {
        let (h, p) = ("ab".repeat(32), "cd".repeat(32));
        serde_json::from_value(serde_json::json!({
            "format": format, "step": 1, "timestamp": 0, "loss_cid": null, "metrics": {},
            "graph": {"edges": [], "nodes": {}},
            "blobs": {"w": {"len": (1 << 20) - 128, "chunks": [h]}},
            "packed": null,
            "packs": [{"hash": p, "len": pack_len}],
            "index": {h: entry},
        }))
        .expect("a manifest")
    }

    #[test]
    fn a_compressed_chunk_is_checked_before_it_is_read() {
        let raw = (1u64 << 20) - 128;
        let ok = |format, entry: serde_json::Value, len| packed(format, &entry, len).check(1);
        assert_eq!(ok(3, serde_json::json!([0, 0]), raw), Ok(raw));
        assert_eq!(ok(4, serde_json::json!([0, 0]), raw), Ok(raw));
        assert_eq!(ok(4, serde_json::json!([0, 10, 500, 2]), 510), Ok(raw));
        for (format, entry, len, why) in [
            // Compressed only in format 4.
            (
                3,
                serde_json::json!([0, 0, 500, 2]),
                500,
                "stored compressed",
            ),
            // Not fewer bytes than its own, or none.
            (
                4,
                serde_json::json!([0, 0, raw, 2]),
                raw,
                "stored compressed",
            ),
            (4, serde_json::json!([0, 0, 0, 2]), raw, "stored compressed"),
            // Its stored bytes past its pack's end.
            (
                4,
                serde_json::json!([0, 11, 500, 2]),
                510,
                "outside its pack",
            ),
            (
                4,
                serde_json::json!([0, u64::MAX, 500, 2]),
                510,
                "outside its pack",
            ),
        ] {
            let e = ok(format, entry, len).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn a_global_manifest_is_decoded_and_checked_before_any_shard_is_read() {
        let h = "ab".repeat(32);
        let global = |format: u32, step: u64, world: u64, shards: usize| {
            serde_json::json!({"format": format, "step": step, "world_size": world,
                "shards": vec![h.clone(); shards]})
        };
        let read = |v: serde_json::Value| serde_json::from_value::<GlobalManifest>(v);
        let ok = read(global(1, 9, 2, 2)).expect("decodes");
        assert_eq!(ok.check(9), Ok(()));
        assert_eq!(ok, GlobalManifest::of(9, &ok_names(&ok)));
        for (v, step, why) in [
            (global(2, 9, 2, 2), 9, "format 2"),
            (global(1, 8, 2, 2), 9, "step 8"),
            (global(1, 9, 0, 0), 9, "world size of 0"),
            (global(1, 9, u64::from(MAX_WORLD_SIZE) + 1, 0), 9, "at most"),
            (global(1, 9, 3, 2), 9, "2 shards for a world size of 3"),
        ] {
            let e = read(v).expect("decodes").check(step).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
        // Not a hash, or a world size past u32: refused as it is decoded.
        let mut bad = global(1, 9, 1, 1);
        bad["shards"][0] = "xyz".into();
        assert!(read(bad).is_err());
        assert!(read(global(1, 9, 1 << 33, 1)).is_err());
    }

    fn ok_names(m: &GlobalManifest) -> Vec<crate::remote::format::layout::ShardName> {
        let world_size = m.world_size;
        (0..world_size)
            .zip(&m.shards)
            .map(|(rank, hash)| crate::remote::format::layout::ShardName {
                rank,
                world_size,
                hash: hash.0,
            })
            .collect()
    }
}
