//! Building the image layers: shape inference and parameter layout for conv2d, pooling,
//! layer norm and reshape. Errors name the layer, its input shape and what it needs.

use super::{numel, reserve, shape_str, values, Op, MAX_SAMPLE_VALUES};
use crate::error::{layer_error, Result};
use crate::spec::{BatchNormSpec, Conv2dSpec, LayerNormSpec, PoolSpec, ReshapeSpec};
use crate::tensor::{Conv2d, Pool2d, PoolKind};

/// The [channels, height, width] of an image layer's input.
fn chw(i: usize, kind: &str, in_shape: &[usize]) -> Result<(usize, usize, usize)> {
    match *in_shape {
        [c, h, w] => Ok((c, h, w)),
        _ => Err(layer_error(
            i,
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

pub(super) fn conv2d(
    i: usize,
    l: &Conv2dSpec,
    in_shape: &[usize],
    offset: &mut usize,
) -> Result<(Op, Vec<usize>)> {
    let (c, h, w) = chw(i, "conv2d", in_shape)?;
    let err = |m: String| Err(layer_error(i, "conv2d", m));
    if let Some(given) = l.in_channels {
        if given != c {
            return err(format!(
                "in = {given} given, but its input has {c} channels"
            ));
        }
    }
    if l.groups == 0 || c % l.groups != 0 || !l.out.is_multiple_of(l.groups) {
        return err(format!(
            "groups = {} must divide both the input channels ({c}) and out ({})",
            l.groups, l.out
        ));
    }
    let (kh, kw) = l.kernel_size.pair();
    let geom = Conv2d {
        c,
        h,
        w,
        o: l.out,
        kh,
        kw,
        stride: l.stride.pair(),
        pad: l.padding.pair(),
        dil: l.dilation.pair(),
        groups: l.groups,
    };
    let Some((oh, ow)) = geom.out_hw() else {
        return err(format!(
            "a {kh}x{kw} kernel (dilation {:?}) does not fit the {h}x{w} input with padding {:?}",
            geom.dil, geom.pad
        ));
    };
    // One sample's unrolled input (im2col): this also bounds the weight's length.
    let unrolled = values(&[c, kh, kw, oh, ow]);
    if unrolled > MAX_SAMPLE_VALUES {
        return err(format!(
            "its unrolled input holds {unrolled} values per sample ({c} channels x a {kh}x{kw} \
             kernel x {oh}x{ow} outputs); at most {MAX_SAMPLE_VALUES} are allowed"
        ));
    }
    let weight = reserve(offset, geom.weight_len());
    let bias = l.bias.then(|| reserve(offset, l.out));
    Ok((Op::Conv2d { geom, weight, bias }, vec![l.out, oh, ow]))
}

pub(super) fn pool(
    i: usize,
    kind: PoolKind,
    l: &PoolSpec,
    in_shape: &[usize],
) -> Result<(Op, Vec<usize>)> {
    let name = if kind == PoolKind::Max {
        "maxpool2d"
    } else {
        "avgpool2d"
    };
    let (c, h, w) = chw(i, name, in_shape)?;
    let k = l.kernel_size.pair();
    let pad = l.padding.pair();
    if pad.0 * 2 > k.0 || pad.1 * 2 > k.1 {
        return Err(layer_error(
            i,
            name,
            format!("padding {pad:?} must be at most half the kernel {k:?} (as in PyTorch)"),
        ));
    }
    let geom = Pool2d {
        c,
        h,
        w,
        k,
        stride: l.stride().pair(),
        pad,
    };
    match geom.out_hw() {
        Some((oh, ow)) if oh > 0 && ow > 0 && geom.stride.0 > 0 && geom.stride.1 > 0 => {
            Ok((Op::Pool { kind, geom }, vec![c, oh, ow]))
        }
        _ => Err(layer_error(
            i,
            name,
            format!("a {}x{} window does not fit the {h}x{w} input", k.0, k.1),
        )),
    }
}

/// AdaptiveAvgPool2d(1): an average pool whose window is the whole plane.
pub(super) fn global_avg_pool(i: usize, in_shape: &[usize]) -> Result<(Op, Vec<usize>)> {
    let (c, h, w) = chw(i, "global_avg_pool", in_shape)?;
    let geom = Pool2d {
        c,
        h,
        w,
        k: (h, w),
        stride: (h, w),
        pad: (0, 0),
    };
    Ok((
        Op::Pool {
            kind: PoolKind::Avg,
            geom,
        },
        vec![c, 1, 1],
    ))
}

/// Over the last dimension; γ then β in the flat buffer.
pub(super) fn layernorm(
    l: &LayerNormSpec,
    in_shape: &[usize],
    offset: &mut usize,
) -> (Op, Vec<usize>) {
    let width = *in_shape.last().unwrap_or(&1);
    let gamma = reserve(offset, 2 * width);
    (
        Op::LayerNorm {
            width,
            gamma,
            eps: l.eps as f32,
        },
        in_shape.to_vec(),
    )
}

pub(super) fn reshape(i: usize, l: &ReshapeSpec, in_shape: &[usize]) -> Result<(Op, Vec<usize>)> {
    let total = numel(in_shape);
    let err = || {
        Err(layer_error(
            i,
            "reshape",
            format!(
                "shape {:?} cannot hold the {total} values of its input {} \
             (at most one -1, every other entry at least 1)",
                l.shape,
                shape_str(in_shape)
            ),
        ))
    };
    let inferred = l.shape.iter().filter(|&&d| d == -1).count();
    if inferred > 1 || l.shape.iter().any(|&d| d == 0 || d < -1) || l.shape.is_empty() {
        return err();
    }
    let known: Vec<usize> = l
        .shape
        .iter()
        .filter(|&&d| d > 0)
        .map(|&d| d as usize)
        .collect();
    // More than the input holds (as u128: no overflow) never fits.
    let known = match values(&known) {
        n if n > total as u128 => return err(),
        n => n as usize,
    };
    if (inferred == 0 && known != total) || (inferred == 1 && !total.is_multiple_of(known)) {
        return err();
    }
    let shape = l
        .shape
        .iter()
        .map(|&d| if d == -1 { total / known } else { d as usize })
        .collect();
    Ok((Op::View, shape))
}

/// batchnorm1d over [features] (or [channels, length]) samples, batchnorm2d over [channels,
/// height, width]; γ then β in the flat buffer.
pub(super) fn batchnorm(
    i: usize,
    image: bool,
    l: &BatchNormSpec,
    in_shape: &[usize],
    offset: &mut usize,
) -> Result<(Op, Vec<usize>)> {
    let (channels, spatial) = match (image, in_shape) {
        (true, _) => {
            let (c, h, w) = chw(i, "batchnorm2d", in_shape)?;
            (c, h * w)
        }
        (false, [f]) => (*f, 1),
        (false, [c, l]) => (*c, *l),
        (false, _) => {
            return Err(layer_error(
                i,
                "batchnorm1d",
                format!(
                    "its input has shape {} but batchnorm1d needs \
                 [features] or [channels, length] per sample (batchnorm2d is for images)",
                    shape_str(in_shape)
                ),
            ))
        }
    };
    let gamma = reserve(offset, 2 * channels);
    let op = Op::BatchNorm {
        channels,
        spatial,
        gamma,
        eps: l.eps as f32,
        momentum: l.momentum as f32,
    };
    Ok((op, in_shape.to_vec()))
}

/// Joins the inputs along the first per-sample dimension; the others must agree.
pub(super) fn concat(i: usize, in_shapes: &[&[usize]]) -> Result<(Op, Vec<usize>)> {
    let first = in_shapes[0];
    for s in &in_shapes[1..] {
        let how = if s.len() != first.len() {
            "have different numbers of dimensions; concat joins inputs of the same rank (a \
             flatten or reshape first makes them so)"
        } else if s[1..] != first[1..] {
            "differ in more than their first dimension, the one concat joins"
        } else {
            continue;
        };
        return Err(layer_error(
            i,
            "concat",
            format!("its inputs {} and {} {how}", shape_str(first), shape_str(s)),
        ));
    }
    let mut out = first.to_vec();
    out[0] = in_shapes.iter().map(|s| s[0]).sum();
    let widths = in_shapes.iter().map(|s| numel(s)).collect();
    Ok((Op::Concat { widths }, out))
}

#[cfg(test)]
mod tests {
    use super::concat;

    #[test]
    fn concat_joins_the_first_dimension_and_names_what_else_differs() {
        let (_, out) = concat(3, &[&[2, 4, 4], &[5, 4, 4]]).unwrap();
        assert_eq!(out, [7, 4, 4]);
        let e = concat(3, &[&[2, 4, 4], &[2, 4, 5]])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("differ in more than their first dimension"),
            "{e}"
        );
        let e = concat(3, &[&[3, 1, 1], &[3]]).unwrap_err().to_string();
        assert!(e.contains("have different numbers of dimensions"), "{e}");
    }
}
