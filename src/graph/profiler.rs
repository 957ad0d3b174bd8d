//! Profiling: where a training step's time goes, op by op. While a `Profiler` is attached to
//! a network, each layer's forward and backward, the loss, data loading, the all-reduce,
//! clipping and the optimizer update of a profiled step are timed; the device is
//! synchronised around each, so a time is the op's own (on CUDA it includes the op's
//! launches). Without a profiler a step pays one branch per layer. `crate::profile` turns
//! the events into the table, profile.csv and a Chrome trace.

use crate::tensor::Backend;
use std::time::{Duration, Instant};

/// What an event timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Part {
    /// A batch copied into the network's input and targets.
    Data,
    Forward(usize),
    /// A forward pass again in backward (activation checkpointing).
    Recompute(usize),
    Loss,
    Backward(usize),
    /// Gradients averaged over the replicas.
    AllReduce,
    /// The global gradient norm, clipping and unscaling.
    Clip,
    /// The optimizer's update of the parameters.
    Update,
}

/// One timed span, from the profiler's start.
#[derive(Debug, Clone, Copy)]
pub struct Event {
    pub part: Part,
    pub step: u64,
    /// Samples the op ran on (0 where that does not apply).
    pub samples: usize,
    pub start: Duration,
    pub duration: Duration,
}

/// The spans of the profiled steps. Its vectors are reserved up front, so recording
/// allocates nothing in a step.
#[derive(Debug)]
pub struct Profiler {
    origin: Instant,
    step: u64,
    /// Inside a profiled step: spans are recorded.
    in_step: bool,
    pub events: Vec<Event>,
    /// Each profiled step: (step, start, duration).
    pub steps: Vec<(u64, Duration, Duration)>,
}

impl Profiler {
    /// A profiler for about `steps` steps of `events_per_step` events each.
    pub fn new(steps: usize, events_per_step: usize) -> Self {
        Profiler {
            origin: Instant::now(),
            step: 0,
            in_step: false,
            events: Vec::with_capacity(steps * events_per_step),
            steps: Vec::with_capacity(steps),
        }
    }

    /// Now, after the device's queued work.
    fn now<B: Backend>(&self, backend: &B) -> Instant {
        backend.synchronize();
        Instant::now()
    }

    pub fn in_step(&self) -> bool {
        self.in_step
    }

    /// Inside a profiled step: now, after the device's queued work.
    pub fn start<B: Backend>(&self, backend: &B) -> Option<Instant> {
        self.in_step.then(|| self.now(backend))
    }

    /// The span from `start` to now (after the device's work), as `part` on `samples`.
    pub fn record<B: Backend>(&mut self, backend: &B, start: Instant, part: Part, samples: usize) {
        let end = self.now(backend);
        self.events.push(Event {
            part,
            step: self.step,
            samples,
            start: start - self.origin,
            duration: end - start,
        });
    }

    /// Starts step `step`; `finish_step` ends it.
    pub fn start_step<B: Backend>(&mut self, backend: &B, step: u64) -> Instant {
        (self.step, self.in_step) = (step, true);
        self.now(backend)
    }

    pub fn finish_step<B: Backend>(&mut self, backend: &B, start: Instant) {
        let end = self.now(backend);
        self.steps
            .push((self.step, start - self.origin, end - start));
        self.in_step = false;
    }
}
