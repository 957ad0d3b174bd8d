//! How the processes of a multi-process run find each other: rank 0 listens on
//! MASTER_ADDR:MASTER_PORT and greets every other rank with a payload (the job to compare, or
//! an NCCL unique id); the others connect and receive it. The connections stay open as the
//! run's links (`connect`). Every wait is bounded: a rank that never comes, or dies, makes
//! the others fail with an error naming it instead of hanging.

use super::link::Link;
use crate::error::{Error, Result};
use crate::signals::Stop;
pub use crate::spec::Rendezvous;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Opens every message of the rendezvous both ways, so that anything else listening on (or
/// connecting to) the port is told apart from a rank.
const MAGIC: &[u8; 8] = b"trainer2";
/// A message's kind. A rank's greeting: JOIN (the payload is its rank); rank 0's answer:
/// JOIN (the payload follows). Either way, a process that stopped before training (or rank 0
/// refusing a rank) sends its error: JOB_ERROR (a bad job or launch, exit 2) or
/// RUNTIME_ERROR (exit 1); a rank's error follows its rank.
const JOIN: u8 = 0;
const JOB_ERROR: u8 = 1;
const RUNTIME_ERROR: u8 = 2;
/// Far above any payload (the job as JSON, an NCCL id): a length beyond it is not ours.
const MAX_PAYLOAD: u64 = 256 << 20;
/// How long a process that stopped before the rendezvous stays to tell the others (see
/// `tell_stopped`).
pub const TELL_WINDOW: Duration = Duration::from_secs(5);

/// Set once this process has begun the rendezvous: after that, its links carry a failure.
static BEGUN: AtomicBool = AtomicBool::new(false);

/// Rank 0 sends `payload` to every other rank; each rank returns it.
pub fn exchange(r: &Rendezvous, payload: Vec<u8>) -> Result<Vec<u8>> {
    connect(r, payload).map(|(_, payload)| payload)
}

/// Connects the ranks: rank 0 greets each other rank with `payload` as it arrives and gets
/// links to ranks 1.. (in rank order); another rank gets one link, to rank 0, and the payload.
/// A SIGINT or SIGTERM ends the wait (exit 130 or 143): nothing has trained yet, so there is
/// nothing to checkpoint. The handlers are installed here whatever this process inherited
/// (a shell's background job ignores SIGINT, which then never ended a wait of minutes).
pub fn connect(r: &Rendezvous, payload: Vec<u8>) -> Result<(Vec<Link>, Vec<u8>)> {
    BEGUN.store(true, Ordering::Relaxed);
    let stop = Stop::install()
        .map_err(|e| Error::Runtime(format!("cannot install the SIGINT/SIGTERM handlers: {e}")))?;
    match r.rank {
        0 => accept_ranks(r, payload, &stop),
        _ => join_rank_zero(r, &stop),
    }
}

/// The rendezvous stopped by a signal, if one came.
fn stopped(stop: &Stop, where_: &str) -> Result<()> {
    match stop.requested() {
        Some(signal) => Err(Error::Interrupted {
            signal,
            message: format!(
                "stopped by {} during the rendezvous on {where_}, before training: nothing \
                 to checkpoint",
                crate::signals::name(signal)
            ),
        }),
        None => Ok(()),
    }
}

fn where_(r: &Rendezvous) -> String {
    format!("{}:{}", r.master_addr, r.master_port)
}

fn frame(kind: u8, parts: &[&[u8]]) -> Vec<u8> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut msg = MAGIC.to_vec();
    msg.push(kind);
    msg.extend_from_slice(&(len as u64).to_be_bytes());
    for part in parts {
        msg.extend_from_slice(part);
    }
    msg
}

/// One message; an InvalidData error (holding the first bytes) when what arrived is not a
/// trainer rank's: another program on the port.
fn read_frame(stream: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 17];
    stream.read_exact(&mut head)?;
    let len = u64::from_be_bytes(head[9..17].try_into().unwrap_or_default());
    if &head[..8] != MAGIC || head[8] > RUNTIME_ERROR || len > MAX_PAYLOAD {
        let shown = String::from_utf8_lossy(&head).into_owned();
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, shown));
    }
    let mut bytes = vec![0u8; len as usize];
    stream.read_exact(&mut bytes)?;
    Ok((head[8], bytes))
}

/// A greeting's rank and, for a rank that stopped, its error.
fn greeting(kind: u8, bytes: &[u8]) -> Option<(usize, Option<Error>)> {
    let rank = u32::from_be_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let text = String::from_utf8_lossy(&bytes[4..]).into_owned();
    Some((rank, error_of(kind, text)))
}

fn error_of(kind: u8, text: String) -> Option<Error> {
    match kind {
        JOB_ERROR => Some(Error::Job(text)),
        RUNTIME_ERROR => Some(Error::Runtime(text)),
        _ => None,
    }
}

fn kind_of(error: &Error) -> u8 {
    match error.exit_code() {
        2 => JOB_ERROR,
        _ => RUNTIME_ERROR,
    }
}

/// Rank 0: waits for every other rank, greets it, and returns the links in rank order.
/// A connection that does not greet as a trainer rank (a port scanner, a health check) is
/// ignored; a rank out of range or joining twice is a broken launch (exit 2), and that rank
/// is told why; a rank that stopped before training ends the wait with its error.
fn accept_ranks(r: &Rendezvous, payload: Vec<u8>, stop: &Stop) -> Result<(Vec<Link>, Vec<u8>)> {
    let deadline = Instant::now() + r.timeout;
    let where_ = where_(r);
    let listener = TcpListener::bind(&where_).map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
            " (another job, or an earlier one still ending, holds this port: give every rank \
             another MASTER_PORT)"
        } else {
            ""
        };
        Error::Runtime(format!("rank 0 cannot listen on {where_}: {e}{hint}"))
    })?;
    // Said once the port is this rank's: before, a port in use read as a wait.
    tracing::info!(
        "rank 0 of {}: waiting for the other ranks on {where_}",
        r.world_size
    );
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::Runtime(format!("{where_}: {e}")))?;
    let mut links: Vec<Option<(Link, std::net::SocketAddr)>> =
        (0..r.world_size).map(|_| None).collect();
    while links[1..].iter().any(Option::is_none) {
        stopped(stop, &where_)?;
        if Instant::now() > deadline {
            let missing: Vec<String> = (1..r.world_size)
                .filter(|&i| links[i].is_none())
                .map(|i| i.to_string())
                .collect();
            return Err(Error::Runtime(format!(
                "rendezvous on {where_}: rank(s) {} did not connect within {:?} (a rank that \
                 stopped before training says why in its own output)",
                missing.join(", "),
                r.timeout
            )));
        }
        let Some((mut stream, peer, rank, stopped)) = next_greeting(&listener, &where_)? else {
            continue;
        };
        if let Some(e) = stopped {
            return Err(e);
        }
        let refusal = match links.get(rank) {
            _ if rank == 0 => Some(format!(
                "a second rank 0 joined from {peer}: every process needs its own RANK"
            )),
            None => Some(format!(
                "rank {rank} joined from {peer}, but WORLD_SIZE is {} on rank 0 (ranks 0 to {}): \
                 every process needs the same WORLD_SIZE",
                r.world_size,
                r.world_size - 1
            )),
            Some(Some((_, first))) => Some(format!(
                "rank {rank} joined twice, from {first} and from {peer}: every process needs \
                 its own RANK"
            )),
            Some(None) => None,
        };
        if let Some(why) = refusal {
            let told = format!("rank 0 refused this rank: {why}");
            let _ = stream.write_all(&frame(JOB_ERROR, &[told.as_bytes()]));
            return Err(Error::Job(format!("rendezvous on {where_}: {why}")));
        }
        stream
            .write_all(&frame(JOIN, &[&payload]))
            .map_err(|e| Error::Runtime(format!("rendezvous: rank {rank} left: {e}")))?;
        links[rank] = Some((Link::new(stream, 0, rank, r.timeout)?, peer));
    }
    let links = links.into_iter().flatten().map(|(link, _)| link).collect();
    Ok((links, payload))
}

type Greeted = (TcpStream, std::net::SocketAddr, usize, Option<Error>);

/// The next rank's greeting on `listener`, if one has arrived; None while none has, or for
/// a connection that is not a trainer rank (ignored, with a warning).
fn next_greeting(listener: &TcpListener, where_: &str) -> Result<Option<Greeted>> {
    let (mut stream, peer) = match listener.accept() {
        Ok(accepted) => accepted,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            std::thread::sleep(Duration::from_millis(20));
            return Ok(None);
        }
        Err(e) => return Err(Error::Runtime(format!("rendezvous on {where_}: {e}"))),
    };
    stream.set_nonblocking(false).ok();
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let greeted = read_frame(&mut stream)
        .ok()
        .and_then(|(kind, bytes)| greeting(kind, &bytes));
    match greeted {
        Some((rank, stopped)) => Ok(Some((stream, peer, rank, stopped))),
        None => {
            tracing::warn!(
                "rendezvous on {where_}: ignored a connection from {peer} that is not a \
                 trainer rank"
            );
            Ok(None)
        }
    }
}

/// Another rank: connects to rank 0 (retrying until the timeout: rank 0 may start later),
/// greets it, and reads its answer.
fn join_rank_zero(r: &Rendezvous, stop: &Stop) -> Result<(Vec<Link>, Vec<u8>)> {
    let deadline = Instant::now() + r.timeout;
    let where_ = where_(r);
    // Said once a signal ends the wait (`connect` installed the handlers), as rank 0's
    // "waiting" line is.
    tracing::info!(
        "rank {} of {}: joining rank 0 at {where_}",
        r.rank,
        r.world_size
    );
    let reached = reach_rank_zero(r, deadline, &|| stop.requested().is_some());
    stopped(stop, &where_)?;
    let mut stream = reached.map_err(|e| {
        Error::Runtime(format!(
            "rank {}: rank 0 did not answer on {where_} within {:?}: {e} (rank 0 may have \
             stopped before training, its own output says why; or MASTER_ADDR and MASTER_PORT \
             do not lead to it)",
            r.rank, r.timeout
        ))
    })?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).ok();
    let lost = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::InvalidData => Error::Job(format!(
            "rank {}: {where_} answered, but not as a trainer rank 0 (it sent {:?}); \
             MASTER_ADDR and MASTER_PORT must lead to rank 0",
            r.rank,
            e.to_string()
        )),
        kind => {
            let e = match kind {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    format!("no answer within {:?}", r.timeout)
                }
                std::io::ErrorKind::UnexpectedEof => "it closed the connection".to_string(),
                _ => e.to_string(),
            };
            Error::Runtime(format!(
                "rank {}: lost rank 0 at {where_} during the rendezvous: {e}",
                r.rank
            ))
        }
    };
    let rank = (r.rank as u32).to_be_bytes();
    stream.write_all(&frame(JOIN, &[&rank])).map_err(lost)?;
    // Rank 0 answers once every rank has joined: wait in short steps, for a signal.
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .ok();
    loop {
        stopped(stop, &where_)?;
        match stream.peek(&mut [0u8; 1]) {
            // An answer, or the end of the connection: read_frame tells which.
            Ok(_) => break,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) && Instant::now() < deadline => {}
            Err(e) => return Err(lost(e)),
        }
    }
    stream.set_read_timeout(Some(left)).ok();
    let (kind, bytes) = read_frame(&mut stream).map_err(lost)?;
    let text = || format!("rank {}: {}", r.rank, String::from_utf8_lossy(&bytes));
    if let Some(e) = error_of(kind, text()) {
        return Err(e);
    }
    Ok((vec![Link::new(stream, r.rank, 0, r.timeout)?], bytes))
}

/// A connection to rank 0, retried until `deadline` (rank 0 may start later) or until
/// `give_up` says so.
fn reach_rank_zero(
    r: &Rendezvous,
    deadline: Instant,
    give_up: &dyn Fn() -> bool,
) -> std::io::Result<TcpStream> {
    let where_ = where_(r);
    let addr = where_
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("{where_} resolves to no address")))?;
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() > deadline || give_up() => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// This process stopped on `error` before the rendezvous began: it stays up to TELL_WINDOW
/// (never past `r.timeout`) to tell the ranks that would otherwise wait for it until their
/// timeout. Rank 0 answers each rank that greets it with the error; another rank sends it
/// to rank 0 (both may have stopped: rank 0 then also hears the other's). Best effort,
/// and nothing once the rendezvous has begun (the links carry failures from there).
pub fn tell_stopped(r: &Rendezvous, error: &Error) {
    if BEGUN.swap(true, Ordering::Relaxed) {
        return;
    }
    let deadline = Instant::now() + TELL_WINDOW.min(r.timeout);
    let where_ = where_(r);
    tracing::info!(
        "telling the other ranks at {where_} why this rank stopped (up to {:?})",
        TELL_WINDOW.min(r.timeout)
    );
    if r.rank != 0 {
        let text = format!("rank {} stopped before training: {error}", r.rank);
        let rank = (r.rank as u32).to_be_bytes();
        if let Ok(mut stream) = reach_rank_zero(r, deadline, &|| false) {
            let _ = stream.write_all(&frame(kind_of(error), &[&rank, text.as_bytes()]));
        }
        return;
    }
    let Ok(listener) = TcpListener::bind(&where_) else {
        return;
    };
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    let text = format!("rank 0 stopped before training: {error}");
    let mut told = vec![false; r.world_size];
    told[0] = true;
    while told.iter().any(|t| !t) && Instant::now() < deadline {
        let (mut stream, _, rank, stopped) = match next_greeting(&listener, &where_) {
            Ok(Some(greeted)) => greeted,
            Ok(None) => continue, // it waited a moment itself
            Err(_) => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        if stopped.is_none() {
            let _ = stream.write_all(&frame(kind_of(error), &[text.as_bytes()]));
        }
        if let Some(t) = told.get_mut(rank) {
            *t = true;
        }
    }
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
    fn a_server_that_is_not_rank_zero_is_named_not_trusted() {
        // An HTTP server on the port: its reply read as a length was an 5e18-byte allocation.
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().unwrap().port();
        let http = std::thread::spawn(move || {
            let (mut c, _) = server.accept().unwrap();
            c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
            std::thread::sleep(Duration::from_millis(500));
        });
        let e = exchange(&at(1, 2, port, 3000), vec![]).unwrap_err();
        assert!(matches!(e, Error::Job(_)), "{e}");
        assert!(
            e.to_string()
                .contains("answered, but not as a trainer rank 0 (it sent \"HTTP/1.1 400 Bad"),
            "{e}"
        );
        http.join().unwrap();
    }

    #[test]
    fn a_stray_connection_is_ignored_and_a_rank_joining_twice_is_refused() {
        let port = free_port();
        let rank_zero = std::thread::spawn(move || exchange(&at(0, 3, port, 5000), b"id".to_vec()));
        std::thread::sleep(Duration::from_millis(200));
        // A health check: connects, sends something else, leaves.
        let mut stray = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stray.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        drop(stray);
        let first = std::thread::spawn(move || exchange(&at(1, 3, port, 5000), vec![]));
        std::thread::sleep(Duration::from_millis(300));
        let second = exchange(&at(1, 3, port, 5000), vec![]).unwrap_err();
        assert!(
            second
                .to_string()
                .contains("rank 0 refused this rank: rank 1 joined twice"),
            "{second}"
        );
        let e = rank_zero.join().unwrap().unwrap_err();
        assert!(matches!(e, Error::Job(_)), "{e}");
        assert!(e.to_string().contains("rank 1 joined twice"), "{e}");
        assert!(
            e.to_string().contains("every process needs its own RANK"),
            "{e}"
        );
        assert_eq!(first.join().unwrap().unwrap(), b"id");
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
        // Half of the pair: one process (with a warning), not an error.
        assert!(Rendezvous::from_env(env(&[("RANK", "1")])).is_none());
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
        let no_processes = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "0"),
            ("MASTER_ADDR", "n"),
            ("MASTER_PORT", "1"),
        ]);
        let no_host = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", " "),
            ("MASTER_PORT", "1"),
        ]);
        let e = Rendezvous::from_env(no_host).unwrap().unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR is empty"), "{e}");
        let e = Rendezvous::from_env(no_processes).unwrap().unwrap_err();
        assert!(e
            .to_string()
            .contains("WORLD_SIZE=0: the number of processes must be at least 1"));
        let port_zero = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "n"),
            ("MASTER_PORT", "0"),
        ]);
        assert!(Rendezvous::from_env(port_zero).unwrap().is_err());
        let local = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "n"),
            ("MASTER_PORT", "1"),
        ]);
        let e = Rendezvous::from_env(local)
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("LOCAL_RANK=2 must be below LOCAL_WORLD_SIZE=2"),
            "{e}"
        );
    }
}
