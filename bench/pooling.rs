//! 2x2 max pooling (src/tensor/spatial.rs) forward and backward in the CNN's shapes, on one
//! thread and on the rayon pool, in GB/s of the buffers each pass must touch:
//!
//!     cargo run --release --example pooling
use std::time::Instant;
use trainer::ops::pool::cpu::{maxpool2d_backward, maxpool2d_forward};
use trainer::tensor::Pool2d;

fn main() {
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let all = rayon::ThreadPoolBuilder::new().build().unwrap();
    // (batch, channels, height, width): jobs/fashion_mnist_cnn.toml's two pooling layers.
    for (n, c, h, w) in [(128, 32, 28, 28), (128, 64, 14, 14)] {
        let s = Pool2d {
            c,
            h,
            w,
            k: (2, 2),
            stride: (2, 2),
            pad: (0, 0),
        };
        let (len, out) = (n * c * h * w, n * c * h * w / 4);
        // Values in a few dozen levels, so that windows hold ties now and then.
        let x: Vec<f32> = (0..len)
            .map(|i| ((i * 7919) % 61) as f32 * 0.1 - 3.0)
            .collect();
        let dy: Vec<f32> = (0..out)
            .map(|i| ((i * 104729) % 53) as f32 * 0.01)
            .collect();
        let (mut y, mut dx) = (vec![0.0f32; out], vec![0.0f32; len]);
        let calls = 200;
        let time = |f: &mut dyn FnMut()| {
            f();
            let t = Instant::now();
            (0..calls).for_each(|_| f());
            t.elapsed().as_secs_f64() / calls as f64
        };
        for (name, pool) in [("1 thread", &one), ("all threads", &all)] {
            let fwd = pool.install(|| time(&mut || maxpool2d_forward(&s, &x, &mut y, n)));
            let bwd = pool
                .install(|| time(&mut || maxpool2d_backward(&s, &x, &y, &dy, &mut dx, n, false)));
            // Bytes each pass must move: forward reads x, writes y; backward reads x, y, dy
            // and writes dx.
            let gbs = |bytes: usize, s: f64| bytes as f64 / s / 1e9;
            println!(
                "[{n}, {c}, {h}, {w}] {name:>11}: forward {:7.1} µs ({:5.1} GB/s), backward {:7.1} µs ({:5.1} GB/s)",
                fwd * 1e6,
                gbs(4 * (len + out), fwd),
                bwd * 1e6,
                gbs(4 * (2 * len + 2 * out), bwd),
            );
        }
    }
}
