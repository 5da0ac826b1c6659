//! Typed tensors: a dtype, a shape, and little-endian row-major bytes — the
//! model of safetensors, which every ML framework reads.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// An element type: every dtype safetensors knows, by its safetensors name.
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Dtype {
    /// Boolean, one byte.
    BOOL,
    /// 4-bit float (E2M1), two per byte.
    F4,
    /// 6-bit float, E2M3.
    F6_E2M3,
    /// 6-bit float, E3M2.
    F6_E3M2,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// 8-bit float, E5M2.
    F8_E5M2,
    /// 8-bit float, E4M3.
    F8_E4M3,
    /// 8-bit exponent-only scale, E8M0.
    F8_E8M0,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single precision.
    F32,
    /// Complex of two single-precision floats.
    C64,
    /// IEEE double precision.
    F64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// 8-bit float, E4M3 (FNUZ variant).
    F8_E4M3FNUZ,
    /// 8-bit float, E5M2 (FNUZ variant).
    F8_E5M2FNUZ,
}

/// Every dtype with its code in the manifest (the order is the format:
/// append only).
const DTYPES: [Dtype; 22] = [
    Dtype::BOOL,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
];

impl Dtype {
    /// Bits per element.
    ///
    /// ```
    /// use ckptstore::Dtype;
    /// assert_eq!(Dtype::F32.bits(), 32);
    /// assert_eq!(Dtype::F4.bits(), 4);
    /// assert_eq!(Dtype::C64.bits(), 64);
    /// ```
    pub fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// The safetensors name (`F32`, `BF16`, `F8_E4M3`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
        }
    }

    /// The dtype of a safetensors name, if there is one.
    ///
    /// ```
    /// use ckptstore::Dtype;
    /// assert_eq!(Dtype::from_name("BF16"), Some(Dtype::BF16));
    /// assert_eq!(Dtype::from_name("F128"), None);
    /// ```
    pub fn from_name(name: &str) -> Option<Dtype> {
        DTYPES.into_iter().find(|d| d.name() == name)
    }

    /// The dtype's code in a manifest.
    pub(crate) fn code(self) -> u8 {
        let at = DTYPES.iter().position(|&d| d == self).unwrap_or(0);
        u8::try_from(at).unwrap_or(u8::MAX)
    }

    /// The dtype of a manifest code.
    pub(crate) fn from_code(code: u8) -> Option<Dtype> {
        DTYPES.get(usize::from(code)).copied()
    }
}

impl Serialize for Dtype {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A typed tensor: little-endian, row-major bytes of `shape` elements of
/// `dtype`. A scalar has shape `[]`; a dimension may be 0.
///
/// ```
/// use ckptstore::{Dtype, Tensor};
/// let t = Tensor::new(Dtype::F32, vec![2, 3], vec![0u8; 24])?;
/// assert_eq!(t.elements(), 6);
/// assert!(Tensor::new(Dtype::F32, vec![2, 3], vec![0u8; 23]).is_err());
/// let scalar = Tensor::new(Dtype::F64, vec![], 1.5f64.to_le_bytes().to_vec())?;
/// assert_eq!(scalar.shape, Vec::<u64>::new());
/// # Ok::<(), ckptstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawTensor", into = "RawTensor")]
pub struct Tensor {
    /// The element type.
    pub dtype: Dtype,
    /// The size of each dimension, outermost first.
    pub shape: Vec<u64>,
    /// The elements, little-endian, row-major.
    pub data: Vec<u8>,
}

impl Tensor {
    /// A tensor, if `data` holds exactly the elements `shape` says.
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] naming the numbers when it does not.
    pub fn new(dtype: Dtype, shape: Vec<u64>, data: Vec<u8>) -> Result<Tensor> {
        let t = Tensor { dtype, shape, data };
        t.check()
            .map_err(|reason| Error::InvalidTensor { name: None, reason })?;
        Ok(t)
    }

    /// Elements in the tensor (1 for a scalar), if that fits a `u64`.
    pub fn elements(&self) -> u64 {
        element_count(&self.shape).unwrap_or(u64::MAX)
    }

    /// Bytes `dtype` and `shape` call for.
    pub(crate) fn expected_bytes(dtype: Dtype, shape: &[u64]) -> std::result::Result<u64, String> {
        let elements =
            element_count(shape).ok_or_else(|| format!("shape {shape:?} has too many elements"))?;
        let bits = elements
            .checked_mul(dtype.bits())
            .ok_or_else(|| format!("shape {shape:?} of {dtype} is too large"))?;
        if bits % 8 != 0 {
            return Err(format!(
                "{elements} elements of {dtype} ({} bits each) do not fill whole bytes",
                dtype.bits()
            ));
        }
        Ok(bits / 8)
    }

    /// Why the tensor is not valid, if it is not.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        Self::check_len(self.dtype, &self.shape, self.data.len())
    }

    /// Why `len` bytes cannot hold `shape` of `dtype`, if they cannot.
    pub(crate) fn check_len(
        dtype: Dtype,
        shape: &[u64],
        len: usize,
    ) -> std::result::Result<(), String> {
        let want = Self::expected_bytes(dtype, shape)?;
        if len as u64 != want {
            return Err(format!(
                "shape {shape:?} of {dtype} needs {want} bytes, the data has {len}"
            ));
        }
        Ok(())
    }
}

/// A tensor whose bytes stay where the caller keeps them, for
/// [`CheckpointStore::commit_borrowed`](crate::CheckpointStore::commit_borrowed):
/// the store hashes and writes them from there, without a copy.
///
/// ```
/// use ckptstore::{Dtype, TensorRef};
/// let weights = vec![0u8; 24];
/// let t = TensorRef::new(Dtype::F32, vec![2, 3], &weights)?;
/// assert_eq!((t.dtype(), t.shape(), t.data().len()), (Dtype::F32, &[2u64, 3][..], 24));
/// assert!(TensorRef::new(Dtype::F32, vec![2, 3], &weights[1..]).is_err());
/// # Ok::<(), ckptstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRef<'a> {
    dtype: Dtype,
    shape: Vec<u64>,
    data: &'a [u8],
    /// The hashes of `data`'s chunks, taken as it was copied.
    hashes: Option<&'a [[u8; 32]]>,
}

impl<'a> TensorRef<'a> {
    /// A borrowed tensor, if `data` holds exactly the elements `shape` says
    /// (little-endian, row-major).
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] naming the numbers when it does not.
    pub fn new(dtype: Dtype, shape: Vec<u64>, data: &'a [u8]) -> Result<Self> {
        Tensor::check_len(dtype, &shape, data.len())
            .map_err(|reason| Error::InvalidTensor { name: None, reason })?;
        Ok(TensorRef {
            dtype,
            shape,
            data,
            hashes: None,
        })
    }

    /// This tensor with the hashes of its chunks taken as its bytes were
    /// copied to where they lie ([`ChunkHashes::copy_all`]): a commit
    /// records them and writes the bytes without reading them again to
    /// hash them. The bytes must not change between the copy and the
    /// commit; if they do, no read returns them (every read checks each
    /// chunk against its hash, and reports the step damaged).
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] when the hashes are of another number of
    /// bytes than the tensor's.
    pub fn with_hashes(mut self, hashes: &'a ChunkHashes) -> Result<Self> {
        if hashes.len != self.data.len() as u64 {
            return Err(Error::InvalidTensor {
                name: None,
                reason: format!(
                    "chunk hashes of {} bytes for a tensor of {}",
                    hashes.len,
                    self.data.len()
                ),
            });
        }
        self.hashes = Some(&hashes.hashes);
        Ok(self)
    }

    /// The hashes of the chunks, when [`with_hashes`](Self::with_hashes)
    /// gave them.
    pub(crate) fn known_hashes(&self) -> Option<&'a [[u8; 32]]> {
        self.hashes
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The size of each dimension, outermost first.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The elements.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
}

/// The BLAKE3 hash of each chunk of some bytes, in the store's chunk
/// layout, taken as they were copied ([`ChunkHashes::copy_all`]): given
/// to a commit with the bytes ([`TensorRef::with_hashes`]), they spare it
/// a second pass over the bytes. Bytes small enough to be packed with a
/// step's small blobs have no chunk hashes (the pack is hashed whole).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkHashes {
    /// How many bytes were hashed.
    pub(crate) len: u64,
    /// Each chunk's hash, in order; none for bytes that are packed.
    pub(crate) hashes: Vec<[u8; 32]>,
}

/// A caller's buffer for one tensor of a step, by name, dtype and shape:
/// [`CheckpointStore::get_into`](crate::CheckpointStore::get_into) reads
/// the stored tensor straight into it (no allocation, no second copy) when
/// the stored tensor has this dtype and shape.
///
/// ```
/// # use ckptstore::{Dtype, TensorMut};
/// let mut weights = vec![0u8; 24];
/// let t = TensorMut::new("w", Dtype::F32, vec![2, 3], &mut weights)?;
/// assert_eq!((t.name(), t.filled()), ("w", false));
/// assert!(TensorMut::new("w", Dtype::F32, vec![2, 3], &mut [0u8; 23]).is_err());
/// # Ok::<(), ckptstore::Error>(())
/// ```
#[derive(Debug)]
pub struct TensorMut<'a> {
    pub(crate) name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    pub(crate) data: &'a mut [u8],
    pub(crate) filled: bool,
}

impl<'a> TensorMut<'a> {
    /// A buffer for tensor `name`, if `data` holds exactly the elements
    /// `shape` says.
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] naming the tensor and the numbers when it
    /// does not.
    pub fn new(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        data: &'a mut [u8],
    ) -> Result<Self> {
        let name = name.into();
        Tensor::check_len(dtype, &shape, data.len()).map_err(|reason| Error::InvalidTensor {
            name: Some(name.clone()),
            reason,
        })?;
        Ok(TensorMut {
            name,
            dtype,
            shape,
            data,
            filled: false,
        })
    }

    /// The tensor's name in the step.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether a stored tensor of `dtype` and `shape` fits the buffer.
    pub(crate) fn fits(&self, dtype: Dtype, shape: &[u64]) -> bool {
        self.dtype == dtype && self.shape == shape
    }

    /// Whether the last read filled the buffer with the stored tensor
    /// (every chunk hash-checked before it was copied in).
    pub fn filled(&self) -> bool {
        self.filled
    }
}

fn element_count(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
}

/// A tensor's serde form: the dtype by name.
#[derive(Serialize, Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data: Vec<u8>,
}

impl TryFrom<RawTensor> for Tensor {
    type Error = String;

    fn try_from(raw: RawTensor) -> std::result::Result<Self, String> {
        let dtype =
            Dtype::from_name(&raw.dtype).ok_or_else(|| format!("unknown dtype {:?}", raw.dtype))?;
        let t = Tensor {
            dtype,
            shape: raw.shape,
            data: raw.data,
        };
        t.check()?;
        Ok(t)
    }
}

impl From<Tensor> for RawTensor {
    fn from(t: Tensor) -> Self {
        RawTensor {
            dtype: t.dtype.name().to_owned(),
            shape: t.shape,
            data: t.data,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for d in DTYPES {
            assert_eq!(Dtype::from_code(d.code()), Some(d));
            assert_eq!(Dtype::from_name(d.name()), Some(d));
        }
        assert_eq!(Dtype::from_code(200), None);
    }

    #[test]
    fn lengths_are_checked() {
        assert!(
            Tensor::new(Dtype::F4, vec![3], vec![0; 2]).is_err(),
            "12 bits"
        );
        assert!(Tensor::new(Dtype::F4, vec![4], vec![0; 2]).is_ok());
        assert!(Tensor::new(Dtype::F6_E2M3, vec![4], vec![0; 3]).is_ok());
        assert!(Tensor::new(Dtype::U8, vec![0, 5], vec![]).is_ok());
        assert!(Tensor::new(Dtype::U64, vec![u64::MAX, 2], vec![]).is_err());
        let e = Tensor::new(Dtype::BF16, vec![2, 2], vec![0; 7]).expect_err("7 bytes");
        assert!(e.to_string().contains("needs 8 bytes"), "{e}");
    }
}
