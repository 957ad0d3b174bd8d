//! Recording a sequence of ops once and replaying it (CUDA graphs): one launch instead of
//! one per op. A recording holds device addresses and by-value arguments, so it stands for
//! the ops only while everything they were recorded with is the same: the caller names that
//! as a key, and a new key records again. The two latest recordings are kept: a step whose
//! micro-batches alternate between two kinds (gradient accumulation with data parallelism:
//! only the last micro-batch averages the gradients) replays both.

use super::Backend;

/// Recordings kept per recorder.
const KEPT: usize = 2;

pub struct Recorder<B: Backend, K> {
    enabled: bool,
    /// The last key that ran unrecorded. Recording waits for a second run with it, so that
    /// whatever the first allocated lazily (scratch, cuBLAS's state) exists already.
    warm: Option<K>,
    /// The latest recordings, oldest first (at most `KEPT`).
    recorded: Vec<(K, B::Graph)>,
    /// How many recordings were made.
    recordings: u64,
}

impl<B: Backend, K: PartialEq + Copy> Recorder<B, K> {
    /// A recorder that records when `on` and the device can; else it runs the ops as they come.
    pub fn new(on: bool) -> Self {
        let mut recorder = Self::off();
        if on {
            recorder.enable();
        }
        recorder
    }

    /// A recorder that runs the ops as they come until `enable`d.
    pub fn off() -> Self {
        Recorder {
            enabled: false,
            warm: None,
            recorded: Vec::new(),
            recordings: 0,
        }
    }

    pub fn enable(&mut self) {
        self.enabled = B::RECORDS;
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn recordings(&self) -> u64 {
        self.recordings
    }

    /// Runs `ops`, which must allocate nothing and read nothing back from the device when
    /// run for the second time with a key: replays the recording made for `key`, or records
    /// them (the second run in a row with this key), or runs them. A failed recording turns
    /// recording off (the device said why), and the ops run.
    pub fn run(&mut self, backend: &B, key: K, mut ops: impl FnMut()) {
        if !self.enabled {
            return ops();
        }
        if let Some((_, graph)) = self.recorded.iter().find(|(k, _)| *k == key) {
            return backend.replay(graph);
        }
        if self.warm == Some(key) {
            if self.recorded.len() == KEPT {
                let (_, oldest) = self.recorded.remove(0);
                backend.release(oldest);
            }
            if backend.begin_capture() {
                ops();
                match backend.end_capture() {
                    Some(graph) => {
                        backend.replay(&graph);
                        self.recorded.push((key, graph));
                        self.recordings += 1;
                        return;
                    }
                    // The recorded ops did not run.
                    None => self.enabled = false,
                }
            }
        }
        self.warm = Some(key);
        ops();
    }
}
