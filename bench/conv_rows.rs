//! A convolution's forward products (src/tensor/conv_rows.rs) against the bias fill and one
//! `gemm` crate product per kernel row that it replaces, one thread, in the ResNet's and the
//! CNN's shapes (and the input gradients', which are convolutions too):
//!
//!     cargo run --release --example conv_rows
use std::time::Instant;
use trainer::ops::conv2d::conv_rows::conv_rows;
use trainer::tensor::matmul::{matmul, Parallelism};

fn main() {
    // (m output channels, n output pixels, k = input channels × kernel width, kernel rows,
    //  row stride of the unrolled input)
    for (m, n, k, rows, ldx) in [
        (32, 784, 3, 3, 900),
        (64, 196, 96, 3, 240),
        (32, 784, 96, 3, 900),
        (16, 784, 48, 3, 900),
        (32, 196, 48, 3, 240),
        (32, 196, 96, 3, 240),
        (16, 784, 96, 3, 900),
        (32, 196, 16, 1, 196),
    ] {
        let starts: Vec<usize> = (0..rows).map(|r| r * 30).collect();
        let x: Vec<f32> = (0..starts[rows - 1] + k * ldx + n)
            .map(|i| (i % 5) as f32 * 0.1 - 0.2)
            .collect();
        let w: Vec<f32> = (0..rows * m * k)
            .map(|i| (i % 7) as f32 * 0.1 - 0.3)
            .collect();
        let bias: Vec<f32> = (0..m).map(|i| i as f32 * 0.01).collect();
        let (mut by_gemm, mut by_rows) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
        let calls = 2000;
        let time = |f: &mut dyn FnMut()| {
            let t = Instant::now();
            (0..calls).for_each(|_| f());
            t.elapsed().as_secs_f64() / calls as f64
        };
        let gemm_s = time(&mut || {
            for (row, plane) in by_gemm.chunks_mut(n).zip(&bias) {
                row.fill(*plane);
            }
            for (r, &start) in starts.iter().enumerate() {
                let (w_r, x_r) = (&w[r * m * k..], &x[start..]);
                let none = Parallelism::None;
                matmul(
                    &mut by_gemm,
                    true,
                    w_r,
                    (k, 1),
                    x_r,
                    (ldx, 1),
                    (m, n, k),
                    none,
                );
            }
        });
        let mut available = true;
        let rows_s = time(&mut || {
            available = conv_rows(
                &mut by_rows,
                n,
                Some(&bias),
                &w,
                &x,
                &starts,
                ldx,
                (m, n, k),
            )
        });
        let gflops = |s: f64| 2.0 * (m * n * k * rows) as f64 / s / 1e9;
        if !available {
            println!(
                "{m}x{n}x{k}x{rows}: gemm {:.1} GFLOP/s; no AVX-512 here",
                gflops(gemm_s)
            );
            continue;
        }
        let worst = by_gemm
            .iter()
            .zip(&by_rows)
            .map(|(a, b)| (a - b).abs() / a.abs().max(1.0))
            .fold(0.0, f32::max);
        println!(
            "{m}x{n}x{k}x{rows}: gemm {:.2} us ({:.1} GFLOP/s), conv_rows {:.2} us ({:.1} GFLOP/s), {:.2}x; largest relative difference {worst:.1e}",
            gemm_s * 1e6, gflops(gemm_s), rows_s * 1e6, gflops(rows_s), gemm_s / rows_s
        );
    }
}
