//! A chunk's stored form in a pack (bucket format 4; `docs/design.md`
//! has the bytes). A chunk is named by the BLAKE3 hash of its raw bytes
//! whatever its form, so deduplication, proofs and verification keep
//! their meaning; what a pack holds of it is either those bytes or, where
//! that saves at least [`MIN_SAVING`] of them, their byte planes
//! compressed with zstd.
//!
//! Byte planes: the bytes of a tensor's elements grouped by their place in
//! the element (every element's byte 0, then every element's byte 1, ...),
//! because the high bytes of floats (sign, exponent) repeat a few values
//! and compress where the mantissa bytes do not; the bytes past the last
//! whole element follow as they are. A chunk of bytes that are no tensor's
//! is one plane. The planes go through zstd as one frame (its blocks are
//! of 128 KiB, so each plane of a large chunk gets entropy tables of its
//! own).
//!
//! Decoding is bounded by the chunk's raw length, which the reader knows
//! from the manifest before it reads a byte: a stored form that claims
//! more, or yields another length, is refused, never allocated for.

use std::fmt;

/// The zstd level chunks are compressed at: the fastest of zstd's
/// ordinary levels, whose entropy coding is what byte planes need.
pub(crate) const LEVEL: i32 = 1;

/// The least a compressed form must save to be kept: 1/32 of the chunk's
/// raw bytes (a chunk that shrinks less is stored raw, and read without
/// decompressing).
pub(crate) const MIN_SAVING: usize = 32;

/// The width of a chunk's elements, by which its bytes are split into
/// planes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Width {
    /// Bytes, or elements of one byte: one plane.
    One,
    /// bf16, f16, i16 ...
    Two,
    /// f32, i32 ...
    Four,
    /// f64, i64 ...
    Eight,
}

impl Width {
    /// The width of elements of `bytes` bytes; elements of other widths
    /// are cut as bytes.
    pub(crate) fn of_element(bytes: usize) -> Width {
        match bytes {
            2 => Width::Two,
            4 => Width::Four,
            8 => Width::Eight,
            _ => Width::One,
        }
    }

    /// The width as written in a manifest.
    pub(crate) fn get(self) -> usize {
        match self {
            Width::One => 1,
            Width::Two => 2,
            Width::Four => 4,
            Width::Eight => 8,
        }
    }

    /// The width a manifest writes as `n`; None for any other number.
    pub(crate) fn from_written(n: u64) -> Option<Width> {
        match n {
            1 => Some(Width::One),
            2 => Some(Width::Two),
            4 => Some(Width::Four),
            8 => Some(Width::Eight),
            _ => None,
        }
    }
}

/// What a pack holds of a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Stored {
    /// Its raw bytes.
    Raw,
    /// Its byte planes at `width`, compressed: `len` bytes.
    Zstd { len: u64, width: Width },
}

impl Stored {
    /// The bytes a pack holds of a chunk of `raw` bytes stored so.
    pub(crate) fn len(self, raw: u64) -> u64 {
        match self {
            Stored::Raw => raw,
            Stored::Zstd { len, .. } => len,
        }
    }
}

/// Why a stored form did not decode to its chunk.
#[derive(Debug)]
pub(crate) enum Undecodable {
    /// zstd refused the bytes (or they decode past the raw length).
    Zstd(std::io::Error),
    /// They decode to this many bytes, not the chunk's raw length.
    Length(usize),
}

impl fmt::Display for Undecodable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Undecodable::Zstd(e) => write!(f, "its compressed form does not decode: {e}"),
            Undecodable::Length(n) => write!(f, "its compressed form decodes to {n} bytes"),
        }
    }
}

/// The compressed form of chunk `raw`, whose elements are `width` bytes
/// wide, where it saves at least 1/[`MIN_SAVING`] of its bytes; None
/// where it does not (the chunk is stored raw). `compressor` is reused
/// across chunks (one per thread).
pub(crate) fn compress(
    raw: &[u8],
    width: Width,
    compressor: &mut zstd::bulk::Compressor<'_>,
) -> Option<Vec<u8>> {
    if raw.len() < MIN_SAVING {
        return None;
    }
    let budget = raw.len() - raw.len() / MIN_SAVING;
    let planes = to_planes(raw, width);
    let mut out = Vec::with_capacity(budget);
    // A form that does not fit the budget is no saving: zstd stops there.
    match compressor.compress_to_buffer(&planes[..], &mut out) {
        Ok(n) if n < budget => Some(out),
        _ => None,
    }
}

/// The raw bytes of a chunk of `raw_len` bytes stored compressed as
/// `stored` with elements `width` bytes wide. Never allocates more than
/// `raw_len` bytes (twice, for the planes and the chunk).
pub(crate) fn decompress(
    stored: &[u8],
    width: Width,
    raw_len: usize,
) -> Result<Vec<u8>, Undecodable> {
    let mut planes = Vec::with_capacity(raw_len);
    let mut decompressor = zstd::bulk::Decompressor::new().map_err(Undecodable::Zstd)?;
    let n = decompressor
        .decompress_to_buffer(stored, &mut planes)
        .map_err(Undecodable::Zstd)?;
    if n != raw_len {
        return Err(Undecodable::Length(n));
    }
    Ok(from_planes(&planes, width))
}

/// `raw`'s bytes by plane: byte `b` of each whole element in plane `b`,
/// then the bytes past the last whole element.
fn to_planes(raw: &[u8], width: Width) -> Vec<u8> {
    let w = width.get();
    if w == 1 {
        return raw.to_vec();
    }
    let whole = raw.len() / w * w;
    let mut out = Vec::with_capacity(raw.len());
    for b in 0..w {
        out.extend(raw[..whole].iter().skip(b).step_by(w));
    }
    out.extend_from_slice(&raw[whole..]);
    out
}

/// The bytes `to_planes` split into `planes`.
fn from_planes(planes: &[u8], width: Width) -> Vec<u8> {
    let w = width.get();
    if w == 1 {
        return planes.to_vec();
    }
    let n = planes.len() / w;
    let whole = n * w;
    let mut out = vec![0u8; planes.len()];
    for (b, plane) in planes[..whole].chunks_exact(n.max(1)).enumerate().take(w) {
        for (e, &byte) in plane.iter().enumerate() {
            out[e * w + b] = byte;
        }
    }
    out[whole..].copy_from_slice(&planes[whole..]);
    out
}

/// `n` bytes that do not compress (a linear congruential generator's high
/// bytes from `seed`): for tests.
#[cfg(test)]
pub(crate) fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            x.to_be_bytes()[0]
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // test bytes from wider integers
mod tests {
    use super::*;

    fn compressor() -> zstd::bulk::Compressor<'static> {
        zstd::bulk::Compressor::new(LEVEL).expect("a zstd context")
    }

    /// Bytes like bf16 weights near zero: a few exponent values, noisy
    /// mantissas (a linear congruential generator, no dependency).
    fn weights(n: usize) -> Vec<u8> {
        let mut x = 12345u64;
        let mut out = Vec::with_capacity(n * 2);
        for _ in 0..n {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let mantissa = (x >> 33) as u8;
            let exponent = 0x3c + ((x >> 60) as u8 & 1);
            out.extend_from_slice(&[mantissa, exponent]);
        }
        out
    }

    #[test]
    fn planes_round_trip_at_every_width_and_odd_length() {
        for len in [0, 1, 2, 3, 7, 8, 9, 31, 100, 1023] {
            let raw: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            for w in [Width::One, Width::Two, Width::Four, Width::Eight] {
                let planes = to_planes(&raw, w);
                assert_eq!(planes.len(), raw.len());
                assert_eq!(from_planes(&planes, w), raw, "len {len} width {w:?}");
            }
        }
        assert_eq!(to_planes(&[1, 2, 3, 4, 5], Width::Two), [1, 3, 2, 4, 5]);
    }

    #[test]
    fn floats_compress_and_decompress_exactly() {
        let raw = weights(100_000);
        let stored = compress(&raw, Width::Two, &mut compressor()).expect("it shrinks");
        assert!(
            stored.len() * 5 < raw.len() * 4,
            "{} of {}",
            stored.len(),
            raw.len()
        );
        assert_eq!(
            decompress(&stored, Width::Two, raw.len()).expect("decodes"),
            raw
        );
        // As bytes it shrinks less: the planes are what wins.
        let flat = compress(&raw, Width::One, &mut compressor()).map_or(raw.len(), |s| s.len());
        assert!(stored.len() < flat, "{} vs {flat}", stored.len());
    }

    #[test]
    fn what_does_not_shrink_is_stored_raw() {
        let noise = noise(99, 65_536);
        assert!(compress(&noise, Width::Four, &mut compressor()).is_none());
        assert!(compress(&[], Width::Two, &mut compressor()).is_none());
        assert!(compress(&[0; 8], Width::Two, &mut compressor()).is_none());
        assert!(compress(&[0; 4096], Width::Two, &mut compressor()).is_some());
    }

    #[test]
    fn a_stored_form_of_another_length_or_not_zstd_is_refused() {
        let raw = weights(10_000);
        let stored = compress(&raw, Width::Two, &mut compressor()).expect("it shrinks");
        // Claims more than the chunk: refused without growing past it.
        assert!(matches!(
            decompress(&stored, Width::Two, raw.len() - 1),
            Err(Undecodable::Zstd(_))
        ));
        // Yields less than the chunk.
        assert!(matches!(
            decompress(&stored, Width::Two, raw.len() + 1),
            Err(Undecodable::Length(n)) if n == raw.len()
        ));
        // Not zstd, cut short, or one byte flipped: refused or another
        // chunk (which the hash check after it catches), never a panic.
        assert!(decompress(&raw[..100], Width::Two, raw.len()).is_err());
        assert!(decompress(&stored[..stored.len() / 2], Width::Two, raw.len()).is_err());
        for i in (0..stored.len()).step_by(97) {
            let mut bad = stored.clone();
            bad[i] ^= 0x40;
            if let Ok(out) = decompress(&bad, Width::Two, raw.len()) {
                assert_eq!(out.len(), raw.len());
            }
        }
        // A frame that claims a huge content size is refused, not allocated.
        let huge = [
            0x28, 0xb5, 0x2f, 0xfd, 0xa4, 0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0,
        ];
        assert!(decompress(&huge, Width::One, 16).is_err());
    }
}
