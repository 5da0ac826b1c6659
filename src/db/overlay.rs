//! A storage backend that reads a store file and keeps every write in
//! memory: redb can repair and check a file through it without changing a
//! byte of it (`ckpt verify --pages`, reading a store whose writer died).

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use redb::StorageBackend;

/// Bytes per page of the in-memory copy of what was written.
const PAGE: u64 = 4096;
/// [`PAGE`] as a length.
const PAGE_BYTES: usize = 4096;

/// Reads from a file, writes to memory.
#[derive(Debug)]
pub(crate) struct Overlay {
    file: File,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The length redb sees.
    len: u64,
    /// File bytes from here on read as zeros (the length was cut to here
    /// at some point, or the file ends here).
    zero_from: u64,
    /// Pages written, by index.
    pages: HashMap<u64, Vec<u8>>,
}

impl Overlay {
    pub(crate) fn new(file: File) -> io::Result<Self> {
        let len = file.metadata()?.len();
        Ok(Overlay {
            file,
            state: Mutex::new(State {
                len,
                zero_from: len,
                pages: HashMap::new(),
            }),
        })
    }

    fn state(&self) -> io::Result<std::sync::MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| io::Error::other("overlay lock poisoned"))
    }

    /// Fill `out` with the file's bytes at `offset`, zeros past `zero_from`.
    fn read_file(&self, offset: u64, out: &mut [u8], zero_from: u64) -> io::Result<()> {
        let from_file = usize::try_from(zero_from.saturating_sub(offset))
            .unwrap_or(usize::MAX)
            .min(out.len());
        let (head, tail) = out.split_at_mut(from_file);
        self.file.read_exact_at(head, offset)?;
        tail.fill(0);
        Ok(())
    }
}

impl StorageBackend for Overlay {
    fn len(&self) -> io::Result<u64> {
        Ok(self.state()?.len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let st = self.state()?;
        let end = offset.checked_add(out.len() as u64);
        if end.is_none_or(|end| end > st.len) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end",
            ));
        }
        for (page, at, span) in pieces(offset, out.len()) {
            let dst = &mut out[span];
            match st.pages.get(&page) {
                Some(bytes) => dst.copy_from_slice(&bytes[at..at + dst.len()]),
                None => self.read_file(page * PAGE + at as u64, dst, st.zero_from)?,
            }
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.state()?;
        if len < st.len {
            st.zero_from = st.zero_from.min(len);
            let first_gone = len.div_ceil(PAGE);
            st.pages.retain(|&p, _| p < first_gone);
            // Zero the tail of a page cut in the middle.
            if len % PAGE != 0 {
                if let Some(bytes) = st.pages.get_mut(&(len / PAGE)) {
                    let at = usize::try_from(len % PAGE).unwrap_or(0);
                    bytes[at..].fill(0);
                }
            }
        }
        st.len = len;
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut st = self.state()?;
        for (page, at, span) in pieces(offset, data.len()) {
            if !st.pages.contains_key(&page) {
                let mut bytes = vec![0u8; PAGE_BYTES];
                self.read_file(page * PAGE, &mut bytes, st.zero_from.min(st.len))?;
                st.pages.insert(page, bytes);
            }
            if let Some(bytes) = st.pages.get_mut(&page) {
                let src = &data[span];
                bytes[at..at + src.len()].copy_from_slice(src);
            }
        }
        Ok(())
    }
}

/// The pages that `len` bytes from `offset` touch: each page's index, the
/// offset within it, and the range of the caller's buffer that falls in it.
fn pieces(offset: u64, len: usize) -> impl Iterator<Item = (u64, usize, std::ops::Range<usize>)> {
    let mut done = 0usize;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let pos = offset + done as u64;
        let at = usize::try_from(pos % PAGE).unwrap_or(0);
        let n = (PAGE_BYTES - at).min(len - done);
        let piece = (pos / PAGE, at, done..done + n);
        done += n;
        Some(piece)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_stay_in_memory_and_reads_see_them() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("f");
        let original: Vec<u8> = (0..10_000u32).map(|i| i.to_le_bytes()[0]).collect();
        std::fs::write(&path, &original)?;
        let o = Overlay::new(File::open(&path)?)?;
        o.write(4090, &[0xAA; 20])?;
        let mut out = vec![0u8; 40];
        o.read(4080, &mut out)?;
        assert_eq!(&out[..10], &original[4080..4090]);
        assert_eq!(&out[10..30], &[0xAA; 20]);
        assert_eq!(&out[30..], &original[4110..4120]);
        // Cut and grow again: the cut bytes read as zeros.
        o.set_len(5000)?;
        o.set_len(9000)?;
        let mut out = vec![1u8; 100];
        o.read(4950, &mut out)?;
        assert_eq!(&out[..50], &original[4950..5000]);
        assert!(out[50..].iter().all(|&b| b == 0));
        assert!(o.read(8990, &mut [0u8; 20]).is_err());
        assert_eq!(std::fs::read(&path)?, original, "the file is untouched");
        Ok(())
    }
}
