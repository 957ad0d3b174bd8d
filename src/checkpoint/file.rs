//! safetensors files written so that a crash never leaves a half-written file under the real
//! name, and read back with an integrity check.
//!
//! Writing: the header is built with the safetensors crate's own types (so the format is
//! theirs), the tensors are streamed from memory without another copy, into `.NAME.tmp`
//! beside the target; then fsync, rename onto the target, and fsync of the directory, so
//! that after a crash at any moment the directory holds either the old file or the new one.
//! The header metadata records the tensor bytes' length, an XXH3-64 checksum over every
//! tensor (name and bytes, in name order), and one over the other metadata entries (a
//! training checkpoint's position and job live there, as JSON: a flipped digit in them would
//! still parse).
//!
//! Reading: the whole file is read, its header parsed and checked against the file's length
//! (a truncated file fails here), and the checksums recomputed when the file has them (files
//! from other tools, e.g. PyTorch's, have none; files from before the metadata checksum have
//! only the tensors').

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;
use xxhash_rust::xxh3::Xxh3;

// Tensor bytes are written and read as the machine's own f32/f64 bytes; safetensors is
// little-endian, as is every platform this project builds for.
const _: () = assert!(cfg!(target_endian = "little"));

/// Metadata keys this module owns.
const CHECKSUM_KEY: &str = "checksum";
const TENSOR_BYTES_KEY: &str = "tensor_bytes";
const METADATA_CHECKSUM_KEY: &str = "metadata_checksum";

/// A tensor to write, borrowed from memory.
pub enum Values<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    I64(&'a [i64]),
}

impl Values<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Values::F32(v) => bytemuck::cast_slice(v),
            Values::F64(v) => bytemuck::cast_slice(v),
            Values::I64(v) => bytemuck::cast_slice(v),
        }
    }
    fn dtype(&self) -> Dtype {
        match self {
            Values::F32(_) => Dtype::F32,
            Values::F64(_) => Dtype::F64,
            Values::I64(_) => Dtype::I64,
        }
    }
}

pub struct TensorOut<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Values<'a>,
}

/// XXH3-64 over named byte strings (each tensor's name and bytes), in name order:
/// independent of where the tensors lie in the file.
fn checksum<'a>(named: impl Iterator<Item = (&'a str, &'a [u8])>) -> String {
    let mut sorted: Vec<_> = named.collect();
    sorted.sort_by_key(|(name, _)| *name);
    let mut h = Xxh3::new();
    for (name, bytes) in sorted {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    format!("xxh3-64:{:016x}", h.digest())
}

/// The checksum of every metadata entry (key and value) but the metadata checksum itself.
fn metadata_checksum<'a>(metadata: impl Iterator<Item = (&'a String, &'a String)>) -> String {
    checksum(
        metadata
            .filter(|(key, _)| *key != METADATA_CHECKSUM_KEY)
            .map(|(k, v)| (k.as_str(), v.as_bytes())),
    )
}

/// Writes `tensors` with `metadata` to `path` crash-safely; returns the file's size.
/// The error is a sentence naming the file.
pub fn write(
    path: &Path,
    tensors: &[TensorOut],
    metadata: BTreeMap<String, String>,
) -> Result<u64, String> {
    let fail =
        |what: &str, e: &dyn std::fmt::Display| format!("cannot {what} {}: {e}", path.display());
    // 8-byte types first, so every tensor stays aligned (as the safetensors crate does).
    let mut order: Vec<&TensorOut> = tensors.iter().collect();
    order.sort_by(|a, b| {
        b.values
            .dtype()
            .cmp(&a.values.dtype())
            .then(a.name.cmp(&b.name))
    });
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0;
    for t in &order {
        let n = t.values.bytes().len();
        infos.push((
            t.name.clone(),
            TensorInfo {
                dtype: t.values.dtype(),
                shape: t.shape.clone(),
                data_offsets: (offset, offset + n),
            },
        ));
        offset += n;
    }
    let mut meta = metadata;
    meta.insert(
        CHECKSUM_KEY.into(),
        checksum(order.iter().map(|t| (t.name.as_str(), t.values.bytes()))),
    );
    meta.insert(TENSOR_BYTES_KEY.into(), offset.to_string());
    let meta_checksum = metadata_checksum(meta.iter());
    meta.insert(METADATA_CHECKSUM_KEY.into(), meta_checksum);
    // The header as a JSON object with sorted keys, so the same tensors give the same bytes
    // (the crate's Metadata keeps its entries in a HashMap's order).
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!(meta));
    for (name, info) in infos {
        let info = serde_json::to_value(info).map_err(|e| fail("describe", &e))?;
        header.insert(name, info);
    }
    let mut header = serde_json::to_vec(&header).map_err(|e| fail("describe", &e))?;
    header.resize(header.len().next_multiple_of(8), b' ');

    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".{name}.tmp"));
    let write = || -> std::io::Result<()> {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        for t in &order {
            out.write_all(t.values.bytes())?;
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, path)?;
        // The rename itself is durable only once the directory is.
        File::open(dir)?.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail("write", &e));
    }
    Ok((8 + header.len() + offset) as u64)
}

/// The format of a file that is not safetensors, by its first bytes, for the formats a
/// model's weights are likely to be in instead.
fn other_format(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [b'P', b'K', 3, 4, ..] => Some("a zip archive (torch.save's format)"),
        // Pickle protocols 2 and above begin with PROTO and an opcode; a safetensors
        // header length of 640 to 1,408 bytes would have a 0 there.
        [0x80, 2..=5, opcode, ..] if *opcode != 0 => {
            Some("a Python pickle (torch.save's legacy format)")
        }
        [0x93, b'N', b'U', b'M', b'P', b'Y', ..] => Some("a NumPy .npy file"),
        [0x89, b'H', b'D', b'F', ..] => Some("an HDF5 file (Keras' format)"),
        _ => None,
    }
}

/// A safetensors file read whole and checked.
pub struct TensorFile {
    bytes: Vec<u8>,
    data_start: usize,
    metadata: Metadata,
}

/// Reads and checks a file; the error says what is wrong (the caller names the file).
pub fn read(path: &Path) -> Result<TensorFile, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&bytes).map_err(|e| match other_format(&bytes) {
            Some(format) => not_safetensors(format),
            None => format!(
                "it is not a complete safetensors file ({} bytes; {e}): truncated or corrupt",
                bytes.len()
            ),
        })?;
    let file = TensorFile {
        data_start: 8 + header_len,
        bytes,
        metadata,
    };
    let meta = file.metadata.metadata().clone().unwrap_or_default();
    if let Some(expected) = meta.get(METADATA_CHECKSUM_KEY) {
        let actual = metadata_checksum(meta.iter());
        if &actual != expected {
            return Err(format!(
                "metadata checksum mismatch (stored {expected}, computed {actual}): the \
                 header is corrupt"
            ));
        }
    }
    if let Some(expected) = meta.get(TENSOR_BYTES_KEY) {
        let have = file.bytes.len() - file.data_start;
        if expected.parse::<usize>().ok() != Some(have) {
            return Err(format!(
                "its header promises {expected} bytes of tensor data but it has {have}: \
                 truncated or corrupt"
            ));
        }
    }
    if let Some(expected) = meta.get(CHECKSUM_KEY) {
        let names: Vec<String> = file.metadata.tensors().into_keys().collect();
        let actual = checksum(
            names
                .iter()
                .map(|n| (n.as_str(), file.raw(n).map_or(&[][..], |(_, _, b)| b))),
        );
        if &actual != expected {
            return Err(format!(
                "checksum mismatch (stored {expected}, computed {actual}): the tensor data \
                 is corrupt"
            ));
        }
    }
    Ok(file)
}

/// The largest header a safetensors file may have (the safetensors crate refuses more).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Each tensor's shape, by name, from the file's header alone: enough to tell whether a file
/// fits a model before reading what may be gigabytes of data. The error says what is wrong.
pub fn tensor_shapes(path: &Path) -> Result<BTreeMap<String, Vec<usize>>, String> {
    let mut f = File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
    let size = f
        .metadata()
        .map_err(|e| format!("cannot read it: {e}"))?
        .len();
    let mut start = Vec::with_capacity(8);
    (&mut f)
        .take(8)
        .read_to_end(&mut start)
        .map_err(|e| format!("cannot read it: {e}"))?;
    let incomplete = |why: String| match other_format(&start) {
        Some(format) => not_safetensors(format),
        None => format!(
            "it is not a complete safetensors file ({size} bytes; {why}): truncated or corrupt"
        ),
    };
    let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
        return Err(incomplete("no header".into()));
    };
    let header_len = u64::from_le_bytes(start);
    // The safetensors crate's own limit: a larger "header" is another format's bytes, and
    // is not worth gigabytes of memory to find out.
    if header_len > size - 8 || header_len > MAX_HEADER_BYTES {
        return Err(incomplete(format!("a header of {header_len} bytes")));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header)
        .map_err(|e| format!("cannot read it: {e}"))?;
    let metadata: Metadata =
        serde_json::from_slice(&header).map_err(|e| incomplete(format!("its header: {e}")))?;
    Ok(metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.shape.clone()))
        .collect())
}

fn not_safetensors(format: &str) -> String {
    format!(
        "it is not a safetensors file but {format} (PyTorch writes safetensors with \
         safetensors.torch.save_file(model.state_dict(), path))"
    )
}

/// Only the header metadata of a file (cheap: the tensors are not read); None when the file
/// cannot be read, has no valid header, or its metadata fails its checksum.
pub fn read_metadata_only(path: &Path) -> Option<HashMap<String, String>> {
    let mut f = File::open(path).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let len = usize::try_from(u64::from_le_bytes(len)).ok()?;
    if len > 100_000_000 {
        return None;
    }
    let mut header = vec![0u8; len];
    f.read_exact(&mut header).ok()?;
    let meta: Metadata = serde_json::from_slice(&header).ok()?;
    let meta = meta.metadata().clone()?;
    match meta.get(METADATA_CHECKSUM_KEY) {
        Some(expected) if *expected != metadata_checksum(meta.iter()) => None,
        _ => Some(meta),
    }
}

/// The values in `bytes`, copied whole (the bytes need not be aligned for `T`).
fn values_from<T: bytemuck::Pod + Default>(bytes: &[u8]) -> Vec<T> {
    let mut values = vec![T::default(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut values).copy_from_slice(bytes);
    values
}

impl TensorFile {
    pub fn metadata(&self) -> HashMap<String, String> {
        self.metadata.metadata().clone().unwrap_or_default()
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.metadata.tensors().into_keys().collect();
        names.sort();
        names
    }

    fn raw(&self, name: &str) -> Option<(Dtype, &[usize], &[u8])> {
        let info = self.metadata.info(name)?;
        let (s, e) = info.data_offsets;
        let data = &self.bytes[self.data_start + s..self.data_start + e];
        Some((info.dtype, &info.shape, data))
    }

    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.raw(name).map(|(_, shape, _)| shape)
    }

    /// A tensor's values as f32, half-precision ones widened exactly (Hugging Face's files
    /// are often F16 or BF16); the error names the tensor and what it holds instead.
    pub fn f32s(&self, name: &str) -> Result<Vec<f32>, String> {
        let widened = |b: &[u8], widen: fn([u8; 2]) -> f32| -> Vec<f32> {
            b.chunks_exact(2).map(|h| widen([h[0], h[1]])).collect()
        };
        match self.raw(name) {
            Some((Dtype::F32, _, b)) => Ok(values_from(b)),
            Some((Dtype::F16, _, b)) => Ok(widened(b, |h| half::f16::from_le_bytes(h).to_f32())),
            Some((Dtype::BF16, _, b)) => Ok(widened(b, |h| half::bf16::from_le_bytes(h).to_f32())),
            Some((dtype, _, _)) => Err(format!(
                "tensor `{name}` is {dtype:?}; F32, F16 and BF16 are read (convert it with \
                 tensor.float() before saving)"
            )),
            None => Err(format!("it has no tensor `{name}`")),
        }
    }

    /// A scalar count such as batch norm's `num_batches_tracked` (PyTorch saves int64).
    pub fn count(&self, name: &str) -> Result<u64, String> {
        let value = match self.raw(name) {
            Some((Dtype::I64, [], b)) => i64::from_le_bytes(b.try_into().unwrap_or_default()),
            Some((Dtype::I32, [], b)) => {
                i64::from(i32::from_le_bytes(b.try_into().unwrap_or_default()))
            }
            Some((dtype, shape, _)) => {
                return Err(format!(
                    "tensor `{name}` is {dtype:?} of shape {shape:?}; a count is an integer \
                     scalar (PyTorch's int64, shape [])"
                ))
            }
            None => return Err(format!("it has no tensor `{name}`")),
        };
        u64::try_from(value)
            .map_err(|_| format!("tensor `{name}` is {value}; a count is at least 0"))
    }

    pub fn f64s(&self, name: &str) -> Result<Vec<f64>, String> {
        match self.raw(name) {
            Some((Dtype::F64, _, b)) => Ok(values_from(b)),
            Some((dtype, _, _)) => Err(format!("tensor `{name}` is {dtype:?}, expected F64")),
            None => Err(format!("it has no tensor `{name}`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensors(values: &[f32]) -> Vec<TensorOut<'_>> {
        vec![TensorOut {
            name: "params".into(),
            shape: vec![values.len()],
            values: Values::F32(values),
        }]
    }

    #[test]
    fn a_file_in_another_weights_format_is_named_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.pt");
        for (start, format) in [
            (
                &b"PK\x03\x04\0\0\x08\0archive/data.pkl"[..],
                "a zip archive",
            ),
            (b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8", "a Python pickle"),
            (
                b"\x93NUMPY\x01\x00v\x00{'descr': '<f4'",
                "a NumPy .npy file",
            ),
        ] {
            std::fs::write(&path, start).unwrap();
            for err in [
                read(&path).err().unwrap(),
                tensor_shapes(&path).unwrap_err(),
            ] {
                assert!(err.contains(format) && err.contains("save_file"), "{err}");
            }
        }
        // A truncated safetensors file is still called one.
        write(&path, &tensors(&[1.0, 2.0]), BTreeMap::new()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..20]).unwrap();
        for err in [
            read(&path).err().unwrap(),
            tensor_shapes(&path).unwrap_err(),
        ] {
            assert!(err.contains("truncated or corrupt"), "{err}");
        }
    }

    /// init_from checks names and shapes before it reads a file's data, which may be large.
    #[test]
    fn shapes_are_read_from_the_header_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.safetensors");
        write(&path, &tensors(&[1.0, 2.0, 3.0]), BTreeMap::new()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let shapes = tensor_shapes(&path).unwrap();
        assert_eq!(shapes, BTreeMap::from([("params".to_string(), vec![3])]));
        assert!(read(&path).is_err(), "the data is cut short");
    }

    /// A large file of another format may begin with what reads as a header length of
    /// gigabytes: it is refused, not allocated.
    #[test]
    fn a_header_beyond_the_safetensors_limit_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weights.bin");
        let f = std::fs::File::create(&path).unwrap();
        (&f).write_all(&150_000_000u64.to_le_bytes()).unwrap();
        f.set_len(200_000_000).unwrap(); // sparse: nothing is written
        let err = tensor_shapes(&path).unwrap_err();
        assert!(
            err.contains("a header of 150000000 bytes") && err.contains("truncated or corrupt"),
            "{err}"
        );
    }

    #[test]
    fn metadata_is_checked_when_the_file_has_its_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.safetensors");
        let meta = BTreeMap::from([("state".to_string(), r#"{"step":30}"#.to_string())]);
        write(&path, &tensors(&[1.0, 2.0]), meta).unwrap();
        assert_eq!(read(&path).unwrap().metadata()["state"], r#"{"step":30}"#);
        assert!(read_metadata_only(&path).is_some());

        // One digit changed, the header still valid JSON of the same length.
        let mut bytes = std::fs::read(&path).unwrap();
        let key = br#"step\":30"#;
        let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
        bytes[at + key.len() - 1] = b'1';
        std::fs::write(&path, bytes).unwrap();
        let err = read(&path).err().unwrap();
        assert!(err.contains("metadata checksum mismatch"), "{err}");
        assert!(read_metadata_only(&path).is_none());
    }

    #[test]
    fn files_without_the_metadata_checksum_are_still_read() {
        // As written before the metadata checksum existed, or by another tool.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.safetensors");
        let values = [1.0f32, 2.0];
        let view = safetensors::tensor::TensorView::new(
            Dtype::F32,
            vec![2],
            bytemuck::cast_slice(&values),
        )
        .unwrap();
        let meta = HashMap::from([("state".to_string(), "{}".to_string())]);
        let bytes = safetensors::serialize([("params", view)], Some(meta)).unwrap();
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(read(&path).unwrap().f32s("params").unwrap(), values);
        assert!(read_metadata_only(&path).is_some());
    }

    /// F16 and BF16 tensors are widened to f32 exactly; other types are named.
    #[test]
    fn half_precision_tensors_are_read_widened() {
        use safetensors::tensor::TensorView;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.safetensors");
        let values = [1.5f32, -0.25, 65504.0, 3.0e-5];
        let f16: Vec<u8> = (values.iter())
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect();
        let bf16: Vec<u8> = (values.iter())
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        let ints = [7u8; 16];
        let views = [
            ("a", TensorView::new(Dtype::F16, vec![4], &f16).unwrap()),
            ("b", TensorView::new(Dtype::BF16, vec![4], &bf16).unwrap()),
            ("c", TensorView::new(Dtype::I32, vec![4], &ints).unwrap()),
        ];
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let file = read(&path).unwrap();
        let want = |to: fn(f32) -> f32| values.map(to).to_vec();
        assert_eq!(
            file.f32s("a").unwrap(),
            want(|v| half::f16::from_f32(v).to_f32())
        );
        assert_eq!(
            file.f32s("b").unwrap(),
            want(|v| half::bf16::from_f32(v).to_f32())
        );
        assert!(file
            .f32s("c")
            .unwrap_err()
            .contains("is I32; F32, F16 and BF16 are read"));
    }
}
