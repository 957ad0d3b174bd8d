//! embedding's tests. The library does not compile this file: tests/suite/ops.rs does, so
//! that its CUDA tests run on the emulated GPU with the rest.

use crate::common::random_vec;
use crate::cuda_parity::{assert_bits, down, gpu, poisoned_in, stored, up, up_in, STORAGES};
use crate::gradients::check_gradients_on;
use trainer::graph::DataShape;
use trainer::ops::embedding::Kernels;
use trainer::tensor::cpu::CpuBackend;
use trainer::tensor::Backend;

const CPU: CpuBackend = CpuBackend::new(1);

#[test]
fn embedding_gradients_sum_over_repeated_tokens() {
    let job = r#"
        [data]
        source = "synthetic"
        [model]
        layers = [{ type = "embedding", num_embeddings = 7, embedding_dim = 3 }, { type = "tanh" },
                  { type = "flatten" }, { type = "linear", out = 3 }]
        [optimizer]
        type = "sgd"
        lr = 0.1
        "#;
    let data = DataShape {
        sample_shape: vec![4],
        classes: Some(3),
        classes_from: None,
        target_dim: 1,
    };
    // 5 samples of 4 ids; id 2 appears several times, id 6 never (its gradient stays 0).
    let ids: Vec<f32> = [0, 2, 2, 5, 1, 2, 3, 4, 2, 0, 5, 5, 3, 1, 2, 4, 0, 0, 1, 2]
        .iter()
        .map(|&v| v as f32)
        .collect();
    check_gradients_on(job, data, Some(&ids));
}

/// CUDA against the CPU on random inputs, with activations in f32 and in each half format:
/// the same bits, and the gradient summed in the same order.
#[test]
fn embedding_on_cuda_matches_the_cpu() {
    let Some(g) = gpu() else {
        return;
    };
    let g = &g;
    for storage in STORAGES {
        let at = format!("{storage:?}");
        // embedding: a table of 50 x 24, 300 ids with repeats, forward and the summed backward.
        let (vocab, dim, count) = (50, 24, 300);
        let table = random_vec(7 + vocab * dim, 36);
        let ids: Vec<u32> = (0..count).map(|i| ((i * 37) % vocab) as u32).collect();
        let gpu_ids = g.upload_ids(ids.clone()).unwrap();
        let mut y_cpu = vec![f32::NAN; count * dim];
        CPU.embedding_forward(&ids, &table, 7, &mut y_cpu, count, dim);
        let mut y_gpu = poisoned_in(g, storage, count * dim);
        g.embedding_forward(&gpu_ids, &up(g, &table), 7, &mut y_gpu, count, dim);
        let y_cpu = stored(storage, &y_cpu);
        assert_bits(
            &down(g, &y_gpu, count * dim),
            &y_cpu,
            &format!("{at} embedding forward"),
        );
        let dy = stored(storage, &random_vec(count * dim, 37));
        let mut dw_cpu = random_vec(table.len(), 38);
        let mut dw_gpu = up(g, &dw_cpu);
        CPU.embedding_backward(&ids, &dy, &mut dw_cpu, 7, count, dim);
        g.embedding_backward(
            &gpu_ids,
            &up_in(g, storage, &dy),
            &mut dw_gpu,
            7,
            count,
            dim,
        );
        assert_eq!(
            down(g, &dw_gpu, table.len()),
            dw_cpu,
            "{at} embedding backward (same order)"
        );
    }
}
