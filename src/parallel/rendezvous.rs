//! How the processes of a multi-process run find each other: rank 0 listens on
//! MASTER_ADDR:MASTER_PORT and greets every other rank with a payload (the job to compare, or
//! an NCCL unique id); the others connect and receive it. The connections stay open as the
//! run's links (`connect`). Every wait is bounded: a rank that never comes, or dies, makes
//! the others fail with an error naming it instead of hanging.

use super::link::Link;
use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

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

const MAGIC: &[u8; 8] = b"trainer1";

impl Rendezvous {
    /// From torchrun's / SLURM's variables; None when RANK and WORLD_SIZE are not set, or
    /// describe one process (an ordinary run: srun with one task sets them too, and needs no
    /// MASTER_ADDR).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Option<Result<Rendezvous>> {
        let rank = get("RANK").or_else(|| get("SLURM_PROCID"))?;
        let world = get("WORLD_SIZE").or_else(|| get("SLURM_NTASKS"))?;
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
            if world_size == 0 || rank >= world_size {
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
            let port =
                get("MASTER_PORT").ok_or_else(|| Error::Job("MASTER_PORT is not set".into()))?;
            let mut master_port: u16 = port
                .trim()
                .parse()
                .map_err(|_| Error::Job(format!("MASTER_PORT={port:?} is not a port")))?;
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

/// Rank 0 sends `payload` to every other rank; each rank returns it.
pub fn exchange(r: &Rendezvous, payload: Vec<u8>) -> Result<Vec<u8>> {
    connect(r, payload).map(|(_, payload)| payload)
}

/// Connects the ranks: rank 0 greets each other rank with `payload` as it arrives and gets
/// links to ranks 1.. (in rank order); another rank gets one link, to rank 0, and the payload.
pub fn connect(r: &Rendezvous, payload: Vec<u8>) -> Result<(Vec<Link>, Vec<u8>)> {
    let deadline = Instant::now() + r.timeout;
    let where_ = format!("{}:{}", r.master_addr, r.master_port);
    if r.rank == 0 {
        let listener = TcpListener::bind(&where_)
            .map_err(|e| Error::Runtime(format!("rank 0 cannot listen on {where_}: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Runtime(format!("{where_}: {e}")))?;
        let mut seen = vec![false; r.world_size];
        seen[0] = true;
        let mut links: Vec<Option<Link>> = (0..r.world_size).map(|_| None).collect();
        while seen.iter().any(|s| !s) {
            if Instant::now() > deadline {
                let missing: Vec<String> = (0..r.world_size)
                    .filter(|&i| !seen[i])
                    .map(|i| i.to_string())
                    .collect();
                return Err(Error::Runtime(format!(
                    "rendezvous on {where_}: rank(s) {} did not connect within {:?}",
                    missing.join(", "),
                    r.timeout
                )));
            }
            match listener.accept() {
                Ok((mut stream, peer)) => {
                    stream.set_nonblocking(false).ok();
                    stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
                    let mut hello = [0u8; 12];
                    stream.read_exact(&mut hello).map_err(|e| {
                        Error::Runtime(format!("rendezvous: {peer} sent no greeting: {e}"))
                    })?;
                    let rank =
                        u32::from_be_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
                    if &hello[..8] != MAGIC || rank == 0 || rank >= r.world_size || seen[rank] {
                        return Err(Error::Runtime(format!(
                            "rendezvous: unexpected greeting from {peer} (rank {rank})"
                        )));
                    }
                    seen[rank] = true;
                    let mut msg = (payload.len() as u64).to_be_bytes().to_vec();
                    msg.extend_from_slice(&payload);
                    stream.write_all(&msg).map_err(|e| {
                        Error::Runtime(format!("rendezvous: rank {rank} left: {e}"))
                    })?;
                    links[rank] = Some(Link::new(stream, 0, rank, r.timeout)?);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(Error::Runtime(format!("rendezvous on {where_}: {e}"))),
            }
        }
        return Ok((links.into_iter().flatten().collect(), payload));
    }
    let addr = where_
        .to_socket_addrs()
        .map_err(|e| Error::Job(format!("MASTER_ADDR:MASTER_PORT = {where_}: {e}")))?
        .next()
        .ok_or_else(|| Error::Job(format!("{where_} resolves to no address")))?;
    let mut stream = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(Error::Runtime(format!(
                    "rank {}: rank 0 did not answer on {where_} within {:?}: {e}",
                    r.rank, r.timeout
                )))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).ok();
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(r.rank as u32).to_be_bytes());
    let lost = |e: std::io::Error| {
        Error::Runtime(format!("rank {}: lost rank 0 at {where_}: {e}", r.rank))
    };
    stream.write_all(&hello).map_err(lost)?;
    let mut len = [0u8; 8];
    stream.read_exact(&mut len).map_err(lost)?;
    let mut payload = vec![0u8; u64::from_be_bytes(len) as usize];
    stream.read_exact(&mut payload).map_err(lost)?;
    Ok((vec![Link::new(stream, r.rank, 0, r.timeout)?], payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn at(rank: usize, world_size: usize, port: u16, timeout_ms: u64) -> Rendezvous {
        Rendezvous {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    #[test]
    fn every_rank_receives_rank_zeros_payload() {
        let port = free_port();
        let peers: Vec<_> = (1..3)
            .map(|rank| std::thread::spawn(move || exchange(&at(rank, 3, port, 5000), vec![])))
            .collect();
        let id = b"nccl-unique-id".to_vec();
        assert_eq!(exchange(&at(0, 3, port, 5000), id.clone()).unwrap(), id);
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap(), id);
        }
    }

    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let e = exchange(&at(0, 2, free_port(), 300), b"id".to_vec())
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank(s) 1 did not connect"), "{e}");
        let e = exchange(&at(1, 2, free_port(), 300), vec![])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 0 did not answer"), "{e}");
    }

    #[test]
    fn environment_follows_torchrun_and_slurm_conventions() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(Rendezvous::from_env(env(&[])).is_none());
        // One SLURM task: an ordinary run, without MASTER_ADDR.
        let one_task = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]);
        assert!(Rendezvous::from_env(one_task).is_none());
        let r = Rendezvous::from_env(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((r.rank, r.world_size, r.master_port), (1, 2, 29500));
        let slurm = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "n"),
            ("MASTER_PORT", "1"),
        ]);
        assert_eq!(Rendezvous::from_env(slurm).unwrap().unwrap().local_rank, 1);
        let torchrun = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]);
        let r = Rendezvous::from_env(torchrun).unwrap().unwrap();
        assert_eq!(r.master_port, 29501, "torchrun's own store holds 29500");
        let bad = env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "n"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(Rendezvous::from_env(bad).unwrap().is_err());
    }
}
