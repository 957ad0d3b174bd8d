//! `trainer tokenize`: text files into llm.c token shards, once, as nanoGPT's prepare.py and
//! llm.c's dev/data scripts do. A run then reads the shards where they lie
//! (`data.source = "tokens"`) instead of tokenizing its text at every start.

use super::*;
use crate::data::vocabulary::Vocabulary;
use crate::data::{ShardWriter, Shards};
use crate::spec::Tokenizer;
use rayon::prelude::*;
use std::io::{BufRead, Read};

/// GPT-2's `<|endoftext|>`: llm.c's fineweb.py puts it before each document.
const END_OF_TEXT: u16 = 50_256;

/// `trainer tokenize`'s arguments.
#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// Text files (UTF-8, plain or gzip), each one document, in the order given.
    #[arg(required = true, value_name = "TEXT")]
    pub inputs: Vec<PathBuf>,
    /// The folder for the shards; created if missing. Shards already there are never
    /// overwritten.
    #[arg(long, short, value_name = "DIR")]
    pub output: PathBuf,
    /// gpt2: GPT-2's byte-pair encoding, with <|endoftext|> before each document (llm.c's
    /// fineweb.py). bytes: one id per byte.
    #[arg(long, default_value = "gpt2")]
    pub tokenizer: String,
    /// Tokens a shard holds at most (llm.c's shards hold 100M).
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: usize,
    /// The share of the tokens, from the end, written as validation shards (as
    /// data.val_fraction splits a text); 0 writes none.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
}

/// What `trainer tokenize` wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Tokenized {
    pub train: crate::data::Shards,
    pub val: crate::data::Shards,
    pub tokenizer: Tokenizer,
}

impl Tokenized {
    /// What it wrote, and the `[data]` keys that train on it. Their paths are absolute: a
    /// job file resolves relative ones from its own folder, not from here.
    pub fn report(&self, dir: &Path) -> String {
        let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
        let shards = |s: &crate::data::Shards, what: &str| {
            let n = s.paths.len();
            let plural = if n == 1 { "" } else { "s" };
            format!("{n} {what} shard{plural} ({} tokens)", s.tokens)
        };
        let mut out = format!(
            "wrote {} and {} in {}\n[data]\nsource = \"tokens\"\npath = \"{}/train_*.bin\"\n",
            shards(&self.train, "train"),
            shards(&self.val, "validation"),
            dir.display(),
            dir.display()
        );
        if !self.val.paths.is_empty() {
            out += &format!("val_path = \"{}/val_*.bin\"\n", dir.display());
        }
        out + &format!("tokenizer = \"{}\"\n", self.tokenizer.name())
    }
}

/// Tokenizes `args.inputs` and writes their shards into `args.output`. On failure it
/// removes what it wrote.
pub fn tokenize(args: &TokenizeArgs) -> Result<Tokenized> {
    let tokenizer = tokenizer_named(&args.tokenizer)?;
    if !(0.0..1.0).contains(&args.val_fraction) {
        return Err(Error::Job(format!(
            "--val-fraction {}: must be at least 0 and below 1",
            args.val_fraction
        )));
    }
    if args.shard_tokens == 0 || args.shard_tokens > i32::MAX as usize {
        return Err(Error::Job(format!(
            "--shard-tokens {}: must be from 1 to {} (llm.c's header holds the count as int32)",
            args.shard_tokens,
            i32::MAX
        )));
    }
    refuse_existing_shards(&args.output)?;
    let created = !args.output.exists();
    std::fs::create_dir_all(&args.output)
        .map_err(|e| Error::Runtime(format!("cannot create {}: {e}", args.output.display())))?;
    let written = write_shards(args, tokenizer);
    if written.is_err() {
        remove_shards(&args.output, created);
    }
    written
}

/// Shards of every token in order, before the split into train and validation.
const UNSPLIT: &str = ".unsplit";

/// Tokenizes the inputs into unsplit shards as it reads them, then splits those into train
/// and validation shards: it holds a few pieces of text and a shard's ids at a time.
fn write_shards(args: &TokenizeArgs, tokenizer: Tokenizer) -> Result<Tokenized> {
    let dir = args.output.as_path();
    let mut unsplit = ShardWriter::new(dir, UNSPLIT, args.shard_tokens);
    let vocabulary = Vocabulary::of(tokenizer, "");
    let mut pieces = Pieces::new(&args.inputs, PIECE_BYTES);
    let (mut counted, mut logged) = (vec![0usize; args.inputs.len()], 0);
    let mut progress = Progress::new();
    // Enough pieces to keep every thread busy, in the order read.
    let batch_len = 2 * rayon::current_num_threads();
    loop {
        let batch = (0..batch_len)
            .map_while(|_| pieces.next().transpose())
            .collect::<Result<Vec<Piece>>>()?;
        if batch.is_empty() {
            break;
        }
        // Both vocabularies fit in 16 bits (50,257 and 256 ids).
        let encoded: Vec<Vec<u16>> = (batch.par_iter())
            .map(|piece| {
                let ids = vocabulary.encode(&piece.text);
                let ids = ids.expect("gpt2 and bytes take any text");
                ids.into_iter().map(|id| id as u16).collect()
            })
            .collect();
        let (bytes, tokens) = (
            batch.iter().map(|p| p.text.len()).sum(),
            encoded.iter().map(Vec::len).sum(),
        );
        if let Some(line) = progress.add(bytes, tokens, std::time::Instant::now()) {
            tracing::info!("{line}");
        }
        for (piece, ids) in batch.iter().zip(encoded) {
            if piece.starts_document && tokenizer == Tokenizer::Gpt2 {
                unsplit.push(&[END_OF_TEXT])?;
                counted[piece.file] += 1;
            }
            unsplit.push(&ids)?;
            counted[piece.file] += ids.len();
        }
        // Files the reader has left are whole: log their counts.
        let left = args.inputs[logged..pieces.file]
            .iter()
            .zip(&counted[logged..]);
        for (path, tokens) in left {
            tracing::info!("{}: {tokens} tokens", path.display());
        }
        logged = pieces.file;
    }
    split(unsplit.finish()?, args, tokenizer)
}

/// A line every PROGRESS_EVERY while a large corpus is tokenized: what is done, and how
/// fast. A single large file otherwise says nothing until it ends.
struct Progress {
    started: std::time::Instant,
    last: std::time::Instant,
    bytes: usize,
    tokens: usize,
}

const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

impl Progress {
    fn new() -> Self {
        let now = std::time::Instant::now();
        Progress {
            started: now,
            last: now,
            bytes: 0,
            tokens: 0,
        }
    }

    /// Counts `bytes` of text and their `tokens`; a line to log when PROGRESS_EVERY has
    /// passed since the last, at `now`.
    fn add(&mut self, bytes: usize, tokens: usize, now: std::time::Instant) -> Option<String> {
        (self.bytes, self.tokens) = (self.bytes + bytes, self.tokens + tokens);
        if now < self.last + PROGRESS_EVERY {
            return None;
        }
        self.last = now;
        let megabytes = self.bytes as f64 / 1e6;
        let seconds = (now - self.started).as_secs_f64();
        Some(format!(
            "{megabytes:.1} MB of text, {} tokens so far: {:.1} MB/s",
            self.tokens,
            megabytes / seconds
        ))
    }
}

/// Splits the unsplit shards into train shards and, from the last `--val-fraction` of the
/// tokens, validation shards; each unsplit shard is removed once read.
fn split(unsplit: Shards, args: &TokenizeArgs, tokenizer: Tokenizer) -> Result<Tokenized> {
    let total = unsplit.tokens;
    let val_len = (total as f64 * args.val_fraction).round() as usize;
    if total - val_len < 2 || (args.val_fraction > 0.0 && val_len < 2) {
        return Err(Error::Job(format!(
            "{total} tokens in all: too few to split by --val-fraction {} into train and \
             validation",
            args.val_fraction
        )));
    }
    let dir = args.output.as_path();
    let mut train = ShardWriter::new(dir, "train", args.shard_tokens);
    let mut val = ShardWriter::new(dir, "val", args.shard_tokens);
    let (mut at, train_len) = (0, total - val_len);
    for path in &unsplit.paths {
        let len = args.shard_tokens.min(total - at);
        // A shard wholly of train ids, or wholly of validation ids, keeps its file.
        let kept = match (at + len <= train_len, at >= train_len) {
            (true, _) => train.adopt(path, len)?,
            (_, true) => val.adopt(path, len)?,
            _ => false,
        };
        if !kept {
            let ids = crate::data::read_shard(path)?;
            let cut = train_len.saturating_sub(at).min(ids.len());
            train.push(&ids[..cut])?;
            val.push(&ids[cut..])?;
            std::fs::remove_file(path)
                .map_err(|e| Error::Runtime(format!("cannot remove {}: {e}", path.display())))?;
        }
        at += len;
    }
    Ok(Tokenized {
        train: train.finish()?,
        val: val.finish()?,
        tokenizer,
    })
}

/// Removes what a failed tokenize wrote: its shards, unsplit or not, and their temporary
/// files; and the folder, where it made it. The folder held no shards before
/// (`refuse_existing_shards`), so every shard there is this call's.
fn remove_shards(dir: &Path, created: bool) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let name = name.trim_start_matches('.');
        let ours = ["train_", "val_", UNSPLIT.trim_start_matches('.')]
            .iter()
            .any(|prefix| name.starts_with(prefix));
        if ours && (name.ends_with(".bin") || name.ends_with(".bin.tmp")) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    if created {
        let _ = std::fs::remove_dir(dir);
    }
}

/// Bytes of text a task encodes at a time: about a tenth of a second of one thread's work.
const PIECE_BYTES: usize = 1 << 20;

/// A piece of one input file's text.
struct Piece {
    text: String,
    /// Which input it is from.
    file: usize,
    /// Whether it is its file's first: a document starts there.
    starts_document: bool,
}

/// The inputs' text in order, a piece of about `piece_bytes` at a time. A piece ends where
/// GPT-2's pre-tokenizer cuts the text anyway (`safe_cut`), or at the end of its file, so the
/// pieces' ids are the whole text's. A file with no such place is one piece.
struct Pieces<'a> {
    inputs: &'a [PathBuf],
    piece_bytes: usize,
    /// The index of the file being read, its reader, and whether it is gzip.
    file: usize,
    reader: Option<Box<dyn Read + Send>>,
    gzip: bool,
    /// Where `buffer` starts in the file's text, in bytes.
    offset: usize,
    /// Bytes read and not yet given out.
    buffer: Vec<u8>,
    /// Whether the file's end has been read.
    ended: bool,
    /// Whether the file has given a piece.
    started: bool,
}

impl<'a> Pieces<'a> {
    fn new(inputs: &'a [PathBuf], piece_bytes: usize) -> Self {
        Pieces {
            inputs,
            piece_bytes,
            file: 0,
            reader: None,
            gzip: false,
            offset: 0,
            buffer: Vec::new(),
            ended: false,
            started: false,
        }
    }

    /// The next piece, or None after the last file.
    fn next(&mut self) -> Result<Option<Piece>> {
        loop {
            if self.file == self.inputs.len() {
                return Ok(None);
            }
            if self.reader.is_none() {
                self.open()?;
            }
            let searched = self.buffer.len().saturating_sub(2);
            if !self.ended {
                self.read_more()?;
            }
            let cut = match self.ended {
                true => Some(self.buffer.len()),
                false => safe_cut(&self.buffer, searched),
            };
            // An empty file gives one empty piece: a document too, which <|endoftext|>
            // stands for.
            if let Some(cut) = cut {
                let rest = self.buffer.split_off(cut);
                let text = std::mem::replace(&mut self.buffer, rest);
                let (file, first) = (self.file, !self.started);
                self.started = true;
                let piece = self.piece(text, file, first)?;
                self.offset += cut;
                if self.ended && self.buffer.is_empty() {
                    self.next_file();
                }
                return Ok(Some(piece));
            }
        }
    }

    fn piece(&self, text: Vec<u8>, file: usize, starts_document: bool) -> Result<Piece> {
        let text = String::from_utf8(text).map_err(|e| {
            let at = self.offset + e.utf8_error().valid_up_to();
            Error::Job(format!(
                "{}: not UTF-8 text (byte {at})",
                self.inputs[file].display()
            ))
        })?;
        Ok(Piece {
            text,
            file,
            starts_document,
        })
    }

    fn open(&mut self) -> Result<()> {
        let path = &self.inputs[self.file];
        let unreadable = |e: std::io::Error| Error::UnreadableData {
            path: path.clone(),
            message: format!("cannot read data file {}: {e}", path.display()),
        };
        let mut file = std::io::BufReader::new(std::fs::File::open(path).map_err(unreadable)?);
        self.gzip = file
            .fill_buf()
            .map_err(unreadable)?
            .starts_with(&[0x1f, 0x8b]);
        self.reader = Some(match self.gzip {
            true => Box::new(flate2::read::MultiGzDecoder::new(file)),
            false => Box::new(file),
        });
        Ok(())
    }

    /// Reads up to `piece_bytes` more; fewer means the file has ended.
    fn read_more(&mut self) -> Result<()> {
        let reader = self.reader.as_mut().expect("opened");
        let want = self.piece_bytes as u64;
        let read = reader.take(want).read_to_end(&mut self.buffer);
        let read = read.map_err(|e| {
            let path = &self.inputs[self.file];
            match self.gzip {
                true => Error::Job(format!("{}: corrupt gzip data: {e}", path.display())),
                false => Error::UnreadableData {
                    path: path.clone(),
                    message: format!("cannot read data file {}: {e}", path.display()),
                },
            }
        })?;
        self.ended = (read as u64) < want;
        Ok(())
    }

    fn next_file(&mut self) {
        self.file += 1;
        self.reader = None;
        self.buffer.clear();
        (self.offset, self.ended, self.started) = (0, false, false);
    }
}

/// The last place in `text`, at or after `from`, where GPT-2's pre-tokenizer starts a word
/// whatever comes before: just after a line break between two printable ASCII characters;
/// else, for a line longer than a piece, at a space between a printable ASCII character and
/// an ASCII letter (the space begins the next word). None where there is neither.
fn safe_cut(text: &[u8], from: usize) -> Option<usize> {
    let printable = |b: u8| b.is_ascii_graphic();
    let places = || (from.max(2)..text.len().saturating_sub(1)).rev();
    let after_line_break =
        |p: usize| text[p - 1] == b'\n' && printable(text[p - 2]) && printable(text[p]);
    let before_word =
        |p: usize| text[p] == b' ' && printable(text[p - 1]) && text[p + 1].is_ascii_alphabetic();
    (places().find(|&p| after_line_break(p))).or_else(|| places().find(|&p| before_word(p)))
}

/// The tokenizer `--tokenizer` names: one whose vocabulary token files can stand for.
fn tokenizer_named(name: &str) -> Result<Tokenizer> {
    match name {
        "gpt2" => Ok(Tokenizer::Gpt2),
        "bytes" => Ok(Tokenizer::Bytes),
        "char" => Err(Error::Job(
            "--tokenizer char: a char vocabulary is the text's own characters, which token \
             files do not record; train on the text itself (data.source = \"text\")"
                .into(),
        )),
        other => Err(Error::Job(format!(
            "--tokenizer {other}: not a tokenizer; allowed: gpt2, bytes"
        ))),
    }
}

/// Nothing is overwritten: a folder that holds shards already is refused.
fn refuse_existing_shards(dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let taken = entries.flatten().map(|e| e.file_name()).find(|name| {
        let name = name.to_string_lossy();
        (name.starts_with("train_") || name.starts_with("val_")) && name.ends_with(".bin")
    });
    match taken {
        Some(name) => Err(Error::Job(format!(
            "{}: holds {} already; tokenize never overwrites shards: give another folder",
            dir.display(),
            name.to_string_lossy()
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(inputs: &[PathBuf], piece_bytes: usize) -> Result<Vec<Piece>> {
        let mut pieces = Pieces::new(inputs, piece_bytes);
        std::iter::from_fn(|| pieces.next().transpose()).collect()
    }

    /// Together the pieces are `whole`, and their GPT-2 ids are its ids.
    fn assert_encoded_as_whole(pieces: &[Piece], whole: &str) {
        let text: String = pieces.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(text, whole);
        let gpt2 = Vocabulary::of(Tokenizer::Gpt2, "");
        let ids: Vec<u32> = (pieces.iter())
            .flat_map(|p| gpt2.encode(&p.text).unwrap())
            .collect();
        assert_eq!(ids, gpt2.encode(whole).unwrap());
    }

    /// The bundled Shakespeare (gzip) in pieces of about 1,000 bytes: together they are the
    /// text, and their GPT-2 ids are the whole text's.
    #[test]
    fn pieces_give_the_whole_texts_ids() {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("jobs/data/shakespeare.txt.gz");
        let whole = crate::data::read_text(&path).unwrap();
        let pieces = read_all(std::slice::from_ref(&path), 1000).unwrap();
        assert!(pieces.len() > 500, "{} pieces", pieces.len());
        assert!(pieces[0].starts_document && pieces[1..].iter().all(|p| !p.starts_document));
        assert_encoded_as_whole(&pieces, &whole);
    }

    /// A text on one line, longer than a piece, is cut before its words: the bundled
    /// Shakespeare with its line breaks as spaces, in pieces of about 1,000 bytes, gives the
    /// whole line's ids.
    #[test]
    fn a_line_longer_than_a_piece_is_cut_before_a_word() {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("jobs/data/shakespeare.txt.gz");
        let line = crate::data::read_text(&path).unwrap().replace('\n', " ");
        let tmp = tempfile::tempdir().unwrap();
        let one_line = tmp.path().join("line.txt");
        std::fs::write(&one_line, &line).unwrap();
        let pieces = read_all(&[one_line], 1000).unwrap();
        assert!(pieces.len() > 500, "{} pieces", pieces.len());
        assert!(pieces.iter().all(|p| p.text.len() < 2000));
        assert_encoded_as_whole(&pieces, &line);
    }

    /// Progress is a line every ten seconds, with the text and tokens so far and the rate.
    #[test]
    fn progress_speaks_every_ten_seconds() {
        let mut progress = Progress::new();
        let at = |s: u64| progress.started + std::time::Duration::from_secs(s);
        let (five, ten, twelve, twenty) = (at(5), at(10), at(12), at(20));
        assert_eq!(progress.add(4_000_000, 1_000_000, five), None);
        let line = progress.add(6_000_000, 1_500_000, ten);
        assert_eq!(
            line.as_deref(),
            Some("10.0 MB of text, 2500000 tokens so far: 1.0 MB/s")
        );
        assert_eq!(progress.add(1, 1, twelve), None);
        assert!(progress.add(1, 1, twenty).is_some());
    }

    /// Edge cases: a file with no place to cut is one piece; an empty file is one empty
    /// document; a byte that is not UTF-8 is named by its place in its file.
    #[test]
    fn pieces_of_odd_files() {
        let tmp = tempfile::tempdir().unwrap();
        let file = |name: &str, bytes: &[u8]| {
            let path = tmp.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            path
        };
        let (long, empty) = (file("long.txt", &[b'x'; 5000]), file("empty.txt", b""));
        let lines = file("lines.txt", "word.\n".repeat(1000).as_bytes());
        let pieces = read_all(&[long, empty, lines.clone()], 100).unwrap();
        let summary: Vec<(usize, bool, usize)> = (pieces.iter())
            .map(|p| (p.file, p.starts_document, p.text.len()))
            .take(3)
            .collect();
        assert_eq!(summary, [(0, true, 5000), (1, true, 0), (2, true, 96)]);
        let third: String = pieces[2..].iter().map(|p| p.text.as_str()).collect();
        assert_eq!(third, "word.\n".repeat(1000));

        let mut bad = "word.\n".repeat(100).into_bytes();
        bad.extend_from_slice(b"caf\xe9\n");
        let bad = file("bad.txt", &bad);
        let error = read_all(&[lines, bad], 100).err().unwrap().to_string();
        assert!(
            error.ends_with("bad.txt: not UTF-8 text (byte 603)"),
            "{error}"
        );
    }
}
