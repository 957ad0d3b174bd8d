"""PyTorch DistributedDataParallel on the CPU (gloo), the reference for trainer's
multi-process data parallelism on bench/mlp1024.toml's model.

MLP 784-1024-1024-10, CrossEntropyLoss, Adam(lr=1e-3), synthetic data (51,200 samples,
global batch 256 split equally among the ranks), one epoch = 200 steps after 5 untimed
warm-up steps. Each rank has --threads threads. The timed region is the training steps
(index into the in-memory tensors, forward, loss, backward with DDP's bucketed all-reduce,
optimizer step), ended by a barrier.

  python bench/pytorch_ddp.py --ranks 2 --threads 1

Prints one JSON line: {"framework":"pytorch-ddp","ranks":...,"samples_per_sec":...}
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SAMPLES, FEATURES, CLASSES, BATCH, WARMUP = 51200, 784, 10, 256, 5


def worker(rank, ranks, threads, port, out):
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(FEATURES, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, CLASSES),
    )
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    share = BATCH // ranks
    order = torch.randperm(SAMPLES, generator=g)

    def step(i):
        rows = order[i * BATCH + rank * share: i * BATCH + (rank + 1) * share]
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()

    for i in range(WARMUP):
        step(i)
    dist.barrier()
    steps = SAMPLES // BATCH
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    dist.barrier()
    wall = time.perf_counter() - start
    if rank == 0:
        out.put(steps * BATCH / wall)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=29700)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a.ranks, a.threads, a.port, out))
             for r in range(a.ranks)]
    for proc in procs:
        proc.start()
    rate = out.get()
    for proc in procs:
        proc.join()
    print(json.dumps({"framework": "pytorch-ddp", "ranks": a.ranks, "threads": a.threads,
                      "samples_per_sec": rate}))


if __name__ == "__main__":
    main()
