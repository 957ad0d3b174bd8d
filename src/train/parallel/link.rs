//! A TCP connection between two ranks of a multi-process run, carrying framed messages: a
//! tag byte, the payload's length (u64, little-endian), the payload. Reads and writes wait
//! at most the run's timeout (parallel.timeout), and every failure names the other rank, so
//! a rank that dies or hangs makes its peers fail with a clear error instead of waiting
//! forever. Numbers travel little-endian (the byte order of every machine this runs on).

use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tag {
    /// Rank 0 → rank: the job, to compare with the rank's own (JSON).
    Job = 1,
    /// Rank → rank 0: the job is the same; ready to train.
    Ready,
    /// Rank 0 → rank: parameters and optimizer state to start from.
    State,
    /// Rank 0 → rank: compute one optimizer step.
    Step,
    /// Rank → rank 0: its stop request and loss statistics for a step (after its buckets).
    Grads,
    /// Rank 0 → rank: the averaged gradients.
    Mean,
    /// Rank 0 → rank: send a hash of your parameters.
    Verify,
    /// Rank → rank 0: the hash.
    Hash,
    /// Rank 0 → rank: the run is over (JSON: how it ended).
    Done,
    /// Either way: the sender failed; the payload is an exit code (1 byte) and the reason.
    Failed,
    /// Rank → rank 0: a bucket of its gradients, sent as soon as its backward pass has it.
    Bucket,
}

impl Tag {
    fn from_byte(b: u8) -> Option<Tag> {
        use Tag::*;
        [
            Job, Ready, State, Step, Grads, Mean, Verify, Hash, Done, Failed, Bucket,
        ]
        .into_iter()
        .find(|t| *t as u8 == b)
    }
}

pub struct Link {
    stream: TcpStream,
    /// This process's rank and the other end's.
    me: usize,
    peer: usize,
    timeout: Duration,
}

impl Link {
    pub fn new(stream: TcpStream, me: usize, peer: usize, timeout: Duration) -> Result<Link> {
        let link = Link {
            stream,
            me,
            peer,
            timeout,
        };
        // Steps exchange small messages back and forth: Nagle's delay would cost every one.
        let setup = link
            .stream
            .set_nodelay(true)
            .and_then(|()| link.stream.set_read_timeout(Some(timeout)))
            .and_then(|()| link.stream.set_write_timeout(Some(timeout)));
        setup.map_err(|e| link.lost(e))?;
        Ok(link)
    }

    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Sends one message whose payload is `parts`, concatenated.
    pub fn send(&mut self, tag: Tag, parts: &[&[u8]]) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mut header = [0u8; 9];
        header[0] = tag as u8;
        header[1..].copy_from_slice(&(len as u64).to_le_bytes());
        let mut write = || -> std::io::Result<()> {
            self.stream.write_all(&header)?;
            for part in parts {
                self.stream.write_all(part)?;
            }
            Ok(())
        };
        write().map_err(|e| self.lost(e))
    }

    /// Tells the other end that this process failed, and why (best effort: it may be gone).
    pub fn send_failure(&mut self, error: &Error) {
        let text = error.to_string();
        let _ = self.send(Tag::Failed, &[&[error.exit_code() as u8], text.as_bytes()]);
    }

    /// Waits for the next message, which must be `expected`; returns its payload length (the
    /// payload is then read with `read`/`read_vec`). A `Failed` message becomes the peer's
    /// error.
    pub fn expect(&mut self, expected: Tag) -> Result<usize> {
        let (tag, len) = self.receive()?;
        if tag == expected {
            return Ok(len);
        }
        if tag == Tag::Failed {
            let payload = self.read_vec(len)?;
            let why = String::from_utf8_lossy(payload.get(1..).unwrap_or_default());
            let message = format!("rank {} failed: {why}", self.peer);
            return Err(match payload.first() {
                Some(2) => Error::Job(message),
                _ => Error::Runtime(message),
            });
        }
        Err(Error::Runtime(format!(
            "rank {}: rank {} sent {tag:?} where {expected:?} was due (a different trainer \
             version?)",
            self.me, self.peer
        )))
    }

    /// The next message's tag and payload length, whatever it is.
    pub fn receive(&mut self) -> Result<(Tag, usize)> {
        let mut header = [0u8; 9];
        self.read(&mut header)?;
        let tag = Tag::from_byte(header[0]).ok_or_else(|| {
            Error::Runtime(format!(
                "rank {}: rank {} sent an unknown message ({}); is it another trainer version?",
                self.me, self.peer, header[0]
            ))
        })?;
        let len = u64::from_le_bytes(header[1..].try_into().expect("8 bytes")) as usize;
        Ok((tag, len))
    }

    pub fn read(&mut self, buf: &mut [u8]) -> Result<()> {
        self.stream.read_exact(buf).map_err(|e| self.lost(e))
    }

    pub fn read_vec(&mut self, len: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.read(&mut buf)?;
        Ok(buf)
    }

    /// Reads exactly `len` payload bytes into `values` (len must be 4 x values.len()).
    pub fn read_f32s(&mut self, values: &mut [f32], len: usize) -> Result<()> {
        if len != 4 * values.len() {
            return Err(Error::Runtime(format!(
                "rank {}: rank {} sent {len} bytes where {} values were due",
                self.me,
                self.peer,
                values.len()
            )));
        }
        self.read(bytemuck::cast_slice_mut(values))
    }

    fn lost(&self, e: std::io::Error) -> Error {
        let (me, peer) = (self.me, self.peer);
        Error::Runtime(match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                "rank {me}: rank {peer} did not answer within {:?} (parallel.timeout): it is \
                 hung, or its machine is unreachable",
                self.timeout
            ),
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe => format!(
                "rank {me}: lost rank {peer}: its connection closed (the process exited or was \
                 killed; its own log says why)"
            ),
            _ => format!("rank {me}: lost rank {peer}: {e}"),
        })
    }
}
