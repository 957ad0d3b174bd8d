//! Profiling: where a training step's time goes, op by op. While a `Profiler` is attached to
//! a network, each layer's forward and backward, the loss, data loading, the all-reduce,
//! clipping and the optimizer update of a profiled step are timed by marks placed in the
//! device's queue (CUDA events on a GPU, instants on the CPU): the device is waited for once,
//! at the step's end, so an op's time is its own device time and the host keeps queueing
//! ahead as in an unprofiled step. Without a profiler a step pays one branch per layer.
//! `crate::profile` turns the timings into the table, profile.csv and a Chrome trace.

use crate::error::Result;
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

/// The profiled steps' spans, read off the device.
#[derive(Debug, Default)]
pub struct Timings {
    pub events: Vec<Event>,
    /// Each profiled step: (step, start, duration).
    pub steps: Vec<(u64, Duration, Duration)>,
}

/// A span of the step under way, between two of its marks.
#[derive(Debug, Clone, Copy)]
struct Span {
    part: Part,
    samples: usize,
    from: usize,
    to: usize,
}

/// Times the profiled steps. Its marks and vectors are made up front and reused, so timing
/// allocates nothing in a step (unless a step places more marks than planned).
pub struct Profiler<B: Backend> {
    origin: Instant,
    step: u64,
    /// Inside a profiled step: spans are timed.
    in_step: bool,
    /// When the step under way started, from `origin` (the device idle then).
    step_start: Duration,
    /// Marks in the device's queue; the first is the step's start.
    marks: Vec<B::Mark>,
    /// Marks placed in the step under way.
    placed: usize,
    spans: Vec<Span>,
    /// A mark that could not be made: the profile fails with it at the step's end.
    failed: Option<crate::error::Error>,
    pub timings: Timings,
}

impl<B: Backend> Profiler<B> {
    /// A profiler for about `steps` steps of `events_per_step` events each.
    pub fn new(backend: &B, steps: usize, events_per_step: usize) -> Result<Self> {
        let marks = (0..2 * events_per_step + 2)
            .map(|_| backend.new_mark())
            .collect::<Result<Vec<_>>>()?;
        Ok(Profiler {
            origin: Instant::now(),
            step: 0,
            in_step: false,
            step_start: Duration::ZERO,
            marks,
            placed: 0,
            spans: Vec::with_capacity(events_per_step),
            failed: None,
            timings: Timings {
                events: Vec::with_capacity(steps * events_per_step),
                steps: Vec::with_capacity(steps),
            },
        })
    }

    pub fn in_step(&self) -> bool {
        self.in_step
    }

    /// Places the next mark after the device's queued work; its index, or None when no mark
    /// could be made.
    fn place(&mut self, backend: &B) -> Option<usize> {
        if self.placed == self.marks.len() {
            match backend.new_mark() {
                Ok(mark) => self.marks.push(mark),
                Err(e) => {
                    self.failed.get_or_insert(e);
                    return None;
                }
            }
        }
        backend.set_mark(&mut self.marks[self.placed]);
        self.placed += 1;
        Some(self.placed - 1)
    }

    /// Inside a profiled step: a span starts here (`record` ends it).
    pub fn start(&mut self, backend: &B) -> Option<usize> {
        if !self.in_step {
            return None;
        }
        self.place(backend)
    }

    /// The span from `start`'s mark to here is `part` on `samples`.
    pub fn record(&mut self, backend: &B, from: usize, part: Part, samples: usize) {
        if let Some(to) = self.place(backend) {
            self.spans.push(Span {
                part,
                samples,
                from,
                to,
            });
        }
    }

    /// Starts step `step` once the device has done the work queued before it; `finish_step`
    /// ends it.
    pub fn start_step(&mut self, backend: &B, step: u64) {
        (self.step, self.in_step, self.placed) = (step, true, 0);
        self.spans.clear();
        backend.synchronize();
        self.step_start = self.origin.elapsed();
        self.place(backend);
    }

    /// Ends the step: waits for the device and reads its marks.
    pub fn finish_step(&mut self, backend: &B) -> Result<()> {
        self.in_step = false;
        let end = self.place(backend);
        backend.synchronize();
        backend.status()?;
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let (Some(end), first) = (end, &self.marks[0]) else {
            return Ok(());
        };
        let since_start = |m: usize| self.step_start + backend.between(first, &self.marks[m]);
        for s in &self.spans {
            self.timings.events.push(Event {
                part: s.part,
                step: self.step,
                samples: s.samples,
                start: since_start(s.from),
                duration: backend.between(&self.marks[s.from], &self.marks[s.to]),
            });
        }
        let duration = backend.between(first, &self.marks[end]);
        (self.timings.steps).push((self.step, self.step_start, duration));
        Ok(())
    }
}
