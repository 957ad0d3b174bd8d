//! Shapes and the flat parameter buffer's layout, shared by every op's `build`.

use crate::error::{layer_error, Result};

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// A shape's number of values, without overflow for shapes no job may have.
pub fn values(shape: &[usize]) -> u128 {
    shape
        .iter()
        .fold(1, |n: u128, &d| n.saturating_mul(d as u128))
}

pub fn shape_str(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

/// The most values per sample a model's layer outputs may hold together (16 GiB of f32),
/// and a convolution's unrolled input: beyond any model that trains, and small enough that
/// batch × bytes per sample cannot overflow.
pub const MAX_SAMPLE_VALUES: u128 = 1 << 32;

/// Each layer's parameters, and every weight and bias of a linear, conv or embedding layer,
/// start at a multiple of this many values in the flat buffer: 16 bytes in half precision,
/// 32 in f32. cuBLAS uses its vectorised tensor-core kernels, and cuBLASLt's epilogue takes
/// a bias, only at 16-byte aligned addresses; PyTorch's tensors, each an allocation of its
/// own, always are. (A norm layer's β follows its γ directly: its kernels find both from one
/// offset, and read them one value at a time.) The gaps hold zeros that no layer reads;
/// the step's first backward pass zeroes their gradient, so no optimizer moves them.
pub const PARAM_ALIGN: usize = 8;

/// Reserves `len` values of the flat parameter buffer at its next aligned offset.
pub fn reserve(offset: &mut usize, len: usize) -> usize {
    let at = offset.next_multiple_of(PARAM_ALIGN);
    *offset = at + len;
    at
}

/// The [channels, height, width] of an image layer's input.
pub(super) fn chw(key: &str, kind: &str, in_shape: &[usize]) -> Result<(usize, usize, usize)> {
    match *in_shape {
        [c, h, w] => Ok((c, h, w)),
        _ => Err(layer_error(
            key,
            kind,
            format!(
                "its input has shape {} but {kind} needs [channels, height, \
             width] per sample{}",
                shape_str(in_shape),
                if in_shape.len() == 1 {
                    "; flat data can be given a shape with model.input_shape = [c, h, w] or a reshape layer"
                } else {
                    ""
                }
            ),
        )),
    }
}
