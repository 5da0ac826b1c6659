//! The text form of a BLAKE3 hash, written once: 64 lowercase hex digits
//! (object names and bodies in a bucket, content digests, messages).

/// `hash` as 64 lowercase hex digits.
pub(crate) fn encode(hash: &[u8; 32]) -> String {
    blake3::Hash::from_bytes(*hash).to_hex().to_string()
}

/// The bytes 64 lowercase hex digits spell; None for anything else
/// (uppercase digits included: one hash has one text form).
pub(crate) fn decode(s: &str) -> Option<[u8; 32]> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    let bytes = s.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_reads_back_from_its_one_text_form() {
        let h = *blake3::hash(b"x").as_bytes();
        assert_eq!(decode(&encode(&h)), Some(h));
        for bad in [
            encode(&h).to_uppercase(),
            encode(&h)[1..].to_owned(),
            format!("{}0", encode(&h)),
            "+b".repeat(32),
            "gg".repeat(32),
        ] {
            assert_eq!(decode(&bad), None, "{bad}");
        }
    }
}
