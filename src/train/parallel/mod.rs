//! Data parallelism, all of it:
//! - `layout`: how batches are divided among replicas.
//! - `replicas`: the training loop's side; threaded CPU replicas in lockstep.
//! - `allreduce`: averaging gradients across threaded replicas.
//! - `rendezvous` and `link`: the TCP meeting and messages of multi-process runs (RANK,
//!   WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun and SLURM set them).
//! - `processes`: ranks in several processes or machines, driven by rank 0.
//! - `launch`: `trainer run` starting one process per replica (one per GPU).

mod allreduce;
pub mod launch;
mod layout;
mod link;
pub(crate) mod processes;
mod rendezvous;
pub(crate) mod replicas;

pub use allreduce::CpuAllReduce;
pub use layout::{share, BatchLayout};
pub use link::{Link, Tag};
pub use rendezvous::{connect, exchange, tell_stopped, Rendezvous};
