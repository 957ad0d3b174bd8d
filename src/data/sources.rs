//! The data sources. Each returns raw samples and names the file and row or byte offset of
//! anything wrong with them.

use super::{Dataset, Origin, Raw};
use crate::error::{Error, Result};
use crate::spec::{Column, DataSpec, Task};
use crate::tensor::rng::{derive, Rng};
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

/// The UCI digits, bundled in the binary (E. Alpaydin, C. Kaynak, UCI ML Repository, 1998,
/// CC BY 4.0): 1,797 rows of 64 pixel counts (0..16) and a label.
const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../jobs/data/digits.csv.gz");

pub(crate) fn digits() -> Result<Raw> {
    let text = gunzip_if_needed(DIGITS_CSV_GZ.to_vec(), "bundled digits")?;
    let layout = CsvLayout {
        header: false,
        label: None,
        features: None,
        exclude: &[],
        task: Task::Classification,
        class_names: None,
    };
    let train = parse_csv(&text, "bundled digits", &layout)?.data;
    Ok(Raw {
        sample_shape: vec![1, 8, 8],
        task: Task::Classification,
        train,
        test: None,
        columns: None,
        class_names: None,
    })
}

/// A CSV job's files. `class_names` are the training file's, when it is known already (a
/// trained model's file to evaluate): text labels are read as those classes.
pub(crate) fn csv(spec: &DataSpec, class_names: Option<&[String]>) -> Result<Raw> {
    let path = spec.path.as_deref().expect("validated: csv has a path");
    let task = spec.task();
    let read = |p: &Path, class_names: Option<&[String]>| -> Result<Parsed> {
        let name = p.display().to_string();
        let bytes = read_file(p)?;
        let text = gunzip_if_needed(bytes, &name)?;
        let layout = CsvLayout {
            header: spec.header(),
            label: spec.label.as_ref(),
            features: spec.features.as_deref(),
            exclude: spec.exclude.as_deref().unwrap_or_default(),
            task,
            class_names,
        };
        parse_csv(&text, &name, &layout)
    };
    let train = read(path, class_names)?;
    let columns = train.columns;
    let width = columns.len() - 1;
    let test = match &spec.test_path {
        Some(p) => {
            let test = read(p, train.class_names.as_deref())?;
            let test_width = test.columns.len() - 1;
            if test_width != width {
                return Err(Error::Job(format!(
                    "{}: {test_width} feature columns, but {} has {width}",
                    p.display(),
                    path.display()
                )));
            }
            if spec.header() && test.columns != columns {
                // Read by position, a test file whose columns are in another order (or are
                // other columns) would be evaluated on the wrong features without a word.
                return Err(Error::Job(format!(
                    "{}: its header gives the columns read (features, then the label) as {}, \
                     where {} has {}: the test file needs the same columns in the same order \
                     (or name the columns in data.features and data.label, which are found by \
                     name in each file)",
                    p.display(),
                    columns_list(&test.columns),
                    path.display(),
                    columns_list(&columns)
                )));
            }
            if train.class_names.is_none() && test.class_names.is_some() {
                return Err(Error::Job(format!(
                    "{}: its labels are class names, where {} has class indices",
                    p.display(),
                    path.display()
                )));
            }
            Some(test.data)
        }
        None => None,
    };
    Ok(Raw {
        sample_shape: vec![width],
        task,
        train: train.data,
        test,
        columns: Some(columns),
        class_names: train.class_names,
    })
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        // Where Debian's package puts it, as the bundled Fashion-MNIST jobs expect.
        let hint = match path.starts_with("/usr/share/datasets/fashion-mnist") && !path.exists() {
            true => " (Fashion-MNIST: `apt-get install dataset-fashion-mnist` puts it there)",
            false => "",
        };
        Error::UnreadableData {
            path: path.to_path_buf(),
            message: format!("cannot read data file {}: {e}{hint}", path.display()),
        }
    })
}

/// Decompresses gzip data (recognised by its magic bytes); other data is returned as is.
fn gunzip_if_needed(bytes: Vec<u8>, name: &str) -> Result<Vec<u8>> {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .map_err(|e| Error::Job(format!("{name}: corrupt gzip data: {e}")))?;
        Ok(out)
    } else {
        Ok(bytes)
    }
}

fn columns_list(columns: &[String]) -> String {
    columns
        .iter()
        .map(|c| format!("`{c}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The largest class index: targets are f32, which hold every whole number up to 2^24
/// exactly (a larger label would be read as a neighbouring class).
pub(crate) const MAX_CLASS_INDEX: f64 = 16_777_216.0;

/// How a CSV file is read: which columns, and as what.
struct CsvLayout<'a> {
    header: bool,
    label: Option<&'a Column>,
    features: Option<&'a [Column]>,
    /// Columns that are not features, when `features` is not given.
    exclude: &'a [Column],
    task: Task,
    /// The classes text labels are read as (the training file's), when known.
    class_names: Option<&'a [String]>,
}

/// A CSV file read.
struct Parsed {
    data: Dataset,
    /// The columns read, features then the label (header names, or indices without one).
    columns: Vec<String>,
    /// Classification with text labels: the class names, sorted; a target is an index here.
    class_names: Option<Vec<String>>,
}

/// Parses CSV rows into features and one target per row.
fn parse_csv(text: &[u8], name: &str, layout: &CsvLayout) -> Result<Parsed> {
    let (has_header, label, features, task) =
        (layout.header, layout.label, layout.features, layout.task);
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(has_header)
        // Field counts are checked below, so that a line of spaces can be skipped as a blank
        // one is (pandas does the same).
        .flexible(true)
        .from_reader(text);
    let headers: Vec<String> = if has_header {
        reader
            .headers()
            .map_err(|e| csv_error(name, &e))?
            .iter()
            .map(|h| h.trim().to_string())
            .collect()
    } else {
        Vec::new()
    };
    if !headers.is_empty() && headers.iter().all(|h| h.parse::<f64>().is_ok()) {
        tracing::warn!(
            "{name}: its first line ({}) holds only numbers but is read as the header \
             (data.header = true, the default), so it is not trained on; set data.header = \
             false if it is a data row",
            headers.join(",")
        );
    }
    let mut data = Dataset::default();
    let mut lines = Vec::new();
    let mut columns: Option<(usize, Vec<usize>)> = None;
    let mut first_width = None;
    // Values that parse but are not finite (nan, inf, 1e39 beyond f32): the first one's place.
    let (mut not_finite, mut first_not_finite) = (0usize, None);
    // Line numbers from the records' byte offsets: the reader's own count skips blank lines.
    let (mut counted_to, mut newlines) = (0usize, 0usize);
    let mut first_row = true;
    // Classification: each row's label as written, and its column's name.
    let mut label_texts: Vec<(String, String)> = Vec::new();
    for (row, record) in reader.records().enumerate() {
        let record = record.map_err(|e| csv_error(name, &e))?;
        let line = match record.position() {
            Some(p) => {
                // The position is where the reader began, before the blank lines it skipped.
                let mut at = (p.byte() as usize).min(text.len());
                while at < text.len() && matches!(text[at], b'\n' | b'\r') {
                    at += 1;
                }
                newlines += text[counted_to.min(at)..at]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count();
                counted_to = at;
                newlines + 1
            }
            None => row + 1,
        };
        if record.len() == 1 && record[0].trim().is_empty() {
            continue;
        }
        // Text in the first row of a file read without a header is likely its header.
        let header_hint = match (has_header, std::mem::take(&mut first_row)) {
            (false, true) => "; data.header = false reads the first line as data: is it a header?",
            _ => "",
        };
        let expected = match headers.len() {
            0 => *first_width.get_or_insert(record.len()),
            n => n,
        };
        if record.len() != expected {
            let first = if has_header {
                "the header"
            } else {
                "the first row"
            };
            // A quote never closed swallows the lines after it into one field; a comma at
            // the end of a line adds an empty one.
            let last_empty =
                |r: &csv::StringRecord| r.iter().next_back().map(str::trim) == Some("");
            let quote = if record.iter().any(|f| f.contains('\n')) {
                " (a field runs over several lines: is a quote left open?)"
            } else if record.len() > expected && last_empty(&record) {
                " (does the line end with a comma?)"
            } else if record.len() < expected && headers.last().is_some_and(|h| h.is_empty()) {
                " (does the header end with a comma?)"
            } else {
                ""
            };
            return Err(Error::Job(format!(
                "{name}: line {line}: {} field(s), where {first} has {expected}{quote}",
                record.len()
            )));
        }
        let (label_col, feature_cols) = match &columns {
            Some(c) => c,
            None => columns.insert(resolve_columns(
                name,
                &headers,
                record.len(),
                label,
                features,
                layout.exclude,
            )?),
        };
        let column = |col: usize| {
            headers
                .get(col)
                .map_or(format!("{col}"), |h| format!("{col} (`{h}`)"))
        };
        // An empty field: a missing value, or in the last column a trailing comma on
        // every line (a header that names it `` says so).
        let empty = |col: usize| {
            let trailing = match headers.get(col) {
                Some(h) if h.is_empty() && col + 1 == record.len() => {
                    "; the header's last name is empty too: do the lines end with a comma?"
                }
                None if col + 1 == record.len() => {
                    "; it is the last field: does the line end with a comma?"
                }
                _ => "",
            };
            Error::Job(format!(
                "{name}: line {line}, column {}: empty (a missing value){trailing}",
                column(col)
            ))
        };
        // A column's text, trimmed: never empty, and on one line (every column read is a
        // number, so a line end in it is a quote left open, which swallows the lines after
        // it; on the last line, only the line end).
        let field = |col: usize| -> Result<&str> {
            let text = record.get(col).unwrap_or("");
            if text.contains('\n') {
                return Err(Error::Job(format!(
                    "{name}: line {line}, column {}: the field runs over several lines: is a \
                     quote left open?",
                    column(col)
                )));
            }
            match text.trim() {
                "" => Err(empty(col)),
                text => Ok(text),
            }
        };
        let mut value = |col: usize| -> Result<f32> {
            let field = field(col)?;
            let v = field.parse::<f32>().map_err(|_| {
                Error::Job(format!(
                    "{name}: line {line}, column {}: `{field}` is not a number{header_hint}",
                    column(col)
                ))
            })?;
            if !v.is_finite() {
                not_finite += 1;
                first_not_finite.get_or_insert_with(|| {
                    format!("line {line}, column {}: `{field}`", column(col))
                });
            }
            Ok(v)
        };
        for &c in feature_cols.iter() {
            data.features.push(value(c)?);
        }
        let target = match task {
            Task::Regression => value(*label_col)?,
            // Read once every label is there: they are class indices, or class names.
            Task::Classification => {
                label_texts.push((field(*label_col)?.to_string(), column(*label_col)));
                0.0
            }
        };
        data.targets.push(target);
        data.len += 1;
        lines.push(line as u64);
    }
    let Some((label_col, feature_cols)) = columns else {
        return Err(Error::Job(format!("{name}: no data rows")));
    };
    let read: Vec<String> = feature_cols
        .iter()
        .chain([&label_col])
        .map(|&c| headers.get(c).cloned().unwrap_or_else(|| c.to_string()))
        .collect();
    if let Some(first) = first_not_finite {
        tracing::warn!(
            "{name}: {not_finite} value{}, the first at {first}; the \
             steps that read {} have an infinite or NaN loss (train.on_nonfinite = \"skip\" \
             skips them)",
            if not_finite == 1 {
                " is not a finite number"
            } else {
                "s are not finite numbers"
            },
            if not_finite == 1 { "it" } else { "them" },
        );
    }
    let class_names = match task {
        Task::Classification => {
            let (targets, names) = class_labels(name, &label_texts, &lines, layout)?;
            data.targets = targets;
            names
        }
        Task::Regression => None,
    };
    data.origin = Origin::file(name, Some(lines));
    Ok(Parsed {
        data,
        columns: read,
        class_names,
    })
}

/// The targets of classification labels (as written, with their column's name) on `lines`:
/// class indices, or, when a label is not a number or the classes are named already, each
/// label's place among the class names (sorted), which are returned too.
fn class_labels(
    name: &str,
    labels: &[(String, String)],
    lines: &[u64],
    layout: &CsvLayout,
) -> Result<(Vec<f32>, Option<Vec<String>>)> {
    let numbers = labels.iter().all(|(t, _)| t.parse::<f64>().is_ok());
    if numbers && layout.class_names.is_none() {
        let mut targets = Vec::with_capacity(labels.len());
        for ((text, column), line) in labels.iter().zip(lines) {
            // Checked as written: as an f32, 2.00000001 would pass for class 2.
            match text.parse::<f64>() {
                Ok(v) if v >= 0.0 && v.fract() == 0.0 && v <= MAX_CLASS_INDEX => {
                    targets.push(v as f32)
                }
                _ => {
                    // A number that is no class (1.5, -3) suggests real-valued targets. Or
                    // the label is another column than the default, the last.
                    let hint = match layout.label {
                        None => {
                            "; for real-valued targets set data.task = \"regression\"; or is \
                             the label another column (data.label; the default is the last)?"
                        }
                        Some(_) => "; for real-valued targets set data.task = \"regression\"",
                    };
                    return Err(Error::Job(format!(
                        "{name}: line {line}, column {column}: label `{text}` is not a class \
                         index (a whole number from 0 to {MAX_CLASS_INDEX}){hint}"
                    )));
                }
            }
        }
        return Ok((targets, None));
    }
    let names: Vec<String> = match layout.class_names {
        Some(names) => names.to_vec(),
        None => {
            let mut names: Vec<String> = labels.iter().map(|(t, _)| t.clone()).collect();
            names.sort_unstable();
            names.dedup();
            names
        }
    };
    let index: HashMap<&str, usize> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let mut targets = Vec::with_capacity(labels.len());
    for ((text, column), line) in labels.iter().zip(lines) {
        let Some(&i) = index.get(text.as_str()) else {
            return Err(Error::Job(format!(
                "{name}: line {line}, column {column}: label `{text}` is not one of the \
                 training data's classes ({})",
                names.join(", ")
            )));
        };
        targets.push(i as f32);
    }
    Ok((targets, Some(names)))
}

/// A CSV reader's error in the file's terms: the line, and what is wrong there.
fn csv_error(name: &str, e: &csv::Error) -> Error {
    let why = match e.kind() {
        csv::ErrorKind::Utf8 { pos, .. } => {
            let line = pos
                .as_ref()
                .map_or(String::new(), |p| format!("line {}: ", p.line()));
            format!("{line}not UTF-8 text")
        }
        _ => e.to_string(),
    };
    Error::Job(format!("{name}: {why}"))
}

fn resolve_columns(
    name: &str,
    headers: &[String],
    width: usize,
    label: Option<&Column>,
    features: Option<&[Column]>,
    exclude: &[Column],
) -> Result<(usize, Vec<usize>)> {
    // Columns by header name, built once: a wide file (a bag of words) has as many names as
    // columns, and looking each named feature up by a scan would be quadratic.
    let mut by_name: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, h) in headers.iter().enumerate() {
        by_name.entry(h.as_str()).or_default().push(i);
    }
    let find = |c: &Column| -> Result<usize> {
        match c {
            Column::Index(i) if *i < width => Ok(*i),
            Column::Index(i) => Err(Error::Job(format!(
                "{name}: column index {i} does not exist (the file has {width} columns, 0..{})",
                width.saturating_sub(1)
            ))),
            Column::Name(n) => match by_name.get(n.as_str()).map(Vec::as_slice) {
                Some([i]) => Ok(*i),
                Some(at) => {
                    let at: Vec<String> = at.iter().map(usize::to_string).collect();
                    Err(Error::Job(format!(
                        "{name}: the header names columns {} `{n}`: give the column by index",
                        at.join(" and ")
                    )))
                }
                None => Err(Error::Job(format!(
                    "{name}: no column named `{n}`{}",
                    if headers.is_empty() {
                        " (the file has no header: give column indices, or set data.header = true)"
                            .to_string()
                    } else {
                        format!("; columns: {}", headers.join(", "))
                    }
                ))),
            },
        }
    };
    let label = match label {
        Some(c) => find(c)?,
        None => width
            .checked_sub(1)
            .ok_or_else(|| Error::Job(format!("{name}: empty rows")))?,
    };
    let excluded = exclude.iter().map(find).collect::<Result<Vec<_>>>()?;
    let features = match features {
        Some(cols) => cols.iter().map(find).collect::<Result<Vec<_>>>()?,
        None => (0..width)
            .filter(|&c| c != label && !excluded.contains(&c))
            .collect(),
    };
    if features.is_empty() {
        return Err(Error::Job(format!(
            "{name}: no feature columns besides the label"
        )));
    }
    let column = |c: usize| headers.get(c).map_or(format!("{c}"), |h| format!("`{h}`"));
    if features.contains(&label) {
        // The model would read the answer it is asked for.
        return Err(Error::Job(format!(
            "{name}: data.features: column {} is the label (data.label); a feature cannot be the \
             label",
            column(label)
        )));
    }
    let mut first_at: HashMap<usize, usize> = HashMap::with_capacity(features.len());
    for (i, &c) in features.iter().enumerate() {
        if let Some(first) = first_at.insert(c, i) {
            return Err(Error::Job(format!(
                "{name}: data.features: column {} is listed twice (at {first} and {i})",
                column(c),
            )));
        }
    }
    Ok((label, features))
}

pub(crate) fn idx(spec: &DataSpec) -> Result<Raw> {
    let pair = |images: &Path, labels: &Path| -> Result<(Dataset, Vec<usize>)> {
        let (shape, pixels) = read_idx(images, 3)?;
        if shape.contains(&0) {
            return Err(Error::Job(format!(
                "{}: the IDX header says {} images of {}x{} pixels: a data set needs at least \
                 one image of at least 1x1",
                images.display(),
                shape[0],
                shape[1],
                shape[2]
            )));
        }
        let (label_shape, labels_u8) = read_idx(labels, 1)?;
        if label_shape[0] != shape[0] {
            return Err(Error::Job(format!(
                "{} holds {} labels but {} holds {} images",
                labels.display(),
                label_shape[0],
                images.display(),
                shape[0]
            )));
        }
        let data = Dataset {
            features: pixels.iter().map(|&p| p as f32).collect(),
            targets: labels_u8.iter().map(|&l| l as f32).collect(),
            origin: Origin {
                features: images.display().to_string(),
                labels: labels.display().to_string(),
                ..Origin::default()
            },
            len: shape[0],
            ..Dataset::default()
        };
        Ok((data, shape))
    };
    let train_images = spec.train_images.as_deref().expect("validated");
    let (train, shape) = pair(
        train_images,
        spec.train_labels.as_deref().expect("validated"),
    )?;
    let test = match (&spec.test_images, &spec.test_labels) {
        (Some(i), Some(l)) => {
            let (test, test_shape) = pair(i, l)?;
            if test_shape[1..] != shape[1..] {
                return Err(Error::Job(format!(
                    "{}: images are {}x{} but the training images are {}x{}",
                    i.display(),
                    test_shape[1],
                    test_shape[2],
                    shape[1],
                    shape[2]
                )));
            }
            Some(test)
        }
        _ => None,
    };
    Ok(Raw {
        sample_shape: vec![1, shape[1], shape[2]],
        task: Task::Classification,
        train,
        test,
        columns: None,
        class_names: None,
    })
}

/// IDX images (3 dimensions of unsigned bytes) as [count, 1, rows, columns] and their
/// pixels; None where the file is not IDX (its magic number), for inputs that may be CSV.
pub(crate) fn idx_images(path: &Path) -> Result<Option<(Vec<usize>, Vec<f32>)>> {
    let name = path.display().to_string();
    let bytes = gunzip_if_needed(read_file(path)?, &name)?;
    if !bytes.starts_with(&[0, 0, 8, 3]) {
        return Ok(None);
    }
    let (shape, pixels) = read_idx(path, 3)?;
    let features = pixels.iter().map(|&p| p as f32).collect();
    Ok(Some((vec![shape[0], 1, shape[1], shape[2]], features)))
}

/// A file's bytes, unpacked when it is gzip.
pub(crate) fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    gunzip_if_needed(read_file(path)?, &path.display().to_string())
}

pub(crate) fn read_text(path: &Path) -> Result<String> {
    let name = path.display().to_string();
    let bytes = read_bytes(path)?;
    String::from_utf8(bytes).map_err(|e| {
        Error::Job(format!(
            "{name}: not UTF-8 text (byte {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Reads an IDX file of unsigned bytes with `dims` dimensions (big-endian header: magic
/// 0x0000_08_DD, then one u32 per dimension, then the data).
fn read_idx(path: &Path, dims: usize) -> Result<(Vec<usize>, Vec<u8>)> {
    let name = path.display().to_string();
    let bytes = gunzip_if_needed(read_file(path)?, &name)?;
    let header_len = 4 + 4 * dims;
    if bytes.len() < header_len {
        return Err(Error::Job(format!(
            "{name}: truncated IDX file: {} bytes, the header alone needs {header_len}",
            bytes.len()
        )));
    }
    let word = |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    let magic = word(0);
    let expected = 0x0800 | dims as u32;
    if magic != expected {
        return Err(Error::Job(format!(
            "{name}: not an IDX file of unsigned bytes with {dims} dimension(s): magic number \
             0x{magic:08x} at offset 0, expected 0x{expected:08x}"
        )));
    }
    let shape: Vec<usize> = (0..dims).map(|d| word(4 + 4 * d) as usize).collect();
    let have = bytes.len() - header_len;
    let Some(need) = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) else {
        return Err(Error::Job(format!(
            "{name}: the IDX header's dimensions {shape:?} promise more data than any file \
             holds; the file has {have} bytes after the header"
        )));
    };
    if have != need {
        return Err(Error::Job(format!(
            "{name}: {} IDX file: the header ({shape:?}) promises {need} bytes of data after \
             offset {header_len}, the file has {have}",
            if have < need {
                "truncated"
            } else {
                "oversized"
            }
        )));
    }
    Ok((shape, bytes[header_len..].to_vec()))
}

/// Seeded generated data: Gaussian blobs around random class centres (classification), or
/// a random linear map plus noise (regression).
pub(crate) fn synthetic(spec: &DataSpec, seed: u64) -> Raw {
    let task = spec.task();
    let (n, width, noise) = (spec.samples(), spec.num_features(), spec.noise());
    let mut rng = Rng::new(derive(seed, 13));
    let mut data = Dataset {
        len: n,
        origin: Origin::file("synthetic data", None),
        ..Default::default()
    };
    match task {
        Task::Classification => {
            let classes = spec.synthetic_classes();
            let centres: Vec<f64> = (0..classes * width).map(|_| 2.0 * rng.normal()).collect();
            for i in 0..n {
                let c = i % classes;
                for j in 0..width {
                    data.features
                        .push((centres[c * width + j] + noise * rng.normal()) as f32);
                }
                data.targets.push(c as f32);
            }
        }
        Task::Regression => {
            let targets = spec.targets();
            let scale = 1.0 / (width as f64).sqrt();
            let weights: Vec<f64> = (0..targets * width).map(|_| scale * rng.normal()).collect();
            for _ in 0..n {
                let x: Vec<f64> = (0..width).map(|_| rng.normal()).collect();
                data.features.extend(x.iter().map(|&v| v as f32));
                for t in 0..targets {
                    let y: f64 = (0..width).map(|j| weights[t * width + j] * x[j]).sum();
                    data.targets.push((y + noise * rng.normal()) as f32);
                }
            }
        }
    }
    Raw {
        sample_shape: vec![width],
        task,
        train: data,
        test: None,
        columns: None,
        class_names: None,
    }
}
