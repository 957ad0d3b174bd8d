//! The char GPT's matrix products (jobs/gpt_char.toml: 768 rows of width 128) through the
//! `gemm` crate, in GFLOP/s, on 1 and 2 threads; bench/gpt_gemms_torch.py times the same in
//! PyTorch:
//!
//!     cargo run --release --example gpt_gemms
use std::time::Instant;
use trainer::tensor::matmul::{matmul, Parallelism};

fn main() {
    let rows = 768;
    for (fan_in, fan_out) in [(128, 384), (128, 128), (128, 512), (512, 128)] {
        let x: Vec<f32> = (0..rows * fan_in)
            .map(|i| (i % 7) as f32 * 0.1 - 0.3)
            .collect();
        let w: Vec<f32> = (0..fan_out * fan_in)
            .map(|i| (i % 5) as f32 * 0.1 - 0.2)
            .collect();
        let dy: Vec<f32> = (0..rows * fan_out)
            .map(|i| (i % 3) as f32 * 0.1 - 0.1)
            .collect();
        let mut y = vec![0.0f32; rows * fan_out];
        let mut dx = vec![0.0f32; rows * fan_in];
        let mut dw = vec![0.0f32; fan_out * fan_in];
        let flops = 2.0 * (rows * fan_in * fan_out) as f64;
        for threads in [Parallelism::None, Parallelism::Rayon(2)] {
            let time = |f: &mut dyn FnMut()| {
                let calls = 300;
                (0..20).for_each(|_| f());
                let t = Instant::now();
                (0..calls).for_each(|_| f());
                flops / (t.elapsed().as_secs_f64() / calls as f64) / 1e9
            };
            // y = x·wᵀ; dx = dy·w; dw = dyᵀ·x.
            let fwd = time(&mut || {
                matmul(
                    &mut y,
                    false,
                    &x,
                    (fan_in, 1),
                    &w,
                    (1, fan_in),
                    (rows, fan_out, fan_in),
                    threads,
                )
            });
            let bwd_x = time(&mut || {
                matmul(
                    &mut dx,
                    false,
                    &dy,
                    (fan_out, 1),
                    &w,
                    (fan_in, 1),
                    (rows, fan_in, fan_out),
                    threads,
                )
            });
            let bwd_w = time(&mut || {
                matmul(
                    &mut dw,
                    true,
                    &dy,
                    (1, fan_out),
                    &x,
                    (fan_in, 1),
                    (fan_out, fan_in, rows),
                    threads,
                )
            });
            println!(
                "{fan_in:>4} -> {fan_out:<4} {threads:?}: forward {fwd:.1}, input grad {bwd_x:.1}, weight grad {bwd_w:.1} GFLOP/s"
            );
        }
    }
}
