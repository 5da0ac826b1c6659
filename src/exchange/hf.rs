//! Tensors out as a Hugging Face checkpoint directory: safetensors shards
//! of at most a given size, `model-00001-of-00003.safetensors` and so on,
//! and `model.safetensors.index.json` naming the shard of each tensor (one
//! shard is written as `model.safetensors`, with no index, as Hugging Face
//! does).
//!
//! A killed export never leaves an index naming a missing, partial or
//! overwritten shard: an index already in the directory is removed first
//! (durably), each shard is written under a temporary name and renamed
//! durably, and the index is written last, the same way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::float::{read_float, write_float};
pub(crate) use super::write::Source;
use super::write::{write_tensors, Head};
use crate::{Dtype, Error, Result};

/// The default largest shard: Hugging Face's `max_shard_size="5GB"`.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;
/// The index file's name.
pub const INDEX_NAME: &str = "model.safetensors.index.json";
/// The file of a one-shard export.
pub const SINGLE_NAME: &str = "model.safetensors";

/// What an export to a Hugging Face directory wrote
/// ([`CheckpointStore::export_hf`](crate::CheckpointStore::export_hf),
/// `Remote::export_hf`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HfExport {
    /// The shard files, in order (file names in the directory).
    pub shards: Vec<String>,
    /// The tensors written, by name, with the shard holding each.
    pub weight_map: BTreeMap<String, String>,
    /// Bytes of tensor data in all shards (the index's `total_size`).
    pub total_size: u64,
}

/// A floating dtype a Hugging Face export may cast to.
pub fn cast_dtype(name: &str) -> Option<Dtype> {
    match name.to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => Some(Dtype::BF16),
        "f16" | "fp16" | "float16" => Some(Dtype::F16),
        "f32" | "fp32" | "float32" => Some(Dtype::F32),
        _ => None,
    }
}

/// Whether tensors of `dtype` are cast (the floats of 16 bits and more;
/// 8-bit and smaller floats keep their dtype).
fn castable(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F64 | Dtype::F32 | Dtype::BF16 | Dtype::F16)
}

/// Write `tensors` (in this order) into `dir` as Hugging Face shards of at
/// most `max_shard` bytes each (a larger tensor is a shard alone), floating
/// tensors cast to `cast` if given. One tensor is in memory at a time
/// (and its stored bytes beside it when a cast narrows it). `step` names
/// the step in errors.
pub(crate) fn export(
    step: u64,
    dir: &Path,
    mut tensors: Vec<Source<'_>>,
    max_shard: u64,
    cast: Option<Dtype>,
) -> Result<HfExport> {
    let heads: Vec<Head> = tensors
        .iter()
        .map(|t| head(step, t, cast))
        .collect::<Result<_>>()?;
    let plan = plan_shards(&heads, max_shard);
    let names = shard_names(plan.len());
    // Before anything is written: no index names a shard about to be
    // overwritten, and no single file shadows a sharded export (Hugging
    // Face loads `model.safetensors` first).
    crate::file::remove_durably(&dir.join(INDEX_NAME))?;
    if names.len() > 1 {
        crate::file::remove_durably(&dir.join(SINGLE_NAME))?;
    }
    let mut export = HfExport {
        shards: names.clone(),
        weight_map: BTreeMap::new(),
        total_size: heads.iter().map(|h| h.len).sum(),
    };
    let mut meta = BTreeMap::new();
    meta.insert("format", "pt".to_owned());
    let mut next = 0;
    for (shard, name) in plan.iter().zip(&names) {
        let these = &heads[next..next + shard];
        let sources = &mut tensors[next..next + shard];
        let mut i = 0;
        write_tensors(&dir.join(name), step, &meta, these, &mut |h, out| {
            let source = &mut sources[i];
            i += 1;
            fill_cast(source, h.dtype, out)
        })?;
        for h in these {
            export.weight_map.insert(h.name.clone(), name.clone());
        }
        next += shard;
    }
    if names.len() > 1 {
        write_index(dir, &export)?;
    }
    remove_stale_shards(dir, &names)?;
    Ok(export)
}

/// Remove the shards of an earlier export that this one did not write
/// (`model-NNNNN-of-MMMMM.safetensors`): no index names them any more.
fn remove_stale_shards(dir: &Path, written: &[String]) -> Result<()> {
    let listing = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    for entry in listing {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_shard_name(&name) && !written.contains(&name) {
            crate::file::remove_durably(&entry.path())?;
        }
    }
    Ok(())
}

/// Whether `name` is `model-NNNNN-of-MMMMM.safetensors`.
fn is_shard_name(name: &str) -> bool {
    let Some(middle) = name
        .strip_prefix("model-")
        .and_then(|n| n.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    middle
        .split_once("-of-")
        .is_some_and(|(i, n)| digits(i) && digits(n))
}

/// The head of `t` as written (after the cast).
fn head(step: u64, t: &Source<'_>, cast: Option<Dtype>) -> Result<Head> {
    let dtype = match cast {
        Some(to) if castable(t.dtype) => to,
        _ => t.dtype,
    };
    let numel = t.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    let len = numel
        .and_then(|n| n.checked_mul(dtype.bits()))
        .map(|bits| bits.div_ceil(8))
        .ok_or_else(|| Error::InvalidCheckpoint {
            step,
            reason: format!("tensor {} has too many elements", t.name),
        })?;
    Ok(Head {
        name: t.name.clone(),
        dtype,
        shape: t.shape.clone(),
        len,
    })
}

/// How many tensors each shard holds, in order: a shard is closed before
/// the tensor that would take it past `max` bytes (Hugging Face's rule).
fn plan_shards(heads: &[Head], max: u64) -> Vec<usize> {
    let mut plan = Vec::new();
    let (mut count, mut size) = (0usize, 0u64);
    for h in heads {
        if count > 0 && size + h.len > max {
            plan.push(count);
            (count, size) = (0, 0);
        }
        count += 1;
        size += h.len;
    }
    if count > 0 || plan.is_empty() {
        plan.push(count);
    }
    plan
}

/// `model.safetensors`, or `model-00001-of-0000N.safetensors` ...
fn shard_names(n: usize) -> Vec<String> {
    if n == 1 {
        return vec![SINGLE_NAME.to_owned()];
    }
    (1..=n)
        .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
        .collect()
}

/// `source`'s bytes, cast to `to`, into `out` (of the cast length).
fn fill_cast(source: &mut Source<'_>, to: Dtype, out: &mut [u8]) -> Result<()> {
    if source.dtype == to {
        return (source.fill)(out);
    }
    let from = source.dtype;
    let (from_size, to_size) = (from.bits() / 8, to.bits() / 8);
    let numel = out.len() / usize::try_from(to_size).unwrap_or(1).max(1);
    let stored = numel * usize::try_from(from_size).unwrap_or(1);
    if stored <= out.len() {
        // Widening (or the same width): read into the front, cast in place.
        (source.fill)(&mut out[..stored])?;
        widen_in_place(out, from, to, numel);
        return Ok(());
    }
    let mut wide = vec![0u8; stored];
    (source.fill)(&mut wide)?;
    for i in 0..numel {
        let x = read_float(&wide, from, i);
        write_float(out, to, i, x);
    }
    Ok(())
}

/// Cast `numel` elements of `from` at the front of `buf` to `to`, which
/// is no narrower: from the last element back, so that element `i` is
/// read before the writes of elements `i..` (which lie at or after it)
/// reach it.
fn widen_in_place(buf: &mut [u8], from: Dtype, to: Dtype, numel: usize) {
    for i in (0..numel).rev() {
        let x = read_float(buf, from, i);
        write_float(buf, to, i, x);
    }
}

/// The index, written durably (after every shard).
fn write_index(dir: &Path, export: &HfExport) -> Result<()> {
    let index = serde_json::json!({
        "metadata": {"total_size": export.total_size},
        "weight_map": export.weight_map,
    });
    let path: PathBuf = dir.join(INDEX_NAME);
    let bytes = serde_json::to_vec_pretty(&index).map_err(|e| Error::Json {
        path: Some(path.clone()),
        source: Box::new(e),
    })?;
    crate::file::write_durably_with(&path, |file| std::io::Write::write_all(file, &bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heads(lens: &[u64]) -> Vec<Head> {
        lens.iter()
            .enumerate()
            .map(|(i, &len)| Head {
                name: format!("t{i}"),
                dtype: Dtype::U8,
                shape: vec![len],
                len,
            })
            .collect()
    }

    #[test]
    fn shards_close_before_the_tensor_that_would_overflow() {
        assert_eq!(plan_shards(&heads(&[4, 4, 4]), 10), vec![2, 1]);
        assert_eq!(plan_shards(&heads(&[20, 1, 1]), 10), vec![1, 2]);
        assert_eq!(plan_shards(&heads(&[1, 20, 1]), 10), vec![1, 1, 1]);
        assert_eq!(plan_shards(&heads(&[]), 10), vec![0]);
        assert_eq!(shard_names(1), ["model.safetensors"]);
        assert!(is_shard_name("model-00002-of-00003.safetensors"));
        assert!(!is_shard_name("model-2-of-3.safetensors") && !is_shard_name("model.safetensors"));
        assert_eq!(
            shard_names(2),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
    }

    #[test]
    fn casts_widen_in_place_and_narrow_through_a_buffer() -> Result<()> {
        let halves: Vec<u8> = [1.0f32, -2.5, 0.125, 3.0]
            .iter()
            .flat_map(|x| (x.to_bits() >> 16).to_le_bytes()[..2].to_vec())
            .collect();
        let mut source = Source {
            name: "t".into(),
            dtype: Dtype::BF16,
            shape: vec![4],
            fill: Box::new(|out: &mut [u8]| {
                out.copy_from_slice(&halves);
                Ok(())
            }),
        };
        let mut wide = vec![0u8; 16];
        fill_cast(&mut source, Dtype::F32, &mut wide)?;
        let got: Vec<f32> = wide
            .chunks(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            [1.0f32, -2.5, 0.125, 3.0].map(f32::to_bits)
        );
        let mut back = Source {
            name: "t".into(),
            dtype: Dtype::F32,
            shape: vec![4],
            fill: Box::new(|out: &mut [u8]| {
                out.copy_from_slice(&wide);
                Ok(())
            }),
        };
        let mut narrow = vec![0u8; 8];
        fill_cast(&mut back, Dtype::BF16, &mut narrow)?;
        assert_eq!(narrow, halves);
        Ok(())
    }
}
