//! Steps saved through `torch.distributed.checkpoint` by `ckptstore.dcp`:
//! their index (the metadata DCP's planner wrote, kept as JSON in the
//! coordinator's shard under [`DCP_METADATA`]) and consolidation into one
//! safetensors file of whole tensors, without Python.
//!
//! The JSON: `{"format": 1, "state_dict": {FQN: {"dtype", "size",
//! "chunks": [{"offsets", "sizes"}]} | {"bytes": true}}, "storage":
//! [{"fqn", "offset", "rank", "entry"}]}`: each stored box of a tensor is
//! entry `entry` of rank `rank`'s shard, its elements row-major.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use serde::Deserialize;

use crate::remote::read::pieces::GlobalStep;
use crate::remote::Remote;
use crate::{Dtype, Error, Result};

/// The entry of the coordinator's shard that holds DCP's metadata.
pub const DCP_METADATA: &str = ".dcp/metadata.json";

/// Bytes of a stored box read at a time while consolidating.
const WINDOW: u64 = 32 << 20;

/// The dtype of a tensor of a DCP step.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DcpDtype {
    /// A dtype of the safetensors list (its boxes stored as typed tensors).
    Stored(Dtype),
    /// A torch dtype safetensors has no name for (`torch.complex128`,
    /// `torch.complex32`): its boxes are stored as their bytes, and it
    /// cannot be consolidated into a safetensors file.
    Torch {
        /// Its torch name (`torch.complex128`).
        name: String,
        /// Bytes per element.
        item_bytes: u64,
    },
}

impl DcpDtype {
    /// Its name: the safetensors one (`F32`), or the torch one.
    pub fn name(&self) -> &str {
        match self {
            DcpDtype::Stored(d) => d.name(),
            DcpDtype::Torch { name, .. } => name,
        }
    }

    /// Bytes per element.
    pub fn item_bytes(&self) -> u64 {
        match self {
            DcpDtype::Stored(d) => d.bits() / 8,
            DcpDtype::Torch { item_bytes, .. } => *item_bytes,
        }
    }
}

/// A tensor of a DCP step: its global dtype and shape, and the boxes it is
/// stored in.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DcpTensor {
    /// The dtype.
    pub dtype: DcpDtype,
    /// The global shape.
    pub shape: Vec<u64>,
    /// Each stored box: its offsets and sizes in the global tensor.
    pub boxes: Vec<(Vec<u64>, Vec<u64>)>,
}

/// What a DCP step holds ([`Remote::dcp_index`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DcpIndex {
    /// The step.
    pub step: u64,
    /// How many ranks saved it.
    pub world_size: u32,
    /// Tensors by fully qualified name.
    pub tensors: BTreeMap<String, DcpTensor>,
    /// Names of the non-tensor values (DCP's own `torch.save` bytes).
    pub values: Vec<String>,
}

#[derive(Deserialize)]
struct Json {
    format: u32,
    state_dict: BTreeMap<String, JsonEntry>,
    storage: Vec<JsonWhere>,
}

#[derive(Deserialize)]
struct JsonEntry {
    #[serde(default)]
    dtype: Option<String>,
    /// Bytes per element, for a torch dtype safetensors has no name for.
    #[serde(default)]
    itemsize: Option<u64>,
    #[serde(default)]
    size: Vec<u64>,
    #[serde(default)]
    chunks: Vec<JsonChunk>,
    #[serde(default)]
    bytes: bool,
}

#[derive(Deserialize)]
struct JsonChunk {
    offsets: Vec<u64>,
    sizes: Vec<u64>,
}

#[derive(Deserialize)]
struct JsonWhere {
    fqn: String,
    offset: Option<Vec<u64>>,
    rank: u32,
    entry: String,
}

/// Where each stored box is: (fqn, offsets) -> (rank, entry).
type Places = HashMap<(String, Vec<u64>), (u32, String)>;

impl Remote {
    /// The index of step `step` if `ckptstore.dcp` saved it: its tensors
    /// with their global shapes and stored boxes; `None` for a step that is
    /// not complete or was not saved through DCP.
    ///
    /// # Errors
    /// [`Error::Corrupt`] when the metadata is damaged; [`Error::Remote`]
    /// when the bucket fails.
    pub fn dcp_index(&self, step: u64) -> Result<Option<DcpIndex>> {
        Ok(self.dcp_open(step)?.map(|(_, index, _)| index))
    }

    fn dcp_open(&self, step: u64) -> Result<Option<(GlobalStep, DcpIndex, Places)>> {
        let Some(global) = self.open_global(step)? else {
            return Ok(None);
        };
        // The coordinator's shard holds it: rank 0's, unless the save's
        // coordinator had another rank.
        let mut owner = None;
        for r in 0..global.world_size() {
            if let Some(e) = self.entries(&global, r)?.get(DCP_METADATA) {
                owner = Some((r, e.len));
                break;
            }
        }
        let Some((rank, len)) = owner else {
            return Ok(None);
        };
        let mut got = self.read_pieces(&global, &[(rank, DCP_METADATA, 0, len)])?;
        let bytes = got.pop().unwrap_or_default();
        let corrupt = |why: String| Error::corrupt(Some(step), format!("{DCP_METADATA}: {why}"));
        let json: Json = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
        if json.format != 1 {
            return Err(corrupt(format!(
                "format {} is not one this build reads",
                json.format
            )));
        }
        let mut index = DcpIndex {
            step,
            world_size: global.world_size(),
            tensors: BTreeMap::new(),
            values: Vec::new(),
        };
        for (fqn, e) in json.state_dict {
            if e.bytes {
                index.values.push(fqn);
                continue;
            }
            let name = e.dtype.unwrap_or_default();
            let dtype = match (Dtype::from_name(&name), e.itemsize) {
                (Some(d), _) if d.bits() % 8 == 0 => DcpDtype::Stored(d),
                (None, Some(item_bytes)) if name.starts_with("torch.") && item_bytes > 0 => {
                    DcpDtype::Torch { name, item_bytes }
                }
                _ => return Err(corrupt(format!("{fqn}: unknown dtype {name:?}"))),
            };
            let boxes = e.chunks.into_iter().map(|c| (c.offsets, c.sizes)).collect();
            let t = DcpTensor {
                dtype,
                shape: e.size,
                boxes,
            };
            index.tensors.insert(fqn, t);
        }
        let places = json
            .storage
            .into_iter()
            .filter_map(|w| Some(((w.fqn, w.offset?), (w.rank, w.entry))))
            .collect();
        Ok(Some((global, index, places)))
    }

    /// Write DCP step `step` to `path` as one safetensors file of whole
    /// tensors under their fully qualified names (with `prefix`, only the
    /// names under it, the prefix stripped: `"model."` gives a file an
    /// unsharded model's `load_state_dict` takes). One tensor is in memory
    /// at a time, read in windows of 32 MiB; every chunk is hash-checked;
    /// the file is written durably, or not at all. The names written.
    ///
    /// # Errors
    /// [`Error::StepNotFound`] when the step is not a complete DCP step;
    /// [`Error::InvalidCheckpoint`] naming a chosen tensor whose dtype
    /// safetensors cannot hold ([`DcpDtype::Torch`]: leave it out with a
    /// prefix, or load it through `ckptstore.dcp`);
    /// [`Error::Corrupt`] for damaged data or metadata (a box not stored,
    /// boxes that do not cover a tensor); I/O errors naming `path`.
    pub fn consolidate(&self, step: u64, path: &Path, prefix: Option<&str>) -> Result<Vec<String>> {
        let (global, index, places) = self.dcp_open(step)?.ok_or(Error::StepNotFound { step })?;
        let chosen: Vec<(String, &String, &DcpTensor)> = index
            .tensors
            .iter()
            .filter_map(|(fqn, t)| match prefix {
                Some(p) => fqn.strip_prefix(p).map(|n| (n.to_owned(), fqn, t)),
                None => Some((fqn.clone(), fqn, t)),
            })
            .collect();
        if let Some((_, fqn, t)) = chosen
            .iter()
            .find(|(_, _, t)| !matches!(t.dtype, DcpDtype::Stored(_)))
        {
            return Err(Error::InvalidCheckpoint {
                step,
                reason: format!(
                    "tensor {fqn} is {}, which a safetensors file cannot hold: consolidate \
                     the others (a prefix that leaves it out), or load it with ckptstore.dcp",
                    t.dtype.name()
                ),
            });
        }
        let header = header(step, &chosen)?;
        // A failure to read a tensor keeps its own kind, not the file's.
        let mut failed = None;
        let written = crate::file::write_durably_with(path, |file| {
            let mut out = std::io::BufWriter::new(file);
            out.write_all(&(header.len() as u64).to_le_bytes())?;
            out.write_all(&header)?;
            for (_, fqn, t) in &chosen {
                match self.whole_tensor(&global, &places, fqn, t) {
                    Ok(data) => out.write_all(&data)?,
                    Err(e) => {
                        failed = Some(e);
                        return Err(std::io::Error::other("reading a tensor failed"));
                    }
                }
            }
            out.flush()
        });
        if let Some(e) = failed {
            return Err(e);
        }
        written?;
        Ok(chosen.into_iter().map(|(name, _, _)| name).collect())
    }

    /// Tensor `fqn`, whole, from its stored boxes.
    fn whole_tensor(
        &self,
        global: &GlobalStep,
        places: &Places,
        fqn: &str,
        t: &DcpTensor,
    ) -> Result<Vec<u8>> {
        let step = global.step();
        let corrupt = |why: String| Error::corrupt(Some(step), format!("{fqn}: {why}"));
        let item = t.dtype.item_bytes();
        let numel = t.shape.iter().product::<u64>();
        let len = usize::try_from(numel * item).map_err(|_| corrupt("too large".into()))?;
        let mut out = vec![0u8; len];
        let mut covered = 0u64;
        for (offsets, sizes) in &t.boxes {
            let (rank, entry) = places
                .get(&(fqn.to_owned(), offsets.clone()))
                .ok_or_else(|| corrupt(format!("the box at {offsets:?} is not stored")))?;
            let layout = BoxLayout::new(&t.shape, offsets, sizes, item)
                .ok_or_else(|| corrupt(format!("the box at {offsets:?} is outside the tensor")))?;
            let total = layout.rows * layout.row_bytes;
            let mut at = 0;
            while at < total {
                let n = WINDOW.min(total - at);
                let got = self.read_pieces(global, &[(*rank, entry, at, n)])?;
                layout.place(&mut out, at, &got[0]);
                at += n;
            }
            covered += sizes.iter().product::<u64>();
        }
        if covered != numel {
            return Err(corrupt(format!(
                "its boxes hold {covered} of its {numel} elements"
            )));
        }
        Ok(out)
    }
}

/// A box of a row-major tensor: rows (runs along the last dimension) and
/// where each row goes in the whole tensor.
struct BoxLayout {
    /// Strides of the whole tensor, in elements.
    strides: Vec<u64>,
    offsets: Vec<u64>,
    /// Sizes of the box but its last dimension.
    outer: Vec<u64>,
    rows: u64,
    row_bytes: u64,
    item: u64,
}

impl BoxLayout {
    fn new(shape: &[u64], offsets: &[u64], sizes: &[u64], item: u64) -> Option<Self> {
        let fits = shape.len() == offsets.len()
            && shape.len() == sizes.len()
            && (0..shape.len()).all(|d| {
                offsets[d]
                    .checked_add(sizes[d])
                    .is_some_and(|e| e <= shape[d])
            });
        if !fits {
            return None;
        }
        let mut strides = vec![1u64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        let (outer, last) = match sizes.split_last() {
            Some((last, outer)) => (outer.to_vec(), *last),
            None => (Vec::new(), 1),
        };
        Some(BoxLayout {
            strides,
            offsets: offsets.to_vec(),
            rows: outer.iter().product(),
            outer,
            row_bytes: last * item,
            item,
        })
    }

    /// Where row `r` of the box starts in the whole tensor, in bytes.
    fn row_start(&self, mut r: u64) -> u64 {
        let mut element = 0;
        let dims = self.outer.len();
        for d in (0..dims).rev() {
            let i = r % self.outer[d];
            r /= self.outer[d];
            element += (self.offsets[d] + i) * self.strides[d];
        }
        if let Some(last) = self.offsets.last() {
            element += last * self.strides[dims];
        }
        element * self.item
    }

    /// Copy `bytes`, the box's bytes from `at`, to their places in `out`.
    fn place(&self, out: &mut [u8], at: u64, bytes: &[u8]) {
        if self.row_bytes == 0 {
            return;
        }
        let end = at + bytes.len() as u64;
        let mut pos = at;
        while pos < end {
            let row = pos / self.row_bytes;
            let in_row = pos % self.row_bytes;
            let n = (self.row_bytes - in_row).min(end - pos);
            let dst = usize::try_from(self.row_start(row) + in_row).unwrap_or(usize::MAX);
            let src = usize::try_from(pos - at).unwrap_or(usize::MAX);
            let n = usize::try_from(n).unwrap_or(0);
            out[dst..dst + n].copy_from_slice(&bytes[src..src + n]);
            pos += n as u64;
        }
    }
}

/// The safetensors header of `chosen`, padded to 8 bytes.
fn header(step: u64, chosen: &[(String, &String, &DcpTensor)]) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("ckptstore.step".into(), step.to_string().into());
    meta.insert(
        "ckptstore.source".into(),
        "torch.distributed.checkpoint".into(),
    );
    map.insert("__metadata__".into(), meta.into());
    let mut at = 0u64;
    for (name, _, t) in chosen {
        let len = t.shape.iter().product::<u64>() * t.dtype.item_bytes();
        map.insert(
            name.clone(),
            serde_json::json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [at, at + len]}),
        );
        at += len;
    }
    let mut bytes = serde_json::to_vec(&map).map_err(|e| Error::Json {
        path: None,
        source: Box::new(e),
    })?;
    while bytes.len() % 8 != 0 {
        bytes.push(b' ');
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::BoxLayout;

    #[test]
    fn a_box_lands_where_its_rows_belong() {
        // A 3x4 tensor of bytes; the box rows 1..3, columns 1..3.
        let layout = BoxLayout::new(&[3, 4], &[1, 1], &[2, 2], 1).expect("fits");
        let mut out = vec![0u8; 12];
        layout.place(&mut out, 0, &[1, 2, 3, 4]);
        assert_eq!(out, [0, 0, 0, 0, 0, 1, 2, 0, 0, 3, 4, 0]);
        // In two windows that split a row.
        let mut again = vec![0u8; 12];
        layout.place(&mut again, 0, &[1]);
        layout.place(&mut again, 1, &[2, 3, 4]);
        assert_eq!(again, out);
        assert!(BoxLayout::new(&[3, 4], &[2, 0], &[2, 4], 1).is_none());
    }
}
