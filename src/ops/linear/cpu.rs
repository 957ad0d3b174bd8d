//! linear on the CPU: the bias, then the product through the gemm crate.

use super::super::activation::Kernels as _;
use super::Kernels;
use crate::tensor::cpu::CpuBackend;
use crate::tensor::{Activation, GradWrite};

impl Kernels for CpuBackend {
    fn linear_forward(
        &self,
        x: &Vec<f32>,
        params: &Vec<f32>,
        w: usize,
        b: Option<usize>,
        y: &mut Vec<f32>,
        n: usize,
        inp: usize,
        out: usize,
        then: Option<Activation>,
    ) {
        let values = &mut y[..n * out];
        if let Some(b) = b {
            let bias = &params[b..b + out];
            for row in values.chunks_exact_mut(out) {
                row.copy_from_slice(bias);
            }
        }
        let weight = &params[w..w + out * inp];
        // y[n, out] (+)= x[n, inp] · Wᵀ, Wᵀ[k, j] = W[j·inp + k]
        self.matmul(
            values,
            b.is_some(),
            &x[..n * inp],
            (inp, 1),
            weight,
            (1, inp),
            n,
            out,
            inp,
        );
        if let Some(f) = then {
            self.activation_in_place(f, y, n * out);
        }
    }

    fn linear_backward(
        &self,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        params: &Vec<f32>,
        grads: &mut Vec<f32>,
        dw_write: GradWrite,
        w: usize,
        b: Option<usize>,
        dx: Option<&mut Vec<f32>>,
        n: usize,
        inp: usize,
        out: usize,
    ) {
        let dy = &dy[..n * out];
        // dW[out, inp] (+)= dyᵀ[out, n] · x[n, inp]
        let dw = &mut grads[w..w + out * inp];
        let add = dw_write == GradWrite::Add;
        self.matmul(dw, add, dy, (1, out), &x[..n * inp], (inp, 1), out, inp, n);
        if let Some(b) = b {
            let db = &mut grads[b..b + out];
            if !add {
                db.fill(0.0);
            }
            for row in dy.chunks_exact(out) {
                for (g, d) in db.iter_mut().zip(row) {
                    *g += d;
                }
            }
        }
        if let Some(dx) = dx {
            // dx[n, inp] = dy[n, out] · W[out, inp]
            let weight = &params[w..w + out * inp];
            self.matmul(
                &mut dx[..n * inp],
                false,
                dy,
                (out, 1),
                weight,
                (inp, 1),
                n,
                inp,
                out,
            );
        }
    }
}
