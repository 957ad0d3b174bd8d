//! Data parallelism's plumbing: averaging gradients across replicas (in-process for CPU
//! replicas) and the TCP rendezvous that multi-process runs start with (RANK, WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT as torchrun and SLURM set them).

mod allreduce;
mod rendezvous;

pub use allreduce::CpuAllReduce;
pub use rendezvous::{exchange, Rendezvous};
