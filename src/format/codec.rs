//! The primitives of the binary encodings: LEB128 varints, length-prefixed
//! strings, optional values, fixed-size hashes.

use crate::{Error, Result};

/// Bytes of a BLAKE3 hash.
pub(crate) const HASH_LEN: usize = 32;

/// A BLAKE3 hash: a chunk's or a manifest's identity.
pub(crate) type Hash = [u8; HASH_LEN];

/// Appends the encoding's parts.
pub(crate) struct Writer(pub(crate) Vec<u8>);

impl Writer {
    pub(crate) fn u8(&mut self, b: u8) {
        self.0.push(b);
    }

    pub(crate) fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            // Truncation intended: the low seven bits, with the "more" bit.
            #[allow(clippy::cast_possible_truncation)]
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        #[allow(clippy::cast_possible_truncation)]
        self.0.push(v as u8);
    }

    pub(crate) fn len(&mut self, n: usize) {
        self.varint(n as u64);
    }

    pub(crate) fn str(&mut self, s: &str) {
        self.len(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }

    pub(crate) fn opt_str(&mut self, s: Option<&str>) {
        match s {
            None => self.u8(0),
            Some(s) => {
                self.u8(1);
                self.str(s);
            }
        }
    }

    pub(crate) fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_bits().to_le_bytes());
    }

    pub(crate) fn hash(&mut self, h: &Hash) {
        self.0.extend_from_slice(h);
    }
}

/// Reads the encoding's parts, failing with [`Error::Corrupt`] that names
/// the step, the part and the byte offset.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    step: u64,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes` from byte `at`, for a record of `step`.
    pub(crate) fn new(bytes: &'a [u8], at: usize, step: u64) -> Self {
        Reader { bytes, at, step }
    }

    pub(crate) fn fail(&self, what: &str) -> Error {
        Error::corrupt(
            Some(self.step),
            format!("manifest: bad {what} at byte {}", self.at),
        )
    }

    pub(crate) fn at_end(&self) -> bool {
        self.at == self.bytes.len()
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8> {
        let b = *self.bytes.get(self.at).ok_or_else(|| self.fail(what))?;
        self.at += 1;
        Ok(b)
    }

    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).ok_or_else(|| self.fail(what))?;
        let bytes = self
            .bytes
            .get(self.at..end)
            .ok_or_else(|| self.fail(what))?;
        self.at = end;
        Ok(bytes)
    }

    pub(crate) fn varint(&mut self, what: &str) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8(what)?;
            // The tenth byte may carry only the top bit of a u64.
            if shift == 63 && b > 1 {
                return Err(self.fail(what));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.fail(what))
    }

    /// A count of items each at least `min_bytes` long: never more than the
    /// bytes left could hold, so no allocation exceeds the input's size.
    pub(crate) fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize> {
        let n = self.varint(what)?;
        let left = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(min_bytes as u64) > left {
            return Err(self.fail(what));
        }
        usize::try_from(n).map_err(|_| self.fail(what))
    }

    pub(crate) fn str(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.fail(what))
    }

    pub(crate) fn opt_str(&mut self, what: &str) -> Result<Option<String>> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => self.str(what).map(Some),
            _ => Err(self.fail(what)),
        }
    }

    pub(crate) fn f64(&mut self, what: &str) -> Result<f64> {
        let bits: [u8; 8] = self
            .take(8, what)?
            .try_into()
            .map_err(|_| self.fail(what))?;
        Ok(f64::from_bits(u64::from_le_bytes(bits)))
    }

    pub(crate) fn hash(&mut self, what: &str) -> Result<Hash> {
        let bytes = self.take(HASH_LEN, what)?;
        bytes.try_into().map_err(|_| self.fail(what))
    }
}

/// Lowercase hex of a hash, for messages and format 1's JSON.
pub(crate) use crate::hex::encode as hex;
