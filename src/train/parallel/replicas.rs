//! Data-parallel replicas in the training loop. The loop runs rank 0's replica on its own
//! thread; a `DataParallel` owns the other replicas and runs every optimizer step on all of
//! them in lockstep: each computes the gradients of its share of every micro-batch
//! (`parallel::share`), the gradients are averaged once per step (after the last
//! micro-batch: accumulation steps exchange nothing), and every replica applies the same
//! clipping and update to its own copy of the parameters and optimizer state. So the
//! replicas stay bit-identical, which `verify` checks at the start and the end of a run, and
//! rank 0's parameters are the model: its checkpoints resume on any number of replicas.
//!
//! `CpuReplicas`: replicas are threads of this process, each with its own rayon pool of
//! train.threads / replicas threads, so the engine's parallel work inside a replica stays
//! on that replica's cores. A step forks one job into each other replica's pool while rank
//! 0 computes its own share on the loop's thread; the jobs meet in `CpuAllReduce` (a fixed
//! summation order: the result does not depend on timing) and the step returns when all
//! are done, so control (logging, signals, early stopping, evaluation) needs no
//! coordination: only the loop's thread ever decides anything.

use super::CpuAllReduce;
use crate::error::{Error, Result};
use crate::graph::{GradientSync, Network};
use crate::ops::Engine;
use crate::optim::Optimizer;
use crate::spec::JobSpec;
use crate::tensor::cpu::CpuBackend;
use crate::tensor::{Backend, LossStats};
use crate::train::{
    accumulate_gradients, apply_gradients, Batch, MicroBatches, Rank, StepContext, StepResult,
    StepSettings,
};
use rayon::ThreadPool;

/// What the training loop needs from data parallelism. Rank 0's replica is the loop's own
/// (`net`, `optimizer`, `stats` below); an implementation owns and drives the others.
pub trait DataParallel<B: Engine> {
    /// Replicas, rank 0 included.
    fn replicas(&self) -> usize;

    /// Makes every other replica a copy of rank 0's: parameters and optimizer state (a
    /// fresh start or a checkpoint's).
    fn broadcast(
        &mut self,
        spec: &JobSpec,
        net: &Network<B>,
        optimizer: &Optimizer<B>,
        backend: &B,
    ) -> Result<()>;

    /// One optimizer step on every replica, as `optimizer_step` is on one device (with mixed
    /// precision, all replicas skip a step together). Rank 0's `stats` then hold the
    /// statistics of the whole micro-batches, all replicas summed.
    fn step(
        &mut self,
        cx: StepContext<B>,
        batch: &Batch<B>,
        micro_batches: MicroBatches,
        settings: StepSettings,
    ) -> Result<StepResult>;

    /// An error unless every replica holds `params` (rank 0's), bit for bit.
    fn verify(&mut self, backend: &B, params: &B::Buf) -> Result<()>;

    /// The device as logs and provenance.json name it, e.g. "cpu: 2 replicas x 1 thread".
    fn describe(&self) -> String;

    /// A stop signal another replica received (a process of a multi-process run): the loop
    /// stops as for its own.
    fn stop_requested(&self) -> Option<i32> {
        None
    }

    /// The loop is over without an error (`interrupted`: by this signal); the replicas may
    /// go. Dropped without it, they learn that the run failed.
    fn finish(&mut self, _interrupted: Option<i32>) {}
}

/// A replica's side of `CpuAllReduce`, driven by its backward pass: every replica averages
/// the same bucket at the same point of its backward pass.
struct ThreadSync<'a> {
    all_reduce: &'a CpuAllReduce,
    rank: usize,
}

impl GradientSync<CpuBackend> for ThreadSync<'_> {
    fn ready(&mut self, _: &CpuBackend, grads: &mut Vec<f32>, bucket: std::ops::Range<usize>) {
        self.all_reduce.mean(self.rank, grads, bucket);
    }
}

/// A device-side collective (NCCL) driven by the backward pass: a bucket's all-reduce starts
/// as soon as its gradients are final and overlaps the rest of the pass; the pass ends
/// waiting for them all.
pub(crate) struct DeviceSync;

impl<B: Engine> GradientSync<B> for DeviceSync {
    fn ready(&mut self, backend: &B, grads: &mut B::Buf, bucket: std::ops::Range<usize>) {
        backend.all_reduce_mean_start(grads, bucket);
    }
    fn finished(&mut self, backend: &B, _: &mut B::Buf) {
        backend.all_reduce_wait();
    }
}

/// A replica other than rank 0, on the CPU.
struct CpuReplica {
    backend: CpuBackend,
    net: Network<CpuBackend>,
    optimizer: Optimizer<CpuBackend>,
    stats: LossStats,
}

/// CPU replicas as threads: ranks 1.. each with a pool of `threads` threads (rank 0 runs
/// in the caller's pool, which should have as many).
pub struct CpuReplicas {
    threads: usize,
    /// Pools of ranks 1.., in rank order.
    pools: Vec<ThreadPool>,
    /// Ranks 1.., built by `broadcast`.
    others: Vec<CpuReplica>,
    all_reduce: CpuAllReduce,
}

impl CpuReplicas {
    /// `replicas` replicas (rank 0 included) of `threads` threads each, for a parameter
    /// buffer of `param_len` values.
    pub fn new(replicas: usize, threads: usize, param_len: usize) -> Result<Self> {
        let pools = (1..replicas)
            .map(|rank| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(move |i| format!("replica-{rank}-{i}"))
                    .build()
                    .map_err(|e| {
                        Error::Runtime(format!(
                            "cannot start {threads} CPU threads for replica {rank}: {e}"
                        ))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CpuReplicas {
            threads,
            pools,
            others: Vec::new(),
            all_reduce: CpuAllReduce::new(replicas, param_len),
        })
    }
}

/// Runs `work` for each replica in `others` as a job on its own pool while `lead` runs on
/// this thread; returns `lead`'s result once every job is done.
fn fork_join<R>(
    pools: &[ThreadPool],
    others: &mut [CpuReplica],
    work: &(dyn Fn(usize, &mut CpuReplica) + Sync),
    rank: usize,
    lead: impl FnOnce() -> R,
) -> R {
    match (pools.split_first(), others.split_first_mut()) {
        (Some((pool, pools)), Some((replica, others))) => pool.in_place_scope(|scope| {
            scope.spawn(move |_| work(rank, replica));
            fork_join(pools, others, work, rank + 1, lead)
        }),
        _ => lead(),
    }
}

impl DataParallel<CpuBackend> for CpuReplicas {
    fn replicas(&self) -> usize {
        self.pools.len() + 1
    }

    fn broadcast(
        &mut self,
        spec: &JobSpec,
        net: &Network<CpuBackend>,
        optimizer: &Optimizer<CpuBackend>,
        _: &CpuBackend,
    ) -> Result<()> {
        let n = net.graph.param_len;
        if self.all_reduce.buffer_len() != n {
            return Err(Error::Runtime(format!(
                "data parallelism was set up for {} parameters, the model has {n}",
                self.all_reduce.buffer_len()
            )));
        }
        let state: Vec<(String, Vec<f32>)> = optimizer
            .state()
            .into_iter()
            .map(|(name, values)| (name.to_string(), values.clone()))
            .collect();
        self.others = (1..self.replicas())
            .map(|_| {
                let backend = CpuBackend::new(self.threads);
                let replica_net = crate::train::training_network(
                    &backend,
                    net.graph.clone(),
                    &net.params,
                    net.max_batch(),
                    spec,
                )?;
                let mut replica_optimizer =
                    crate::train::optimizer_for(&backend, spec, &net.graph)?;
                replica_optimizer
                    .restore(&backend, &state, optimizer.steps(), n)
                    .map_err(Error::Runtime)?;
                Ok(CpuReplica {
                    stats: backend.new_stats()?,
                    backend,
                    net: replica_net,
                    optimizer: replica_optimizer,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(())
    }

    fn step(
        &mut self,
        mut cx: StepContext<CpuBackend>,
        batch: &Batch<CpuBackend>,
        micro_batches: MicroBatches,
        settings: StepSettings,
    ) -> Result<StepResult> {
        let replicas = self.replicas();
        let all_reduce = &self.all_reduce;
        let first_micro_step = *cx.micro_step;
        // Only rank 0's gradient norm is logged; clipping needs it on every replica.
        let quiet = StepSettings {
            want_grad_norm: false,
            ..settings
        };
        let other = |rank: usize, r: &mut CpuReplica| {
            let mut micro_step = first_micro_step;
            let place = Rank { rank, replicas };
            let mut sync = ThreadSync { all_reduce, rank };
            let mut theirs = StepContext {
                backend: &r.backend,
                net: &mut r.net,
                optimizer: &mut r.optimizer,
                stats: &mut r.stats,
                micro_step: &mut micro_step,
            };
            let rows = micro_batches.iter();
            let scale = settings.loss_scale;
            accumulate_gradients(&mut theirs, batch, rows, place, scale, Some(&mut sync));
            apply_gradients(&mut theirs, quiet);
        };
        let result = fork_join(&self.pools, &mut self.others, &other, 1, || {
            let place = Rank { rank: 0, replicas };
            let scale = settings.loss_scale;
            let mut sync = ThreadSync {
                all_reduce,
                rank: 0,
            };
            let rows = micro_batches.iter();
            accumulate_gradients(&mut cx, batch, rows, place, scale, Some(&mut sync));
            apply_gradients(&mut cx, settings)
        });
        for r in &mut self.others {
            *cx.stats += r.backend.take_stats(&mut r.stats);
        }
        Ok(result)
    }

    fn verify(&mut self, _: &CpuBackend, params: &Vec<f32>) -> Result<()> {
        for (i, r) in self.others.iter().enumerate() {
            let differ = (r.net.params.iter().zip(params))
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            if differ > 0 {
                return Err(Error::Runtime(format!(
                    "data parallelism: replica {} holds {differ} of {} parameters different \
                     from rank 0's; the replicas no longer train one model",
                    i + 1,
                    r.net.graph.parameter_count()
                )));
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        format!(
            "cpu: {} x {} each",
            plural(self.replicas(), "replica"),
            plural(self.threads, "thread")
        )
    }
}

/// One replica whose gradients still go through the device's collective (NCCL with a
/// 1-rank communicator): `parallel.replicas = 1` on CUDA. The average over one rank changes
/// nothing, so this measures the all-reduce path's own cost and runs NCCL through the whole
/// training path on a machine with one GPU.
pub struct OneDeviceCollective<B: Engine> {
    device: String,
    _backend: std::marker::PhantomData<fn(&B)>,
}

impl<B: Engine> OneDeviceCollective<B> {
    /// Joins a communicator of one rank; an error where the device has none (or NCCL is
    /// missing).
    pub fn new(backend: &B) -> Result<Self> {
        let id = backend.collective_id()?.ok_or_else(|| {
            Error::Job(format!(
                "{} has no device-side collective for parallel.replicas = 1",
                backend.describe()
            ))
        })?;
        backend.join_collective(&id, 0, 1)?;
        Ok(OneDeviceCollective {
            device: backend.describe(),
            _backend: std::marker::PhantomData,
        })
    }
}

impl<B: Engine> DataParallel<B> for OneDeviceCollective<B> {
    fn replicas(&self) -> usize {
        1
    }

    fn broadcast(&mut self, _: &JobSpec, _: &Network<B>, _: &Optimizer<B>, _: &B) -> Result<()> {
        Ok(())
    }

    fn step(
        &mut self,
        mut cx: StepContext<B>,
        batch: &Batch<B>,
        micro_batches: MicroBatches,
        settings: StepSettings,
    ) -> Result<StepResult> {
        let rows = micro_batches.iter();
        let scale = settings.loss_scale;
        let sync = Some(&mut DeviceSync as &mut dyn GradientSync<B>);
        accumulate_gradients(&mut cx, batch, rows, Rank::WHOLE, scale, sync);
        Ok(apply_gradients(&mut cx, settings))
    }

    fn verify(&mut self, _: &B, _: &B::Buf) -> Result<()> {
        Ok(())
    }

    fn describe(&self) -> String {
        format!("{}: 1 replica, gradients through NCCL", self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{DataShape, Graph};

    #[test]
    fn broadcast_copies_rank_zero_and_verify_notices_a_replica_that_drifted() {
        let spec: JobSpec = toml::from_str(
            "[data]\nsource = \"synthetic\"\n[model]\nlayers = [{ type = \"linear\", out = 3 }]\n\
             [optimizer]\ntype = \"adam\"\nlr = 0.1\n",
        )
        .unwrap();
        let shape = DataShape {
            sample_shape: vec![5],
            classes: Some(3),
            classes_from: None,
            target_dim: 1,
        };
        let graph = Graph::build(&spec, &shape).unwrap();
        let backend = CpuBackend::new(1);
        let n = graph.param_len;
        let net = Network::new(&backend, graph.clone(), &graph.init_params(4), 8, 0).unwrap();
        let optimizer = Optimizer::new(&backend, &spec, n).unwrap();
        let mut replicas = CpuReplicas::new(3, 1, n).unwrap();
        assert_eq!(replicas.describe(), "cpu: 3 replicas x 1 thread each");
        replicas
            .broadcast(&spec, &net, &optimizer, &backend)
            .unwrap();
        replicas.verify(&backend, &net.params).unwrap();
        // One bit of one parameter.
        let drifted = &mut replicas.others[1].net.params[2];
        *drifted = f32::from_bits(drifted.to_bits() ^ 1);
        let e = replicas
            .verify(&backend, &net.params)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("replica 2 holds 1 of 18 parameters different"),
            "{e}"
        );
        assert!(CpuReplicas::new(2, 1, n + 1)
            .unwrap()
            .broadcast(&spec, &net, &optimizer, &backend)
            .is_err());
    }
}
