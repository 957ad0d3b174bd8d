//! Where this process stands in a multi-process run, from torchrun's or SLURM's
//! environment: part of what a run is, resolved beside the job. `train::parallel::rendezvous`
//! connects the ranks.

use crate::error::{Error, Result};
use std::time::Duration;

/// A process's place in a multi-process run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// Processes on this machine (LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE; 1 when unset):
    /// they share its cores.
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub timeout: Duration,
}

impl Rendezvous {
    /// From torchrun's / SLURM's variables; None when RANK and WORLD_SIZE are not set, or
    /// describe one process (an ordinary run: srun with one task sets them too, and needs no
    /// MASTER_ADDR).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Option<Result<Rendezvous>> {
        let rank = get("RANK").or_else(|| get("SLURM_PROCID"));
        let world = get("WORLD_SIZE").or_else(|| get("SLURM_NTASKS"));
        let (rank, world) = match (rank, world) {
            (Some(rank), Some(world)) => (rank, world),
            (None, None) => return None,
            (rank, _) => {
                let (set, unset) = match rank {
                    Some(_) => ("RANK", "WORLD_SIZE"),
                    None => ("WORLD_SIZE", "RANK"),
                };
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| {
                    tracing::warn!(
                        "{set} is set but {unset} is not: this process trains alone (a \
                         multi-process run needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
                    )
                });
                return None;
            }
        };
        let parse = |name: &str, v: &str| -> Result<usize> {
            v.trim()
                .parse()
                .map_err(|_| Error::Job(format!("environment {name}={v:?} is not a number")))
        };
        if (parse("RANK", &rank).ok(), parse("WORLD_SIZE", &world).ok()) == (Some(0), Some(1)) {
            return None;
        }
        Some((|| {
            let rank = parse("RANK", &rank)?;
            let world_size = parse("WORLD_SIZE", &world)?;
            if world_size == 0 {
                return Err(Error::Job(
                    "environment WORLD_SIZE=0: the number of processes must be at least 1"
                        .to_string(),
                ));
            }
            if rank >= world_size {
                return Err(Error::Job(format!(
                    "RANK={rank} must be below WORLD_SIZE={world_size}"
                )));
            }
            let local_rank = get("LOCAL_RANK")
                .or_else(|| get("SLURM_LOCALID"))
                .map_or(Ok(0), |v| parse("LOCAL_RANK", &v))?;
            // SLURM writes e.g. "2(x3)" for 2 tasks on each of 3 nodes.
            let local_world_size = get("LOCAL_WORLD_SIZE")
                .or_else(|| get("SLURM_NTASKS_PER_NODE"))
                .map_or(Ok(1), |v| {
                    let count: String = v.chars().take_while(char::is_ascii_digit).collect();
                    parse("LOCAL_WORLD_SIZE", &count)
                })?
                .max(1);
            let master_addr = get("MASTER_ADDR")
                .ok_or_else(|| Error::Job("MASTER_ADDR is not set (rank 0's host)".into()))?;
            if master_addr.trim().is_empty() {
                return Err(Error::Job(
                    "MASTER_ADDR is empty: it names rank 0's host".into(),
                ));
            }
            let port =
                get("MASTER_PORT").ok_or_else(|| Error::Job("MASTER_PORT is not set".into()))?;
            let mut master_port: u16 =
                port.trim().parse().ok().filter(|&p| p > 0).ok_or_else(|| {
                    Error::Job(format!("MASTER_PORT={port:?} is not a port (1 to 65535)"))
                })?;
            let local_world_given =
                get("LOCAL_WORLD_SIZE").is_some() || get("SLURM_NTASKS_PER_NODE").is_some();
            if local_rank >= local_world_size && local_world_given {
                return Err(Error::Job(format!(
                    "LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_world_size} \
                     (the processes on this machine)"
                )));
            }
            // torchrun's agent keeps its own store listening on MASTER_PORT: meet on the next.
            if get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True") {
                master_port = master_port.checked_add(1).ok_or_else(|| {
                    Error::Job(format!(
                        "MASTER_PORT={port}: under torchrun the ranks meet on MASTER_PORT + 1, \
                         which does not exist"
                    ))
                })?;
            }
            Ok(Rendezvous {
                rank,
                world_size,
                local_rank,
                local_world_size,
                master_addr,
                master_port,
                timeout: Duration::from_secs(300),
            })
        })())
    }
}
