//! The multi-process rendezvous (parallel::exchange) between real processes on loopback:
//! this test binary runs itself as the other rank (the ignored test `rendezvous_rank`,
//! configured by the variables torchrun sets). A rank that is killed, or a peer that
//! vanishes, makes the others fail with an error naming it, in bounded time; a connection
//! that is not a rank is ignored.

use crate::common;

use common::{free_port, one_at_a_time};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use trainer::train::parallel::{exchange, Rendezvous};

fn at(rank: usize, world_size: usize, port: u16, timeout: Duration) -> Rendezvous {
    Rendezvous {
        rank,
        world_size,
        local_rank: 0,
        local_world_size: 1,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        timeout,
    }
}

/// This test binary as rank `rank` of `world_size`, joining after `delay_ms`; rank 0 hands
/// out `payload`.
fn spawn_rank(rank: usize, world_size: usize, port: u16, delay_ms: u64, payload: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "rendezvous::rendezvous_rank",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TRAINER_TEST_RENDEZVOUS", "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world_size.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TRAINER_TEST_RENDEZVOUS_DELAY_MS", delay_ms.to_string())
        .env("TRAINER_TEST_RENDEZVOUS_PAYLOAD", payload)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for `child` at most `limit` (then kills it and fails); returns (success, stdout,
/// stderr).
fn finish(mut child: Child, limit: Duration) -> (bool, String, String) {
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            panic!("the other rank did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut out).ok();
    child.stderr.take().unwrap().read_to_string(&mut err).ok();
    (status.success(), out, err)
}

/// The other rank, run by `spawn_rank` (ignored in a plain `cargo test`).
#[test]
#[ignore = "the child process of the rendezvous tests"]
fn rendezvous_rank() {
    if std::env::var_os("TRAINER_TEST_RENDEZVOUS").is_none() {
        return;
    }
    let mut r = Rendezvous::from_env(|k| std::env::var(k).ok())
        .expect("RANK and WORLD_SIZE are set")
        .unwrap();
    r.timeout = Duration::from_secs(30);
    let var = |k: &str| std::env::var(k).unwrap();
    std::thread::sleep(Duration::from_millis(
        var("TRAINER_TEST_RENDEZVOUS_DELAY_MS").parse().unwrap(),
    ));
    match exchange(&r, var("TRAINER_TEST_RENDEZVOUS_PAYLOAD").into_bytes()) {
        Ok(payload) => println!("payload={}", String::from_utf8_lossy(&payload)),
        Err(e) => {
            eprintln!("rendezvous error: {e}");
            std::process::exit(3);
        }
    }
}

#[test]
fn two_processes_meet_on_loopback() {
    let _turn = one_at_a_time();
    let port = free_port();
    let child = spawn_rank(1, 2, port, 0, "");
    let r0 = at(0, 2, port, Duration::from_secs(20));
    assert_eq!(exchange(&r0, b"nccl-id".to_vec()).unwrap(), b"nccl-id");
    let (ok, out, err) = finish(child, Duration::from_secs(20));
    assert!(ok && out.contains("payload=nccl-id"), "{out}\n{err}");
}

#[test]
fn a_rank_killed_before_joining_is_named_by_rank_zero_within_its_timeout() {
    let _turn = one_at_a_time();
    let port = free_port();
    let started = Instant::now();
    let waiting =
        std::thread::spawn(move || exchange(&at(0, 2, port, Duration::from_secs(2)), vec![1]));
    let mut late = spawn_rank(1, 2, port, 60_000, "");
    std::thread::sleep(Duration::from_millis(300));
    late.kill().unwrap();
    late.wait().unwrap();
    let e = waiting.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("rank(s) 1 did not connect within 2s"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_killed_rank_zero_fails_the_ranks_that_had_not_joined_within_their_timeout() {
    let _turn = one_at_a_time();
    let port = free_port();
    let mut master = spawn_rank(0, 3, port, 0, "id-from-rank-0");
    // Rank 1 is served: rank 0 is up, and now waits for rank 2.
    let r1 = at(1, 3, port, Duration::from_secs(20));
    assert_eq!(exchange(&r1, vec![]).unwrap(), b"id-from-rank-0");
    master.kill().unwrap();
    master.wait().unwrap();
    let started = Instant::now();
    let e = exchange(&at(2, 3, port, Duration::from_millis(1500)), vec![])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "rank 2: rank 0 did not answer on 127.0.0.1:{port} within 1.5s"
        )),
        "{e}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// A connection that leaves mid-greeting (a port scanner, a health check) is not a rank:
/// rank 0 ignores it and still serves the real rank 1.
#[test]
fn a_peer_that_vanishes_mid_greeting_is_ignored_and_the_real_rank_still_joins() {
    let _turn = one_at_a_time();
    let port = free_port();
    let master = spawn_rank(0, 2, port, 0, "id");
    let started = Instant::now();
    let mut peer = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(e) if started.elapsed() > Duration::from_secs(20) => {
                panic!("rank 0 never listened: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    peer.write_all(b"trai").unwrap();
    drop(peer);
    let r1 = at(1, 2, port, Duration::from_secs(20));
    assert_eq!(exchange(&r1, vec![]).unwrap(), b"id");
    let (ok, out, err) = finish(master, Duration::from_secs(20));
    assert!(ok && out.contains("payload=id"), "{out}\n{err}");
}
