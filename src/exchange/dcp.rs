//! The metadata `ckptstore.dcp` keeps beside a DCP step, and the layout
//! of a stored box in its whole tensor.
//!
//! `ckptstore.dcp` stores the metadata DCP's planner wrote as JSON in the
//! coordinator's shard, entry [`DCP_METADATA`] (its schema:
//! [`DcpDocument`](super::dcp_doc::DcpDocument)). Each stored box of a
//! tensor is entry `entry` of rank `rank`'s shard, its elements
//! row-major. The bytes are untrusted: a
//! damaged document is [`Error::Corrupt`], and a box is placed only once
//! [`BoxLayout::new`] has checked that it lies inside its tensor.

use std::collections::{BTreeMap, HashMap};

use super::dcp_doc::DcpDocument;
pub use super::dcp_doc::{DCP_METADATA, DCP_RANK_METADATA};
use crate::{Dtype, Error, Result};

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

impl DcpIndex {
    /// The tensors a file gets: (name written, FQN, tensor), in name
    /// order; with `prefix`, those under it, stripped.
    pub(crate) fn chosen(&self, prefix: Option<&str>) -> Vec<(String, &String, &DcpTensor)> {
        self.tensors
            .iter()
            .filter_map(|(fqn, t)| match prefix {
                Some(p) => fqn.strip_prefix(p).map(|n| (n.to_owned(), fqn, t)),
                None => Some((fqn.clone(), fqn, t)),
            })
            .collect()
    }
}

impl DcpTensor {
    /// Its dtype, if a safetensors file can hold it.
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`] naming tensor `fqn` of `step`.
    pub(crate) fn storable(&self, step: u64, fqn: &str) -> Result<Dtype> {
        match &self.dtype {
            DcpDtype::Stored(d) => Ok(*d),
            DcpDtype::Torch { name, .. } => Err(Error::InvalidCheckpoint {
                step,
                reason: format!(
                    "tensor {fqn} is {name}, which a safetensors file cannot hold: export the \
                     others (a prefix that leaves it out), or load it with ckptstore.dcp"
                ),
            }),
        }
    }

    /// Its length in bytes, whole (`None` if that overflows).
    pub fn byte_len(&self) -> Option<u64> {
        let numel = self.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))?;
        numel.checked_mul(self.dtype.item_bytes())
    }
}

/// What a DCP step holds ([`Remote::dcp_index`](crate::Remote::dcp_index)).
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

/// Where each stored box is: (fqn, offsets) -> (rank, entry).
pub(crate) type Places = HashMap<(String, Vec<u64>), (u32, String)>;

impl DcpIndex {
    /// The index of `step`, saved by `world_size` ranks, from the bytes
    /// of its [`DCP_METADATA`] entry, with where each box is stored.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for bytes that are not that document, of a
    /// format this build does not read, or with an unknown dtype.
    pub(crate) fn decode(step: u64, world_size: u32, bytes: &[u8]) -> Result<(DcpIndex, Places)> {
        let corrupt = |why: String| Error::corrupt(Some(step), format!("{DCP_METADATA}: {why}"));
        let json = DcpDocument::decode(Some(step), bytes)?;
        let mut index = DcpIndex {
            step,
            world_size,
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
        Ok((index, places))
    }
}

#[cfg(feature = "remote")] // a bucket's rank-local steps
impl DcpIndex {
    /// The index of a rank-local save, from each rank's (`ranks`, by
    /// rank, with where its boxes are): every rank's boxes of each tensor,
    /// a box stored by several ranks (a replicated tensor) read from the
    /// first.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for no ranks, or a tensor the ranks saved with
    /// another dtype or shape.
    pub(crate) fn merged(step: u64, ranks: Vec<(DcpIndex, Places)>) -> Result<(DcpIndex, Places)> {
        let mut ranks = ranks.into_iter();
        let corrupt =
            |why: String| Error::corrupt(Some(step), format!("{DCP_RANK_METADATA}: {why}"));
        let (mut index, mut places) = ranks.next().ok_or_else(|| corrupt("no ranks".into()))?;
        for (rank, (other, other_places)) in ranks.enumerate() {
            for (fqn, t) in other.tensors {
                let Some(have) = index.tensors.get_mut(&fqn) else {
                    index.tensors.insert(fqn, t);
                    continue;
                };
                if have.dtype != t.dtype || have.shape != t.shape {
                    return Err(corrupt(format!(
                        "{fqn}: rank {} saved it as {:?} {:?}, the ranks before it as {:?} {:?}",
                        rank + 1,
                        t.dtype,
                        t.shape,
                        have.dtype,
                        have.shape
                    )));
                }
                for b in t.boxes {
                    if !have.boxes.iter().any(|h| h.0 == b.0) {
                        have.boxes.push(b);
                    }
                }
            }
            for value in other.values {
                if !index.values.contains(&value) {
                    index.values.push(value);
                }
            }
            for (key, at) in other_places {
                places.entry(key).or_insert(at);
            }
        }
        Ok((index, places))
    }
}

/// Where a DCP step's stored boxes are read from: a bucket's shards, or a
/// local store's step.
pub(crate) trait BoxSource {
    /// `len` bytes of entry `entry` of rank `rank`'s shard, from `at`.
    fn read(&mut self, rank: u32, entry: &str, at: u64, len: u64) -> Result<Vec<u8>>;
    /// The whole entry into `out`, of its length.
    fn read_into(&mut self, rank: u32, entry: &str, out: &mut [u8]) -> Result<()>;
}

/// Bytes of a stored box read at a time while a tensor is assembled.
const WINDOW: u64 = 32 << 20;

impl DcpTensor {
    /// Tensor `fqn` of `step`, whole, into `out` (of its length), from its
    /// stored boxes where `places` says they are: a box that is the whole
    /// tensor read straight into `out`, others in windows of 32 MiB.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for a box not stored, outside the tensor, or
    /// boxes that do not cover it; the source's errors.
    pub(crate) fn assemble(
        &self,
        step: u64,
        fqn: &str,
        places: &Places,
        source: &mut dyn BoxSource,
        out: &mut [u8],
    ) -> Result<()> {
        let corrupt = |why: String| Error::corrupt(Some(step), format!("{fqn}: {why}"));
        let item = self.dtype.item_bytes();
        let numel = self.shape.iter().product::<u64>();
        let mut covered = 0u64;
        for (offsets, sizes) in &self.boxes {
            let (rank, entry) = places
                .get(&(fqn.to_owned(), offsets.clone()))
                .ok_or_else(|| corrupt(format!("the box at {offsets:?} is not stored")))?;
            let layout = BoxLayout::new(&self.shape, offsets, sizes, item)
                .ok_or_else(|| corrupt(format!("the box at {offsets:?} is outside the tensor")))?;
            let total = layout.rows * layout.row_bytes;
            if sizes == &self.shape && total == out.len() as u64 {
                source.read_into(*rank, entry, out)?;
            } else {
                let mut at = 0;
                while at < total {
                    let n = WINDOW.min(total - at);
                    layout.place(out, at, &source.read(*rank, entry, at, n)?);
                    at += n;
                }
            }
            covered += sizes.iter().product::<u64>();
        }
        if covered != numel {
            return Err(corrupt(format!(
                "its boxes hold {covered} of its {numel} elements"
            )));
        }
        Ok(())
    }
}

/// Where a box lies in a stored chunk of a row-major tensor: the box at
/// `offsets` of `lengths` in a chunk of sizes `chunk`, of `item`-byte
/// elements, is read as the chunk's bytes `start .. start + len` (from the
/// box's first element to its last), viewed with the chunk's `strides`
/// (in elements). An empty box reads nothing (`start` and `len` 0);
/// `None` if the box is not inside the chunk. How `ckptstore.dcp` reads a
/// box a load asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoxSpan {
    /// The first byte read, from the chunk's start.
    pub start: u64,
    /// The bytes read.
    pub len: u64,
    /// The chunk's strides, in elements.
    pub strides: Vec<u64>,
}

impl BoxSpan {
    /// The span of the box at `offsets` of `lengths` in a chunk of sizes
    /// `chunk` of `item`-byte elements; `None` if it is not inside (or
    /// its bytes overflow).
    pub fn of(chunk: &[u64], offsets: &[u64], lengths: &[u64], item: u64) -> Option<BoxSpan> {
        if !inside(chunk, offsets, lengths) {
            return None;
        }
        let strides = row_major(chunk);
        if lengths.contains(&0) {
            return Some(BoxSpan {
                start: 0,
                len: 0,
                strides,
            });
        }
        let mut first = 0u64;
        let mut last = 0u64;
        for d in 0..chunk.len() {
            first = first.checked_add(offsets[d].checked_mul(strides[d])?)?;
            let end = offsets[d] + lengths[d] - 1;
            last = last.checked_add(end.checked_mul(strides[d])?)?;
        }
        let start = first.checked_mul(item)?;
        let end = last.checked_add(1)?.checked_mul(item)?;
        Some(BoxSpan {
            start,
            len: end - start,
            strides,
        })
    }
}

/// Whether the box at `offsets` of `sizes` lies inside `shape`.
fn inside(shape: &[u64], offsets: &[u64], sizes: &[u64]) -> bool {
    shape.len() == offsets.len()
        && shape.len() == sizes.len()
        && (0..shape.len()).all(|d| {
            offsets[d]
                .checked_add(sizes[d])
                .is_some_and(|e| e <= shape[d])
        })
}

/// The strides of a row-major tensor of `shape`, in elements.
fn row_major(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1]);
    }
    strides
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
    /// The layout of the box at `offsets` of `sizes` in a tensor of
    /// `shape` of `item`-byte elements, or `None` if it is not inside.
    fn new(shape: &[u64], offsets: &[u64], sizes: &[u64], item: u64) -> Option<Self> {
        if !inside(shape, offsets, sizes) {
            return None;
        }
        let strides = row_major(shape);
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

#[cfg(test)]
mod tests {
    use super::{BoxLayout, BoxSpan};

    #[test]
    fn a_box_reads_the_span_from_its_first_element_to_its_last() {
        let span =
            |c: &[u64], o: &[u64], l: &[u64]| BoxSpan::of(c, o, l, 4).map(|s| (s.start, s.len));
        // Rows 1..3, columns 2..5 of a 4x6 chunk: elements 8 ..= 16.
        assert_eq!(span(&[4, 6], &[1, 2], &[2, 3]), Some((32, 36)));
        assert_eq!(
            BoxSpan::of(&[4, 6], &[0, 0], &[4, 6], 4).map(|s| s.strides),
            Some(vec![6, 1])
        );
        assert_eq!(span(&[4, 6], &[0, 0], &[4, 6]), Some((0, 96)));
        assert_eq!(span(&[4, 6], &[1, 0], &[0, 3]), Some((0, 0)));
        assert_eq!(span(&[], &[], &[]), Some((0, 4))); // a scalar
        assert_eq!(span(&[4, 6], &[3, 0], &[2, 1]), None);
        assert_eq!(span(&[4, 6], &[0], &[1]), None);
        assert_eq!(span(&[u64::MAX, 2], &[u64::MAX - 1, 0], &[1, 2]), None);
    }

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
