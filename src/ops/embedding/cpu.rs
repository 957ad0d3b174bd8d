//! embedding on the CPU: rows gathered in parallel, gradients summed in order.

use super::Kernels;
use crate::tensor::cpu::CpuBackend;
use rayon::prelude::*;

impl Kernels for CpuBackend {
    fn embedding_forward(
        &self,
        ids: &Vec<u32>,
        params: &Vec<f32>,
        w: usize,
        y: &mut Vec<f32>,
        count: usize,
        dim: usize,
    ) {
        y[..count * dim]
            .par_chunks_mut(dim)
            .zip(&ids[..count])
            .for_each(|(row, &id)| {
                let at = w + id as usize * dim;
                row.copy_from_slice(&params[at..at + dim]);
            });
    }

    fn embedding_backward(
        &self,
        ids: &Vec<u32>,
        dy: &Vec<f32>,
        grads: &mut Vec<f32>,
        w: usize,
        count: usize,
        dim: usize,
    ) {
        for (g, &id) in dy[..count * dim].chunks_exact(dim).zip(&ids[..count]) {
            let at = w + id as usize * dim;
            grads[at..at + dim]
                .iter_mut()
                .zip(g)
                .for_each(|(d, g)| *d += g);
        }
    }
}
