//! A language model's token ids: held in memory (a text tokenized at load), or read from
//! token files where they lie. FineWeb's 10B tokens are 20 GB of uint16 shards: read a
//! window at a time, they cost no heap, no load time, and one copy in the page cache for
//! every rank of a multi-process run. A batch copies its windows out, widened to u32.
//!
//! The files are read with positioned reads, as llm.c's data loader does, not mapped: a
//! file cut short while a run reads it fails the run with a message naming it, where a
//! mapping would end the process with SIGBUS and no summary.

use crate::error::{Error, Result};
use crate::tensor::HostIds;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

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
    /// Why a batch's read failed: the file changed under the run. The batch read zeros,
    /// and the step that took it fails the run (`TokenIds::check_reads`).
    failure: OnceLock<String>,
}

/// A file's bytes: read where they lie as batches need them, or read whole at load.
pub enum FileBytes {
    OnDisk {
        file: std::fs::File,
        path: PathBuf,
        /// Its length when it was opened.
        len: usize,
    },
    /// A gzip file's bytes, decompressed.
    InMemory(Vec<u8>),
}

impl FileBytes {
    /// `path`, opened to be read where it lies, unless gzip (decompressed into memory).
    pub fn open(path: &Path) -> Result<FileBytes> {
        let unreadable = |e: io::Error| Error::UnreadableData {
            path: path.to_path_buf(),
            message: format!("cannot read data file {}: {e}", path.display()),
        };
        let file = std::fs::File::open(path).map_err(unreadable)?;
        let metadata = file.metadata().map_err(unreadable)?;
        if metadata.is_dir() {
            return Err(Error::Job(format!(
                "{0} is a folder, not a token file: name its shards by a glob, e.g. {0}/*.bin",
                path.display()
            )));
        }
        let bytes = FileBytes::OnDisk {
            file,
            path: path.to_path_buf(),
            len: metadata.len() as usize,
        };
        let mut magic = [0u8; 2];
        if bytes.len() >= 2 && bytes.read_at(0, &mut magic).is_ok() && magic == [0x1f, 0x8b] {
            return super::sources::read_bytes(path).map(FileBytes::InMemory);
        }
        Ok(bytes)
    }

    pub fn len(&self) -> usize {
        match self {
            FileBytes::OnDisk { len, .. } => *len,
            FileBytes::InMemory(bytes) => bytes.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its bytes `at..at + out.len()` into `out`.
    pub fn read_at(&self, at: usize, out: &mut [u8]) -> io::Result<()> {
        match self {
            FileBytes::OnDisk { file, .. } => file.read_exact_at(out, at as u64),
            FileBytes::InMemory(bytes) => match bytes.get(at..at + out.len()) {
                Some(b) => {
                    out.copy_from_slice(b);
                    Ok(())
                }
                None => Err(io::ErrorKind::UnexpectedEof.into()),
            },
        }
    }
}

impl TokenFile {
    /// The ids at `body` of `bytes`, `width` bytes each, read once for the largest.
    pub fn new(bytes: FileBytes, body: Range<usize>, width: usize) -> Result<Self> {
        let mut file = TokenFile {
            bytes,
            body,
            width,
            first: 0,
            largest: 0,
            failure: OnceLock::new(),
        };
        let mut largest = 0;
        let all = 0..file.len();
        file.for_each_run(all.clone(), |run| {
            largest = run.iter().fold(largest, |m, &id| m.max(id));
        })
        .map_err(|e| file.unreadable(all, e))?;
        file.largest = largest;
        Ok(file)
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
    pub fn first_at_or_past(&self, limit: usize) -> Result<Option<(usize, u32)>> {
        let (mut at, mut found) = (0, None);
        if self.largest as usize >= limit {
            let all = 0..self.len();
            self.for_each_run(all.clone(), |run| {
                if found.is_none() {
                    found =
                        (run.iter().position(|&id| id as usize >= limit)).map(|i| (at + i, run[i]));
                }
                at += run.len();
            })
            .map_err(|e| self.unreadable(all, e))?;
        }
        Ok(found)
    }

    /// Ids `at.start..at.end` of this file into `out`.
    fn copy(&self, at: Range<usize>, out: &mut [u32]) -> io::Result<()> {
        let mut bytes = [0u8; 8192];
        let per_read = bytes.len() / self.width;
        for (k, out) in out.chunks_mut(per_read).enumerate() {
            let bytes = &mut bytes[..out.len() * self.width];
            let id = at.start + k * per_read;
            self.bytes
                .read_at(self.body.start + id * self.width, bytes)?;
            match self.width {
                2 => (out.iter_mut().zip(bytes.chunks_exact(2)))
                    .for_each(|(o, b)| *o = u32::from(u16::from_le_bytes([b[0], b[1]]))),
                _ => (out.iter_mut().zip(bytes.chunks_exact(4)))
                    .for_each(|(o, b)| *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            }
        }
        Ok(())
    }

    /// Calls `f` with the ids of `at`, a few thousand at a time.
    fn for_each_run(&self, at: Range<usize>, mut f: impl FnMut(&[u32])) -> io::Result<()> {
        let mut run = vec![0u32; 1 << 16];
        let mut start = at.start;
        while start < at.end {
            let n = run.len().min(at.end - start);
            self.copy(start..start + n, &mut run[..n])?;
            f(&run[..n]);
            start += n;
        }
        Ok(())
    }

    /// Why reading its ids `at` failed, with what changed: its length, most likely.
    fn unreadable(&self, at: Range<usize>, e: io::Error) -> Error {
        let FileBytes::OnDisk { file, path, len } = &self.bytes else {
            return Error::Runtime(format!("reading ids {at:?} of a gzip token file: {e}"));
        };
        let e = match e.kind() {
            io::ErrorKind::UnexpectedEof => "the file ends before them".to_string(),
            _ => e.to_string(),
        };
        let now = match file.metadata() {
            Ok(m) if m.len() as usize != *len => {
                format!(
                    "; it is {} bytes now, {len} when the run opened it",
                    m.len()
                )
            }
            _ => String::new(),
        };
        Error::Runtime(format!(
            "{}: cannot read its ids {}..{}: {e}{now}. Token files must not change while a \
             run reads them.",
            path.display(),
            at.start,
            at.end
        ))
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

    /// The bytes of its ids in files read where they lie: host memory only as a page
    /// cache. Held ids, and a gzip file's, take heap instead (`heap_bytes`).
    pub fn on_disk_bytes(&self) -> usize {
        self.file_bytes(true)
    }

    /// The bytes of host memory the ids take.
    pub fn heap_bytes(&self) -> usize {
        match self {
            TokenIds::Held(ids) => ids.len() * 4,
            TokenIds::Files { .. } => self.file_bytes(false),
        }
    }

    /// The bytes of this split's ids in files on disk, or in memory.
    fn file_bytes(&self, on_disk: bool) -> usize {
        (self.spans())
            .filter(|(f, _)| matches!(f.bytes, FileBytes::OnDisk { .. }) == on_disk)
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

    /// Calls `f` with every id's run in order, a file's at a time or fewer:
    /// `f(position of the run's first id, the run)`.
    fn for_each_run(&self, mut f: impl FnMut(usize, &[u32])) -> Result<()> {
        match self {
            TokenIds::Held(ids) => f(0, ids),
            TokenIds::Files { range, .. } => {
                for (file, ids) in self.spans() {
                    let mut at = file.first + ids.start - range.start;
                    file.for_each_run(ids.clone(), |run| {
                        f(at, run);
                        at += run.len();
                    })
                    .map_err(|e| file.unreadable(ids, e))?;
                }
            }
        }
        Ok(())
    }

    /// The largest id (0 for none).
    pub fn largest(&self) -> Result<u32> {
        if let TokenIds::Held(ids) = self {
            return Ok(ids.iter().copied().max().unwrap_or(0));
        }
        // A whole file's is known; a split's part of a file is read.
        let mut largest = 0;
        for (file, ids) in self.spans() {
            if ids.len() == file.len() {
                largest = largest.max(file.largest);
                continue;
            }
            file.for_each_run(ids.clone(), |run| {
                largest = run.iter().fold(largest, |m, &id| m.max(id))
            })
            .map_err(|e| file.unreadable(ids, e))?;
        }
        Ok(largest)
    }

    /// The first id at or past `limit`, and its position.
    pub fn first_at_or_past(&self, limit: usize) -> Result<Option<(usize, u32)>> {
        if let TokenIds::Files { files, .. } = self {
            // Each file's largest id is known: most checks read nothing.
            if files.iter().all(|f| (f.largest as usize) < limit) {
                return Ok(None);
            }
        }
        let mut found = None;
        self.for_each_run(|at, run| {
            if found.is_none() {
                found = (run.iter().position(|&id| id as usize >= limit)).map(|i| (at + i, run[i]));
            }
        })?;
        Ok(found)
    }

    /// The ids in memory: a held vector as it is, a file's copied out.
    pub fn into_vec(self) -> Result<Vec<u32>> {
        match self {
            TokenIds::Held(ids) => Ok(ids),
            files => files.to_vec(),
        }
    }

    pub fn to_vec(&self) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(self.len());
        self.for_each_run(|_, run| ids.extend_from_slice(run))?;
        Ok(ids)
    }

    /// Feeds the ids' bytes to `hash`, as they lie, not widened. Every rank of a run
    /// compares them.
    pub fn hash_into(&self, hash: &mut xxhash_rust::xxh3::Xxh3) -> Result<()> {
        if let TokenIds::Held(ids) = self {
            hash.update(bytemuck::cast_slice(ids));
            return Ok(());
        }
        let mut bytes = vec![0u8; 1 << 20];
        for (file, ids) in self.spans() {
            let (start, end) = (ids.start * file.width, ids.end * file.width);
            for at in (start..end).step_by(bytes.len()) {
                let bytes = &mut bytes[..(end - at).min(1 << 20)];
                (file.bytes.read_at(file.body.start + at, bytes))
                    .map_err(|e| file.unreadable(ids.clone(), e))?;
                hash.update(bytes);
            }
        }
        Ok(())
    }

    /// Whether every batch read its windows: a file that changed under the run (cut
    /// short) gave zeros, and fails the step that took them.
    pub fn check_reads(&self) -> Result<()> {
        match self.spans().find_map(|(file, _)| file.failure.get()) {
            Some(why) => Err(Error::Runtime(why.clone())),
            None => Ok(()),
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
                    let (ids, out) = (
                        at - file.first..at - file.first + n,
                        &mut out[done..done + n],
                    );
                    if let Err(e) = file.copy(ids.clone(), out) {
                        out.fill(0);
                        file.failure
                            .get_or_init(|| file.unreadable(ids, e).to_string());
                    }
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
            TokenFile::new(FileBytes::InMemory(bytes), 0..2 * len, 2).unwrap()
        });
        TokenIds::of_files(files.collect())
    }

    /// Ranks compare the hash of a split's ids as the files hold them.
    #[test]
    fn a_split_hashes_its_bytes_as_they_lie() {
        let hash = |ids: &TokenIds| {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            ids.hash_into(&mut h).unwrap();
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
        assert_eq!(ids.to_vec().unwrap(), (0..9008).collect::<Vec<u32>>());
        let mut out = [0u32; 6];
        ids.copy_ids(2, &mut out);
        assert_eq!(out, [2, 3, 4, 5, 6, 7]);
        let val = ids.split_off_end(9001);
        assert_eq!(ids.to_vec().unwrap(), [0, 1, 2, 3, 4, 5, 6]);
        val.copy_ids(0, &mut out);
        assert_eq!(out, [7, 8, 9, 10, 11, 12]);
        assert_eq!(val.largest().unwrap(), 9007);
        assert_eq!(ids.largest().unwrap(), 6);
        assert_eq!(val.first_at_or_past(5000).unwrap(), Some((5000 - 7, 5000)));
        assert_eq!(ids.first_at_or_past(7).unwrap(), None);
        let TokenIds::Files { files, .. } = &val else {
            unreachable!()
        };
        assert_eq!(files[3].first_at_or_past(9000).unwrap(), Some((8992, 9000)));
        assert_eq!(files[3].first_at_or_past(9008).unwrap(), None);
        assert!(ids.check_reads().is_ok() && val.check_reads().is_ok());
    }

    /// A file cut short while a run reads it: the window reads zeros, and the check after
    /// the step names the file and how it changed. A mapping would have ended the process.
    #[test]
    fn a_file_cut_short_under_a_run_fails_its_reads_by_name() {
        let dir = std::env::temp_dir().join(format!("trainer-cut-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("shard.bin");
        let bytes: Vec<u8> = (1u16..=3000).flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = TokenFile::new(FileBytes::open(&path).unwrap(), 0..bytes.len(), 2).unwrap();
        let ids = TokenIds::of_files(vec![file]);
        let mut out = [7u32; 4];
        ids.copy_ids(2000, &mut out);
        assert_eq!(out, [2001, 2002, 2003, 2004]);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(1000)
            .unwrap();
        ids.copy_ids(2000, &mut out);
        assert_eq!(out, [0; 4]);
        let e = ids.check_reads().unwrap_err();
        assert_eq!(e.exit_code(), 1);
        let message = e.to_string();
        assert!(message.starts_with(&format!(
            "{}: cannot read its ids 2000..2004",
            path.display()
        )));
        assert!(
            message.contains("the file ends before them; it is 1000 bytes now, 6000 when"),
            "{message}"
        );
        assert!(
            message.contains("must not change while a run reads them"),
            "{message}"
        );
        assert!(ids.to_vec().is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
