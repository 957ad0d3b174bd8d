//! A language model's token ids: held in memory (a text tokenized at load), or read from
//! token files where they lie. FineWeb's 10B tokens are 20 GB of uint16 shards: mapped,
//! they cost no heap, no load time, and one copy in the page cache for every rank of a
//! multi-process run. A batch copies its windows out, widened to u32.

use crate::error::{Error, Result};
use crate::tensor::HostIds;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// One stream of token ids, or a stretch of one (a split).
#[derive(Clone)]
pub enum TokenIds {
    Held(Vec<u32>),
    Files {
        files: Arc<[TokenFile]>,
        /// The stream's ids this split holds: all files' ids one after another.
        range: Range<usize>,
    },
}

/// A token file's ids: little-endian, `width` bytes each, at `body` in its bytes.
pub struct TokenFile {
    bytes: FileBytes,
    body: Range<usize>,
    width: usize,
    /// Where its first id lies in the stream of all files' ids.
    first: usize,
    /// Its largest id (0 for none).
    largest: u32,
}

/// A file's bytes: mapped where it lies, or read (a gzip file, decompressed).
pub enum FileBytes {
    Mapped(memmap2::Mmap),
    Read(Vec<u8>),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(map) => map,
            FileBytes::Read(bytes) => bytes,
        }
    }
}

impl FileBytes {
    /// `path`'s bytes: mapped, unless gzip (decompressed into memory).
    pub fn open(path: &Path) -> Result<FileBytes> {
        let unreadable = |e: std::io::Error| Error::UnreadableData {
            path: path.to_path_buf(),
            message: format!("cannot read data file {}: {e}", path.display()),
        };
        let file = std::fs::File::open(path).map_err(unreadable)?;
        if file.metadata().is_ok_and(|m| m.is_dir()) {
            return Err(Error::Job(format!(
                "{0} is a folder, not a token file: name its shards by a glob, e.g. {0}/*.bin",
                path.display()
            )));
        }
        // SAFETY: the map is read-only, and the files must not change while a run reads
        // them (as with nanoGPT's np.memmap). A file cut short under the map ends the
        // process (SIGBUS).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(unreadable)?;
        if map.starts_with(&[0x1f, 0x8b]) {
            return super::sources::read_bytes(path).map(FileBytes::Read);
        }
        Ok(FileBytes::Mapped(map))
    }
}

impl TokenFile {
    /// The ids at `body` of `bytes`, `width` bytes each.
    pub fn new(bytes: FileBytes, body: Range<usize>, width: usize) -> Self {
        let mut file = TokenFile {
            bytes,
            body,
            width,
            first: 0,
            largest: 0,
        };
        let mut largest = 0;
        file.for_each_run(0..file.len(), |run| {
            largest = run.iter().fold(largest, |m, &id| m.max(id));
        });
        file.largest = largest;
        file
    }

    pub fn len(&self) -> usize {
        self.body.len() / self.width
    }

    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }

    pub fn largest(&self) -> u32 {
        self.largest
    }

    /// Its first id at or past `limit`, and where.
    pub fn first_at_or_past(&self, limit: usize) -> Option<(usize, u32)> {
        let (mut at, mut found) = (0, None);
        if self.largest as usize >= limit {
            self.for_each_run(0..self.len(), |run| {
                if found.is_none() {
                    found =
                        (run.iter().position(|&id| id as usize >= limit)).map(|i| (at + i, run[i]));
                }
                at += run.len();
            });
        }
        found
    }

    /// Ids `at.start..at.end` of this file into `out`.
    fn copy(&self, at: Range<usize>, out: &mut [u32]) {
        let bytes = &self.bytes[self.body.start + at.start * self.width..][..at.len() * self.width];
        match self.width {
            2 => (out.iter_mut().zip(bytes.chunks_exact(2)))
                .for_each(|(o, b)| *o = u32::from(u16::from_le_bytes([b[0], b[1]]))),
            _ => (out.iter_mut().zip(bytes.chunks_exact(4)))
                .for_each(|(o, b)| *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
    }

    /// Calls `f` with the ids of `at`, a few thousand at a time.
    fn for_each_run(&self, at: Range<usize>, mut f: impl FnMut(&[u32])) {
        let mut run = [0u32; 4096];
        let mut start = at.start;
        while start < at.end {
            let n = run.len().min(at.end - start);
            self.copy(start..start + n, &mut run[..n]);
            f(&run[..n]);
            start += n;
        }
    }
}

impl Default for TokenIds {
    fn default() -> Self {
        TokenIds::Held(Vec::new())
    }
}

impl std::fmt::Debug for TokenIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenIds::Held(ids) => write!(f, "{} ids held", ids.len()),
            TokenIds::Files { files, range } => {
                write!(f, "ids {range:?} of {} token files", files.len())
            }
        }
    }
}

/// The same ids, however held.
impl PartialEq for TokenIds {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.to_vec() == other.to_vec()
    }
}

impl TokenIds {
    /// Every id of `files`, one file after another.
    pub fn of_files(mut files: Vec<TokenFile>) -> TokenIds {
        let mut len = 0;
        for file in &mut files {
            file.first = len;
            len += file.len();
        }
        TokenIds::Files {
            files: files.into(),
            range: 0..len,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            TokenIds::Held(ids) => ids.len(),
            TokenIds::Files { range, .. } => range.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of its ids in files mapped where they lie: host memory only as a page
    /// cache. Held ids, and a gzip file's, take heap instead (`heap_bytes`).
    pub fn mapped_bytes(&self) -> usize {
        self.file_bytes(true)
    }

    /// The bytes of host memory the ids take.
    pub fn heap_bytes(&self) -> usize {
        match self {
            TokenIds::Held(ids) => ids.len() * 4,
            TokenIds::Files { .. } => self.file_bytes(false),
        }
    }

    /// The bytes of this split's ids in mapped files, or in read ones.
    fn file_bytes(&self, mapped: bool) -> usize {
        (self.spans())
            .filter(|(f, _)| matches!(f.bytes, FileBytes::Mapped(_)) == mapped)
            .map(|(f, ids)| ids.len() * f.width)
            .sum()
    }

    /// The files this split reads, each with the ids it reads of it (positions in the file).
    fn spans(&self) -> impl Iterator<Item = (&TokenFile, Range<usize>)> {
        let (files, range) = match self {
            TokenIds::Held(_) => (&[][..], 0..0),
            TokenIds::Files { files, range } => (&files[..], range.clone()),
        };
        files.iter().filter_map(move |f| {
            let (from, to) = (f.first.max(range.start), (f.first + f.len()).min(range.end));
            (from < to).then(|| (f, from - f.first..to - f.first))
        })
    }

    /// Splits off the last `len` ids.
    pub fn split_off_end(&mut self, len: usize) -> TokenIds {
        match self {
            TokenIds::Held(ids) => TokenIds::Held(ids.split_off(ids.len() - len)),
            TokenIds::Files { files, range } => {
                let at = range.end - len;
                let tail = at..range.end;
                range.end = at;
                TokenIds::Files {
                    files: files.clone(),
                    range: tail,
                }
            }
        }
    }

    /// Calls `f` with every id's run in order, from position `first`, a file's at a time
    /// or fewer: `f(position of the run's first id, the run)`.
    fn for_each_run(&self, mut f: impl FnMut(usize, &[u32])) {
        match self {
            TokenIds::Held(ids) => f(0, ids),
            TokenIds::Files { range, .. } => {
                for (file, ids) in self.spans() {
                    let mut at = file.first + ids.start - range.start;
                    file.for_each_run(ids, |run| {
                        f(at, run);
                        at += run.len();
                    });
                }
            }
        }
    }

    /// The largest id (0 for none).
    pub fn largest(&self) -> u32 {
        match self {
            TokenIds::Held(ids) => ids.iter().copied().max().unwrap_or(0),
            // A whole file's is known; a split's part of a file is read.
            TokenIds::Files { .. } => (self.spans())
                .map(|(file, ids)| match ids.len() == file.len() {
                    true => file.largest,
                    false => {
                        let mut largest = 0;
                        file.for_each_run(ids, |run| {
                            largest = run.iter().fold(largest, |m, &id| m.max(id))
                        });
                        largest
                    }
                })
                .max()
                .unwrap_or(0),
        }
    }

    /// The first id at or past `limit`, and its position.
    pub fn first_at_or_past(&self, limit: usize) -> Option<(usize, u32)> {
        if let TokenIds::Files { files, .. } = self {
            // Each file's largest id is known: most checks read nothing.
            if files.iter().all(|f| (f.largest as usize) < limit) {
                return None;
            }
        }
        let mut found = None;
        self.for_each_run(|at, run| {
            if found.is_none() {
                found = (run.iter().position(|&id| id as usize >= limit)).map(|i| (at + i, run[i]));
            }
        });
        found
    }

    /// The ids in memory: a held vector as it is, a file's copied out.
    pub fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::Held(ids) => ids,
            files => files.to_vec(),
        }
    }

    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::Held(ids) => ids.clone(),
            TokenIds::Files { .. } => {
                let mut ids = Vec::with_capacity(self.len());
                self.for_each_run(|_, run| ids.extend_from_slice(run));
                ids
            }
        }
    }

    /// Feeds the ids' bytes to `hash`, as they lie: a file's at memory speed, not widened.
    /// Every rank of a run compares them.
    pub fn hash_into(&self, hash: &mut xxhash_rust::xxh3::Xxh3) {
        match self {
            TokenIds::Held(ids) => hash.update(bytemuck::cast_slice(ids)),
            TokenIds::Files { .. } => {
                for (file, ids) in self.spans() {
                    let bytes = file.body.start + ids.start * file.width;
                    hash.update(&file.bytes[bytes..bytes + ids.len() * file.width]);
                }
            }
        }
    }
}

impl HostIds for TokenIds {
    fn copy_ids(&self, start: usize, out: &mut [u32]) {
        match self {
            TokenIds::Held(ids) => out.copy_from_slice(&ids[start..start + out.len()]),
            TokenIds::Files { files, range } => {
                // The file holding the first id, then the next ones while the window goes on.
                let mut at = range.start + start;
                let mut index = files.partition_point(|f| f.first + f.len() <= at);
                let mut done = 0;
                while done < out.len() {
                    let file = &files[index];
                    let n = (out.len() - done).min(file.first + file.len() - at);
                    file.copy(
                        at - file.first..at - file.first + n,
                        &mut out[done..done + n],
                    );
                    (done, at, index) = (done + n, at + n, index + 1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Files of uint16 ids (in memory, as a gzip file's are) holding `lens` ids each,
    /// numbered on across files.
    fn files(lens: &[usize]) -> TokenIds {
        let mut first = 0;
        let files = lens.iter().map(|&len| {
            let bytes: Vec<u8> = (first..first + len)
                .flat_map(|i| (i as u16).to_le_bytes())
                .collect();
            first += len;
            TokenFile::new(FileBytes::Read(bytes), 0..2 * len, 2)
        });
        TokenIds::of_files(files.collect())
    }

    /// Ranks compare the hash of a split's ids as the files hold them.
    #[test]
    fn a_split_hashes_its_bytes_as_they_lie() {
        let hash = |ids: &TokenIds| {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            ids.hash_into(&mut h);
            h.digest()
        };
        let mut ids = files(&[5, 0, 3, 9000]);
        let whole = hash(&ids);
        assert_eq!(whole, hash(&files(&[5, 0, 3, 9000])));
        let tail = ids.split_off_end(9001);
        let bytes: Vec<u8> = (0u16..7).flat_map(|i| i.to_le_bytes()).collect();
        assert_eq!(hash(&ids), xxhash_rust::xxh3::xxh3_64(&bytes));
        assert_ne!(hash(&tail), whole);
    }

    #[test]
    fn windows_read_across_files_as_one_stream() {
        let mut ids = files(&[5, 0, 3, 9000]);
        assert_eq!(ids.len(), 9008);
        assert_eq!(ids.to_vec(), (0..9008).collect::<Vec<u32>>());
        let mut out = [0u32; 6];
        ids.copy_ids(2, &mut out);
        assert_eq!(out, [2, 3, 4, 5, 6, 7]);
        let val = ids.split_off_end(9001);
        assert_eq!(ids.to_vec(), [0, 1, 2, 3, 4, 5, 6]);
        val.copy_ids(0, &mut out);
        assert_eq!(out, [7, 8, 9, 10, 11, 12]);
        assert_eq!(val.largest(), 9007);
        assert_eq!(ids.largest(), 6);
        assert_eq!(val.first_at_or_past(5000), Some((5000 - 7, 5000)));
        assert_eq!(ids.first_at_or_past(7), None);
        assert_eq!(TokenIds::Held(ids.to_vec()), ids);
        let TokenIds::Files { files, .. } = &val else {
            unreachable!()
        };
        assert_eq!(files[3].first_at_or_past(9000), Some((8992, 9000)));
        assert_eq!(files[3].first_at_or_past(9008), None);
    }
}
