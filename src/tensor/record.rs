//! Recording a sequence of ops once and replaying it (CUDA graphs): one launch instead of
//! one per op. A recording holds device addresses and by-value arguments, so it stands for
//! the ops only while everything they were recorded with is the same: the caller names that
//! as a key, and a new key records again. The three latest recordings are kept: a step's
//! micro-batches come in up to three kinds with gradient accumulation (the first writes the
//! weight gradients, the others add to them; with data parallelism only the last averages
//! them), and the step replays each.

/// Recording the ops a device runs, to replay them: the part of a `Backend` that
/// `Recorder` drives.
pub trait Capture {
    /// A recorded sequence of ops that `replay` runs again (CUDA graphs).
    type Graph;
    /// Whether `begin_capture` can record at all (logs say "CUDA graphs" only where it can).
    const RECORDS: bool = false;

    /// Starts recording the ops that follow instead of running them; false when this device
    /// cannot record (then nothing changed). Recording assumes the ops allocate nothing and
    /// read nothing from the host: the caller runs them once unrecorded first.
    fn begin_capture(&self) -> bool {
        false
    }
    /// Ends the recording begun by `begin_capture`: the graph, or None when recording failed
    /// (then the recorded ops did not run, and the caller runs them unrecorded).
    fn end_capture(&self) -> Option<Self::Graph> {
        None
    }
    /// Runs a recorded graph again: the same ops on the same buffers, with the values the
    /// buffers hold now.
    fn replay(&self, _graph: &Self::Graph) {}
    /// Frees a graph that is no longer needed, after any replay of it still queued.
    fn release(&self, graph: Self::Graph) {
        drop(graph);
    }
}

/// Recordings kept per recorder.
const KEPT: usize = 3;

pub struct Recorder<B: Capture, K> {
    enabled: bool,
    /// The latest keys that ran unrecorded (at most `KEPT`, oldest first). Recording waits
    /// for a second run with a key, so that whatever the first allocated lazily (scratch,
    /// cuBLAS's state) exists already; keeping more than the last one lets keys that
    /// alternate (A, B, A, B) be recorded too.
    warm: Vec<K>,
    /// The latest recordings, oldest first (at most `KEPT`).
    recorded: Vec<(K, B::Graph)>,
    /// How many recordings were made.
    recordings: u64,
}

impl<B: Capture, K: PartialEq + Copy> Recorder<B, K> {
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
            warm: Vec::new(),
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
    /// them (the second run in a row with this key), or runs them. A replay runs no host
    /// code of `ops`, and a failed recording runs it twice: whatever the host decides
    /// belongs in `key` and outside `ops`. A failed recording turns
    /// recording off (the device said why), and the ops run.
    pub fn run(&mut self, backend: &B, key: K, mut ops: impl FnMut()) {
        if !self.enabled {
            return ops();
        }
        if let Some((_, graph)) = self.recorded.iter().find(|(k, _)| *k == key) {
            return backend.replay(graph);
        }
        if self.warm.contains(&key) {
            if self.recorded.len() == KEPT {
                let (_, oldest) = self.recorded.remove(0);
                backend.release(oldest);
            }
            if backend.begin_capture() {
                ops();
                match backend.end_capture() {
                    Some(graph) => {
                        backend.replay(&graph);
                        self.warm.retain(|k| *k != key);
                        self.recorded.push((key, graph));
                        self.recordings += 1;
                        return;
                    }
                    // The recorded ops did not run.
                    None => self.enabled = false,
                }
            }
        }
        if !self.warm.contains(&key) {
            if self.warm.len() == KEPT {
                self.warm.remove(0);
            }
            self.warm.push(key);
        }
        ops();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A device that records: what ran, as the ops' names, "replay N" for recording N.
    #[derive(Default)]
    struct Device {
        log: RefCell<Vec<String>>,
        capturing: RefCell<Option<Vec<String>>>,
        graphs: RefCell<usize>,
    }

    impl Capture for Device {
        type Graph = usize;
        const RECORDS: bool = true;
        fn begin_capture(&self) -> bool {
            *self.capturing.borrow_mut() = Some(Vec::new());
            true
        }
        fn end_capture(&self) -> Option<usize> {
            self.capturing.borrow_mut().take();
            *self.graphs.borrow_mut() += 1;
            Some(*self.graphs.borrow())
        }
        fn replay(&self, graph: &usize) {
            self.log.borrow_mut().push(format!("replay {graph}"));
        }
    }

    impl Device {
        fn op(&self, name: &str) {
            match self.capturing.borrow_mut().as_mut() {
                Some(recording) => recording.push(name.into()),
                None => self.log.borrow_mut().push(name.into()),
            }
        }
    }

    /// Runs `keys` in order, each as an op named after it; returns what the device ran.
    fn run(keys: &[char]) -> Vec<String> {
        let device = Device::default();
        let mut recorder: Recorder<Device, char> = Recorder::new(true);
        for &key in keys {
            recorder.run(&device, key, || device.op(&key.to_string()));
        }
        device.log.take()
    }

    #[test]
    fn a_key_is_recorded_on_its_second_run_and_replayed_after() {
        assert_eq!(run(&['a', 'a', 'a']), ["a", "replay 1", "replay 1"]);
    }

    #[test]
    fn alternating_keys_are_all_recorded() {
        // Gradient accumulation: a step's first micro-batch writes the weight gradients and
        // the others add to them.
        assert_eq!(
            run(&['a', 'b', 'a', 'b', 'a', 'b']),
            ["a", "b", "replay 1", "replay 2", "replay 1", "replay 2"]
        );
        // With data parallelism the last micro-batch also averages the gradients: a step of
        // four micro-batches has three kinds.
        assert_eq!(
            run(&['a', 'b', 'b', 'c', 'a', 'b', 'b', 'c', 'a', 'b', 'b', 'c']),
            [
                "a", "b", "replay 1", "c", "replay 2", "replay 1", "replay 1", "replay 3",
                "replay 2", "replay 1", "replay 1", "replay 3"
            ]
        );
    }

    #[test]
    fn a_fourth_key_takes_the_place_of_the_oldest_recording() {
        assert_eq!(
            run(&['a', 'a', 'b', 'b', 'c', 'c', 'd', 'd', 'c', 'a']),
            ["a", "replay 1", "b", "replay 2", "c", "replay 3", "d", "replay 4", "replay 3", "a"]
        );
    }
}
