//! Token files for language models, already tokenized: llm.c's shards (a header of 256
//! int32, then uint16 or uint32 ids) or nanoGPT's train.bin (uint16 ids, no header). A path
//! whose file name holds `*` or `?` names every matching file, in name order, read as one
//! stream. Samples are windows as for text (`text::windows`).
//!
//! The files are read where they lie, a window at a time (`TokenIds`), gzip files excepted.

use super::text::{classes, windows, Splits};
use super::token_ids::{FileBytes, TokenFile, TokenIds};
use super::vocabulary::Vocabulary;
use super::{Data, Origin};
use crate::error::{Error, Result};
use crate::spec::{DataSource, DataSpec, TokenFormat};
use std::path::{Path, PathBuf};

/// llm.c's header: 256 little-endian int32.
const HEADER_BYTES: usize = 256 * 4;
const LLMC_MAGIC: i32 = 20240520;
/// The loss reads a target token as an f32 class index, exact below this.
const LARGEST_VOCABULARY: usize = 1 << 24;

pub fn load(spec: &DataSpec) -> Result<Data> {
    let (Some(path), Some(block)) = (&spec.path, spec.block_size) else {
        return Err(Error::Job(
            "source = \"tokens\" needs data.path and data.block_size".into(),
        ));
    };
    let format = spec.token_format.unwrap_or_default();
    // The tokenizer that wrote the files, if the job names it: ids must lie in its vocabulary.
    let vocabulary = spec.tokenizer.map(|t| Vocabulary::of(t, ""));
    let limit = match (&vocabulary, spec.classes) {
        (Some(v), None) => Some(Limit {
            classes: v.len(),
            from: format!(
                "the {} tokens of data.tokenizer = \"{}\"",
                v.len(),
                v.tokenizer.name()
            ),
        }),
        (v, Some(c)) => Some(Limit {
            classes: v.as_ref().map_or(Ok(c), |v| classes(spec, v))?,
            from: format!("data.classes = {c}, the vocabulary's size"),
        }),
        (None, None) => None,
    };
    let train_files = files(path, "data.path")?;
    let train = read_all(&train_files, format, limit.as_ref())?;
    // Before any split: each whole file's largest id is known.
    let mut largest = train.largest()?;
    let name = path.display().to_string();
    let splits = match &spec.val_path {
        Some(val_path) => {
            let val_files = files(val_path, "data.val_path")?;
            let val = read_all(&val_files, format, limit.as_ref())?;
            largest = largest.max(val.largest()?);
            Splits {
                origin: Origin::file(&name, None),
                train: (format!("{name}: the training tokens"), train),
                val: (format!("{} (data.val_path)", val_path.display()), val),
            }
        }
        None => Splits::at_end(&name, "tokens", train, spec.val_fraction),
    };
    let classes = limit.map_or(largest as usize + 1, |l| l.classes).max(2);
    windows(splits, block, classes, DataSource::Tokens, vocabulary)
}

/// The file `path` names, or the files its glob matches (in the file name only), sorted.
fn files(path: &Path, key: &str) -> Result<Vec<PathBuf>> {
    let pattern = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let Some(pattern) = pattern.filter(|p| p.contains(['*', '?'])) else {
        return Ok(vec![path.to_path_buf()]);
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let entries = std::fs::read_dir(dir).map_err(|e| {
        Error::Job(format!(
            "{key} = {}: cannot list {}: {e}",
            path.display(),
            dir.display()
        ))
    })?;
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| glob_match(pattern.as_bytes(), e.file_name().as_encoded_bytes()))
        .map(|e| e.path())
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(Error::Job(format!(
            "{key} = {}: no file in {} matches {pattern}",
            path.display(),
            dir.display()
        )));
    }
    Ok(found)
}

/// Whether `name` matches `pattern`, where `*` is any run of bytes and `?` any one byte.
fn glob_match(pattern: &[u8], name: &[u8]) -> bool {
    match (pattern.first(), name.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            glob_match(&pattern[1..], name) || (!name.is_empty() && glob_match(pattern, &name[1..]))
        }
        (Some(b'?'), Some(_)) => glob_match(&pattern[1..], &name[1..]),
        (Some(p), Some(n)) if p == n => glob_match(&pattern[1..], &name[1..]),
        _ => false,
    }
}

/// The vocabulary's size where the job gives it, and which key gives it.
struct Limit {
    classes: usize,
    from: String,
}

/// The ids of `files`, one after another, each checked against `limit` where given.
fn read_all(files: &[PathBuf], format: TokenFormat, limit: Option<&Limit>) -> Result<TokenIds> {
    let mut read = Vec::with_capacity(files.len());
    for path in files {
        let file = read_ids(path, format)?;
        let below = limit.map_or(LARGEST_VOCABULARY, |l| l.classes);
        if file.largest() as usize >= below {
            let why = match limit {
                Some(l) => format!("not below {}", l.from),
                None => format!("past the largest vocabulary trainer holds, {LARGEST_VOCABULARY}"),
            };
            let (at, id) = file.first_at_or_past(below)?.expect("its largest id is");
            return Err(Error::Job(format!(
                "{}: token {at} is {id}, {why}",
                path.display()
            )));
        }
        read.push(file);
    }
    Ok(TokenIds::of_files(read))
}

/// One file's ids.
fn read_ids(path: &Path, format: TokenFormat) -> Result<TokenFile> {
    let name = path.display().to_string();
    let bytes = FileBytes::open(path)?;
    let (body, width) = match format {
        TokenFormat::Uint16 => (0..bytes.len(), 2),
        TokenFormat::LlmC => {
            let mut header = vec![0; bytes.len().min(HEADER_BYTES)];
            bytes
                .read_at(0, &mut header)
                .map_err(|e| Error::UnreadableData {
                    path: path.to_path_buf(),
                    message: format!("cannot read data file {name}: {e}"),
                })?;
            llmc_body(&name, &header, bytes.len())?
        }
    };
    if body.len() % width != 0 {
        return Err(Error::Job(format!(
            "{name}: {} bytes of ids is not a whole number of {width}-byte tokens",
            body.len()
        )));
    }
    TokenFile::new(bytes, body, width)
}

/// Where an llm.c file of `len` bytes holds its ids (after its header) and their width in
/// bytes, its `header` checked (the file's first bytes, up to the header's length).
fn llmc_body(name: &str, header: &[u8], len: usize) -> Result<(std::ops::Range<usize>, usize)> {
    let int = |i: usize| i32::from_le_bytes(header[4 * i..4 * i + 4].try_into().unwrap());
    if header.len() >= 4 && int(0) != LLMC_MAGIC {
        let magic = int(0);
        return Err(Error::Job(format!(
            "{name}: not an llm.c token file: its magic number is {magic}, not {LLMC_MAGIC} \
             (nanoGPT's headerless train.bin: data.token_format = \"uint16\")"
        )));
    }
    if len < HEADER_BYTES {
        return Err(Error::Job(format!(
            "{name}: {len} bytes, shorter than llm.c's header of 256 int32 ({HEADER_BYTES} bytes)"
        )));
    }
    let (version, count) = (int(1), int(2));
    let width = match version {
        1 => 2,
        2 => 4,
        _ => {
            return Err(Error::Job(format!(
                "{name}: llm.c token file version {version}; trainer reads 1 (uint16 ids) and \
                 2 (uint32 ids)"
            )))
        }
    };
    let body = HEADER_BYTES..len;
    let expected = usize::try_from(count)
        .ok()
        .and_then(|c| c.checked_mul(width));
    if expected != Some(body.len()) {
        return Err(Error::Job(format!(
            "{name}: its header says {count} tokens ({} bytes after the header), but {} bytes \
             follow: the file is cut short or not what its header says",
            expected.map_or("an impossible number of".into(), |e| e.to_string()),
            body.len()
        )));
    }
    Ok((body, width))
}

/// The ids of a shard a `ShardWriter` wrote (llm.c's format, version 1).
pub fn read_shard(path: &Path) -> Result<Vec<u16>> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| Error::UnreadableData {
        path: path.to_path_buf(),
        message: format!("cannot read data file {name}: {e}"),
    })?;
    let (body, _) = llmc_body(&name, &bytes[..bytes.len().min(HEADER_BYTES)], bytes.len())?;
    Ok(bytes[body]
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect())
}

/// Shards written by a `ShardWriter`: their paths, and the ids in all of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shards {
    pub paths: Vec<PathBuf>,
    pub tokens: usize,
}

/// Writes ids as llm.c token files of `per_shard` ids each (uint16, version 1), the last
/// shorter: `dir/{prefix}_000000.bin`, then 000001 and on. It holds at most one shard's ids.
/// Each shard goes by a temporary name, is put on disk and then renamed, so a shard that
/// exists is whole.
pub struct ShardWriter<'a> {
    dir: &'a Path,
    prefix: &'static str,
    per_shard: usize,
    pending: Vec<u16>,
    written: Shards,
}

impl<'a> ShardWriter<'a> {
    pub fn new(dir: &'a Path, prefix: &'static str, per_shard: usize) -> Self {
        ShardWriter {
            dir,
            prefix,
            per_shard: per_shard.max(1),
            pending: Vec::new(),
            written: Shards::default(),
        }
    }

    /// Adds `ids` after those before, writing each shard as it fills.
    pub fn push(&mut self, mut ids: &[u16]) -> Result<()> {
        while !ids.is_empty() {
            let room = self.per_shard - self.pending.len();
            let (now, rest) = ids.split_at(room.min(ids.len()));
            self.pending.extend_from_slice(now);
            if self.pending.len() == self.per_shard {
                self.write_pending()?;
            }
            ids = rest;
        }
        Ok(())
    }

    /// Takes `path`, a shard of `len` ids another writer wrote, as this one's next shard, by
    /// renaming it; false where this one holds ids of its own. A shard shorter than
    /// `per_shard` must be the last.
    pub fn adopt(&mut self, path: &Path, len: usize) -> Result<bool> {
        if !self.pending.is_empty() {
            return Ok(false);
        }
        let k = self.written.paths.len();
        let to = self.dir.join(format!("{}_{k:06}.bin", self.prefix));
        std::fs::rename(path, &to).map_err(|e| {
            Error::Runtime(format!(
                "cannot rename {} to {}: {e}",
                path.display(),
                to.display()
            ))
        })?;
        self.written.paths.push(to);
        self.written.tokens += len;
        Ok(true)
    }

    /// Writes the last, shorter shard, and says what was written.
    pub fn finish(mut self) -> Result<Shards> {
        if !self.pending.is_empty() {
            self.write_pending()?;
        }
        Ok(self.written)
    }

    fn write_pending(&mut self) -> Result<()> {
        let k = self.written.paths.len();
        let (dir, prefix) = (self.dir, self.prefix);
        let path = dir.join(format!("{prefix}_{k:06}.bin"));
        let tmp = dir.join(format!(".{prefix}_{k:06}.bin.tmp"));
        let mut header = [0i32; 256];
        header[..3].copy_from_slice(&[LLMC_MAGIC, 1, self.pending.len() as i32]);
        let ids: Vec<u8> = self
            .pending
            .iter()
            .flat_map(|id| id.to_le_bytes())
            .collect();
        let written = std::fs::File::create(&tmp).and_then(|mut f| {
            use std::io::Write;
            f.write_all(bytemuck::cast_slice(&header.map(i32::to_le)))?;
            f.write_all(&ids)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(dir)?.sync_all()
        });
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::Runtime(format!(
                "cannot write {}: {e}",
                path.display()
            )));
        }
        self.written.paths.push(path);
        self.written.tokens += self.pending.len();
        self.pending.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn globs_match_as_a_shell_does_in_one_folder() {
        let m = |p: &str, n: &str| glob_match(p.as_bytes(), n.as_bytes());
        assert!(m("train_*.bin", "train_000001.bin"));
        assert!(m("*", "x"));
        assert!(m("a?c", "abc"));
        assert!(!m("train_*.bin", "val_000000.bin"));
        assert!(!m("a?c", "ac"));
        assert!(!m("*.bin", "x.bin.gz"));
    }
}
