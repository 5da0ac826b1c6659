//! A pack's bytes: its chunks in their stored forms (compressed where
//! that pays, on every core), its name and where each chunk lies in it.

use bytes::Bytes;

use crate::format::manifest::Hash;
use crate::remote::format::pack_format::{pack_name, Location};
use crate::remote::format::stored::{self, Stored, Width};

/// A pack built from its chunks' stored forms: its name, its bytes (in
/// parts) and where each chunk lies in it.
pub(super) struct Built {
    pub(super) name: Hash,
    pub(super) parts: Vec<Bytes>,
    pub(super) placed: Vec<(Hash, Location)>,
}

/// The pack of `chunks` (hash, raw length) stored as `stored` says.
pub(super) fn build(chunks: &[(Hash, u64)], stored: Vec<(Bytes, Stored)>) -> Built {
    let list: Vec<(Hash, u64, Stored)> = chunks
        .iter()
        .zip(&stored)
        .map(|(&(hash, len), (_, form))| (hash, len, *form))
        .collect();
    let name = pack_name(&list);
    let pack_len = stored.iter().map(|(b, _)| b.len() as u64).sum();
    let mut at = 0;
    let mut placed = Vec::with_capacity(list.len());
    for (hash, len, form) in list {
        placed.push((
            hash,
            Location {
                pack: name,
                pack_len,
                at,
                stored: form,
            },
        ));
        at += form.len(len);
    }
    Built {
        name,
        parts: stored.into_iter().map(|(b, _)| b).collect(),
        placed,
    }
}

/// Each of `parts` in its stored form: compressed at its width where it
/// has one and that saves enough (`stored::compress`), else raw. Runs on
/// every core.
pub(super) fn compress_all(parts: Vec<Bytes>, widths: &[Option<Width>]) -> Vec<(Bytes, Stored)> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<Option<(Bytes, Stored)>> = vec![None; parts.len()];
    let done = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads.min(parts.len()) {
            scope.spawn(|| {
                let Ok(mut zstd) = zstd::bulk::Compressor::new(stored::LEVEL) else {
                    return;
                };
                let mut mine = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(raw) = parts.get(i) else { break };
                    let Some(width) = widths.get(i).copied().flatten() else {
                        continue;
                    };
                    if let Some(small) = stored::compress(raw, width, &mut zstd) {
                        let len = small.len() as u64;
                        mine.push((i, Bytes::from(small), Stored::Zstd { len, width }));
                    }
                }
                if let Ok(mut done) = done.lock() {
                    done.extend(mine);
                }
            });
        }
    });
    for (i, small, form) in done.into_inner().unwrap_or_default() {
        out[i] = Some((small, form));
    }
    // A chunk no thread compressed (or that did not shrink) goes raw.
    out.into_iter()
        .zip(parts)
        .map(|(small, raw)| small.unwrap_or((raw, Stored::Raw)))
        .collect()
}
