//! rotary on the CPU: a table of each position's cosines and sines, then the turns, split
//! across threads by rows.

use super::{Kernels, Rotation};
use crate::tensor::cpu::CpuBackend;
use rayon::prelude::*;

/// Rows a thread takes at a time.
const ROWS_PER_TASK: usize = 16;

impl Kernels for CpuBackend {
    fn rotary(
        &self,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
        workspace: &mut Vec<f32>,
        n: usize,
        r: &Rotation,
        position: usize,
        inverse: bool,
    ) {
        let table = fill_table(workspace, r, position);
        let len = n * r.len * r.row_len();
        let rows = ROWS_PER_TASK * r.row_len();
        (y[..len].par_chunks_mut(rows).zip(x[..len].par_chunks(rows)))
            .enumerate()
            .for_each(|(task, (y, x))| {
                y.copy_from_slice(x);
                turn_rows(y, table, r, task * ROWS_PER_TASK, inverse);
            });
    }

    fn rotary_in_place(
        &self,
        buf: &mut Vec<f32>,
        workspace: &mut Vec<f32>,
        n: usize,
        r: &Rotation,
        position: usize,
    ) {
        let table = fill_table(workspace, r, position);
        let len = n * r.len * r.row_len();
        (buf[..len].par_chunks_mut(ROWS_PER_TASK * r.row_len()))
            .enumerate()
            .for_each(|(task, rows)| turn_rows(rows, table, r, task * ROWS_PER_TASK, false));
    }
}

/// Cosines then sines, [T, d/2] each, for positions `position` to `position + T − 1`: the
/// angle (position · frequency) in f32 as Hugging Face's, and its cosine and sine.
fn fill_table<'w>(workspace: &'w mut [f32], r: &Rotation, position: usize) -> &'w [f32] {
    let half = r.head_dim / 2;
    let (cos, rest) = workspace.split_at_mut(r.len * half);
    let sin = &mut rest[..r.len * half];
    for i in 0..half {
        let frequency = r.frequency(i);
        for t in 0..r.len {
            let (s, c) = ((position + t) as f32 * frequency).sin_cos();
            (cos[t * half + i], sin[t * half + i]) = (c, s);
        }
    }
    &workspace[..r.table_len()]
}

/// Turns the queries and keys of whole rows in place; `first` is the first row's index in
/// the batch (its position is that modulo T).
fn turn_rows(rows: &mut [f32], table: &[f32], r: &Rotation, first: usize, inverse: bool) {
    let half = r.head_dim / 2;
    let (cos, sin) = table.split_at(r.len * half);
    for (k, row) in rows.chunks_exact_mut(r.row_len()).enumerate() {
        let t = (first + k) % r.len;
        let (cos, sin) = (&cos[t * half..][..half], &sin[t * half..][..half]);
        // The queries and the keys: the row's first heads.
        for head in row[..r.turned_len()].chunks_exact_mut(r.head_dim) {
            let (a, b) = head.split_at_mut(half);
            match inverse {
                false => turn(a, b, cos, sin),
                true => turn_back(a, b, cos, sin),
            }
        }
    }
}

/// (a, b) ← (a·cos − b·sin, b·cos + a·sin): x·cos + rotate_half(x)·sin, in its order of
/// operations, so the bits are PyTorch's for the same cosines and sines.
fn turn(a: &mut [f32], b: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (((a, b), &c), &s) in a.iter_mut().zip(b).zip(cos).zip(sin) {
        (*a, *b) = (*a * c - *b * s, *b * c + *a * s);
    }
}

/// The transpose: (a, b) ← (a·cos + b·sin, b·cos − a·sin), autograd's gradient of `turn`.
fn turn_back(a: &mut [f32], b: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (((a, b), &c), &s) in a.iter_mut().zip(b).zip(cos).zip(sin) {
        (*a, *b) = (*a * c + *b * s, *b * c - *a * s);
    }
}
