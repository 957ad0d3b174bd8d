//! Data parallelism's plumbing: how batches are divided among replicas (`layout`), averaging
//! gradients across replicas (in-process for CPU replicas) and the TCP rendezvous that
//! multi-process runs start with (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun and
//! SLURM set them). The training loop's side of it is `train::replicas`.

mod allreduce;
mod layout;
mod link;
mod rendezvous;

pub use allreduce::CpuAllReduce;
pub use layout::{share, BatchLayout};
pub use link::{Link, Tag};
pub use rendezvous::{connect, exchange, tell_stopped, Rendezvous};
