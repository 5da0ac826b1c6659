//! Element casts between the floating dtypes (f64, f32, bf16, f16), bit
//! by bit: round to nearest even, NaN kept NaN, overflow to infinity.
//! The bit manipulation of IEEE formats is all narrowing and sign casts,
//! each within range by construction.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use crate::Dtype;

/// Element `i` of `buf`, of `dtype` (a floating dtype; others read 0).
pub(crate) fn read_float(buf: &[u8], dtype: Dtype, i: usize) -> f64 {
    let at = |n: usize| &buf[i * n..i * n + n];
    match dtype {
        Dtype::F64 => f64::from_le_bytes(at(8).try_into().unwrap_or([0; 8])),
        Dtype::F32 => f64::from(f32::from_le_bytes(at(4).try_into().unwrap_or([0; 4]))),
        Dtype::BF16 => {
            let bits = u16::from_le_bytes(at(2).try_into().unwrap_or([0; 2]));
            f64::from(f32::from_bits(u32::from(bits) << 16))
        }
        Dtype::F16 => f64::from(f16_to_f32(u16::from_le_bytes(
            at(2).try_into().unwrap_or([0; 2]),
        ))),
        _ => 0.0,
    }
}

/// Write `x` as element `i` of `buf`, of `dtype` (others: nothing).
pub(crate) fn write_float(buf: &mut [u8], dtype: Dtype, i: usize, x: f64) {
    match dtype {
        Dtype::F64 => buf[i * 8..i * 8 + 8].copy_from_slice(&x.to_le_bytes()),
        Dtype::F32 => buf[i * 4..i * 4 + 4].copy_from_slice(&(x as f32).to_le_bytes()),
        Dtype::BF16 => buf[i * 2..i * 2 + 2].copy_from_slice(&f32_to_bf16(x as f32).to_le_bytes()),
        Dtype::F16 => buf[i * 2..i * 2 + 2].copy_from_slice(&f32_to_f16(x as f32).to_le_bytes()),
        _ => {}
    }
}

/// Round to nearest even, NaN kept NaN.
fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// IEEE half precision, round to nearest even; overflow to infinity.
fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let mant = bits & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if mant != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = mant | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rounded = (m + half - 1 + ((m >> shift) & 1)) >> shift;
        return sign | rounded as u16;
    }
    let rounded = mant + 0xfff + ((mant >> 13) & 1);
    if rounded & 0x80_0000 != 0 {
        // The mantissa carried into the exponent.
        let e = e + 1;
        if e >= 0x1f {
            return sign | 0x7c00;
        }
        return sign | ((e as u16) << 10);
    }
    sign | ((e as u16) << 10) | ((rounded >> 13) as u16)
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x3ff);
    let bits = match (exp, mant) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalise.
            let mut e = 127 - 15 + 1;
            let mut m = m;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_cast_round_to_nearest_even() {
        for x in [0.0f32, 1.0, -2.5, 1.0e-3, 65504.0, 3.0e-6, 1.0e30] {
            let bf = f32::from_bits(u32::from(f32_to_bf16(x)) << 16);
            assert!((bf - x).abs() <= x.abs() / 128.0, "{x} -> {bf}");
            let h = f16_to_f32(f32_to_f16(x));
            if x.abs() <= 65504.0 && x.abs() >= 6.1e-5 {
                assert!((h - x).abs() <= x.abs() / 1024.0, "{x} -> {h}");
            }
        }
        assert!(f16_to_f32(f32_to_f16(1.0e30)).is_infinite());
        assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
        assert!(f32::from_bits(u32::from(f32_to_bf16(f32::NAN)) << 16).is_nan());
        // Exact halves round to even: 1 + 2^-8 is between two bf16s.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00);
        // Subnormal halves survive the round trip.
        assert_eq!(f16_to_f32(1).to_bits(), 2f32.powi(-24).to_bits());
        assert_eq!(f32_to_f16(2f32.powi(-24)), 1);
    }
}
