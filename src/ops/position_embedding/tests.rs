//! position_embedding's tests. The library does not compile this file: tests/suite/ops.rs
//! does, so that its CUDA tests run on the emulated GPU with the rest.

use crate::common::{random_vec, spec};
use crate::cuda_parity::{
    assert_close, assert_within, down, gpu, poisoned_in, stored, tolerance, up, up_in, STORAGES,
};
use crate::gradients::{check_gradients, sequence_job, sequences};
use trainer::graph::Graph;
use trainer::ops::position_embedding::Kernels;
use trainer::tensor::cpu::CpuBackend;

#[test]
fn position_embedding_adds_a_row_per_position() {
    let b = CpuBackend::new(1);
    let (n, len) = (3, 8);
    let (x, table) = (random_vec(n * len, 1), random_vec(20, 2));
    let mut y = vec![f32::NAN; n * len];
    b.position_embedding_forward(&x, &table, 4, &mut y, n, len);
    for i in 0..n * len {
        assert_eq!(y[i], x[i] + table[4 + i % len]);
    }
    let mut grads = vec![1.0; 20];
    b.position_embedding_backward(&x, &mut grads, 4, n, len);
    for j in 0..len {
        let sum: f32 = (0..n).map(|s| x[s * len + j]).sum();
        assert_eq!(grads[4 + j], 1.0 + sum);
    }
}

#[test]
fn position_embedding_gradients() {
    check_gradients(
        &sequence_job(r#"{ type = "position_embedding", num_positions = 7 }"#),
        sequences(),
    );
}

#[test]
fn position_embedding_refuses_sequences_longer_than_its_table() {
    let job = spec(&sequence_job(
        r#"{ type = "position_embedding", num_positions = 2 }"#,
    ));
    let e = Graph::build(&job, &sequences()).unwrap_err().to_string();
    assert!(e.contains("3 positions, past num_positions = 2"), "{e}");
}

/// CUDA against the CPU on random inputs, with activations in f32 and in each half format.
#[test]
fn position_embedding_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    let (g, cpu) = (&g, CpuBackend::new(2));
    for storage in STORAGES {
        let (n, len, w) = (5, 96, 3);
        let x = stored(storage, &random_vec(n * len, 3));
        let dy = stored(storage, &random_vec(n * len, 4));
        let params = random_vec(w + 128, 5);
        let mut y = vec![f32::NAN; n * len];
        cpu.position_embedding_forward(&x, &params, w, &mut y, n, len);
        let mut yg = poisoned_in(g, storage, n * len);
        g.position_embedding_forward(&up_in(g, storage, &x), &up(g, &params), w, &mut yg, n, len);
        let at = format!("{storage:?}");
        assert_within(
            &down(g, &yg, n * len),
            &stored(storage, &y),
            tolerance(storage),
            &at,
        );
        let mut grads = random_vec(w + 128, 6);
        let mut gg = up(g, &grads);
        cpu.position_embedding_backward(&dy, &mut grads, w, n, len);
        g.position_embedding_backward(&up_in(g, storage, &dy), &mut gg, w, n, len);
        assert_close(
            &down(g, &gg, w + 128),
            &grads,
            &format!("{at} table gradient"),
        );
    }
}
