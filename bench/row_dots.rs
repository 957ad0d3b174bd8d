//! The convolution weight gradients' dot products (src/tensor/row_dots.rs) against the
//! `gemm` crate on the same operands, one thread, in the ResNet's and the CNN's shapes:
//!
//!     cargo run --release --example row_dots
use std::time::Instant;
use trainer::ops::conv2d::row_dots::add_row_dots;
use trainer::tensor::matmul::{matmul, Parallelism};

fn main() {
    // (m output channels, n unrolled rows, k output pixels, row stride of the unrolled rows)
    for (m, n, k, ldb) in [
        (32, 3, 784, 900),
        (16, 48, 784, 900),
        (32, 48, 196, 240),
        (32, 96, 196, 240),
        (64, 96, 196, 240),
        (64, 96, 784, 900),
        (64, 144, 196, 240),
    ] {
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
        let b: Vec<f32> = (0..n * ldb).map(|i| (i % 5) as f32 * 0.1 - 0.2).collect();
        let (mut by_gemm, mut by_dots) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
        let calls = 3000;
        let time = |f: &mut dyn FnMut()| {
            let t = Instant::now();
            (0..calls).for_each(|_| f());
            t.elapsed().as_secs_f64() / calls as f64
        };
        let gemm_s = time(&mut || {
            let none = Parallelism::None;
            matmul(
                &mut by_gemm,
                true,
                &a,
                (k, 1),
                &b,
                (1, ldb),
                (m, n, k),
                none,
            );
        });
        let mut available = true;
        let dots_s =
            time(&mut || available = add_row_dots(&mut by_dots, n, &a, k, &b, ldb, (m, n, k)));
        let gflops = |s: f64| 2.0 * (m * n * k) as f64 / s / 1e9;
        if !available {
            println!(
                "{m}x{n}x{k}: gemm {:.1} GFLOP/s; no AVX-512 here, row_dots not used",
                gflops(gemm_s)
            );
            continue;
        }
        let worst = by_gemm
            .iter()
            .zip(&by_dots)
            .map(|(x, y)| (x - y).abs() / x.abs().max(1.0))
            .fold(0.0, f32::max);
        println!(
            "{m}x{n}x{k}: gemm {:.2} us ({:.1} GFLOP/s), row_dots {:.2} us ({:.1} GFLOP/s), {:.2}x; largest relative difference {worst:.1e}",
            gemm_s * 1e6, gflops(gemm_s), dots_s * 1e6, gflops(dots_s), gemm_s / dots_s
        );
    }
}
