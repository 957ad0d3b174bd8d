//! Recording a sequence of ops once and replaying it (CUDA graphs): one launch instead of
//! one per op. A recording holds device addresses and by-value arguments, so it stands for
//! the ops only while everything they were recorded with is the same: the caller names that
//! as a key, and a new key records again (replacing the old recording).

use super::Backend;

pub struct Recorder<B: Backend, K> {
    enabled: bool,
    /// The last key that ran unrecorded. Recording waits for a second run with it, so that
    /// whatever the first allocated lazily (scratch, cuBLAS's state) exists already.
    warm: Option<K>,
    recording: Option<(K, B::Graph)>,
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
            recording: None,
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
        if let Some((recorded, graph)) = &self.recording {
            if *recorded == key {
                return backend.replay(graph);
            }
        }
        if self.warm == Some(key) {
            if let Some((_, old)) = self.recording.take() {
                backend.release(old);
            }
            if backend.begin_capture() {
                ops();
                match backend.end_capture() {
                    Some(graph) => {
                        backend.replay(&graph);
                        self.recording = Some((key, graph));
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
