//! Layer norm's CPU kernels at jobs/gpt_char.toml's shape (768 rows of 128): the fastest of
//! 15 rounds of 50 calls, forward and backward.
//!
//!   cargo run --release --example layernorm_rows -- [threads]

use trainer::ops::layernorm::cpu::{layernorm_backward, layernorm_forward};

fn main() {
    let threads = std::env::args()
        .nth(1)
        .map_or(2, |a| a.parse().expect("a thread count"));
    let (rows, width) = (768usize, 128usize);
    let values = |k: usize| -> Vec<f32> {
        (0..rows * width)
            .map(|i| ((i * k) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    };
    let (x, dy, gamma) = (values(7919), values(104_729), vec![1.1f32; width]);
    let mut y = vec![0.0; rows * width];
    let (mut mean, mut invstd) = (vec![0.0; rows], vec![0.0; rows]);
    let (mut dx, mut dgamma) = (vec![0.0; rows * width], vec![0.0; width]);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let ms = |f: &mut dyn FnMut()| {
        let start = std::time::Instant::now();
        for _ in 0..50 {
            f();
        }
        start.elapsed().as_secs_f64() / 50.0 * 1e3
    };
    let (mut forward, mut backward) = (f64::MAX, f64::MAX);
    pool.install(|| {
        for _ in 0..15 {
            let stats = (&mut mean[..], &mut invstd[..]);
            forward = forward.min(ms(&mut || {
                layernorm_forward(
                    &x,
                    &mut y,
                    rows,
                    width,
                    &gamma,
                    None,
                    (stats.0, stats.1),
                    1e-5,
                )
            }));
            backward = backward.min(ms(&mut || {
                let stats = (&mean[..], &invstd[..]);
                layernorm_backward(
                    &x,
                    &dy,
                    Some(&mut dx),
                    rows,
                    width,
                    &gamma,
                    stats,
                    (&mut dgamma, None),
                )
            }));
        }
    });
    println!("{threads} threads: forward {forward:.3} ms, backward {backward:.3} ms");
}
