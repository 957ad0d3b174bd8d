//! The integration tests, one module per area, in one test binary: one link of the crate
//! instead of one per file. `cargo test --test suite cli::` runs one area.
//! Two tests live apart, in binaries of their own: tests/steady_state.rs and
//! tests/activation_checkpointing.rs each count allocations with their own global allocator.

#[path = "../common/mod.rs"]
mod common;

mod casts;
mod checkpoint;
mod cli;
mod cuda_kernels;
mod cuda_parity;
mod data_parallel;
mod docs;
mod gradients;
mod hugging_face;
mod hugging_face_llama;
mod kernels_on_host;
mod layout;
mod mixed_precision;
mod multiprocess;
mod nonfinite;
mod ops;
mod primitives;
mod profile;
mod pytorch_reference;
mod rendezvous;
mod results;
mod spatial;
mod sweep_devices;
mod text;
mod tokens;
mod training;
mod training_reference;
mod weights;
