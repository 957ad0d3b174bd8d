"""PyTorch CPU reference benchmark for an MLP classifier.

Measures training throughput (samples/s) of nn.Sequential(Linear, ReLU, ..., Linear)
trained with CrossEntropyLoss and Adam. The timed region covers only the training
steps: per-batch index/gather from the in-memory tensors, forward, loss, backward
and optimizer step. Data loading, preprocessing and evaluation are excluded.

--data fashion:    Fashion-MNIST from IDX .gz files (pixels scaled to [0,1], then
                   standardized per feature with train mean/std; zero std -> 1),
                   shuffled batches (last partial batch kept) for --epochs epochs,
                   then test accuracy after the final epoch.
--data synthetic:  random inputs/labels, 5 untimed warm-up steps, then --steps timed
                   steps; no accuracy.

Prints one final JSON line:
  {"framework":"pytorch","samples_per_sec":...,"test_accuracy":...,"wall_s":...,"threads":...}
"""
import argparse
import gzip
import json
import os
import time

import numpy as np
import torch
from torch import nn

DATA_DIR = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion(data_dir):
    def part(prefix):
        x = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
        y = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
        return x.reshape(len(x), -1).astype(np.float32) / 255.0, y.astype(np.int64)

    xtr, ytr = part("train")
    xte, yte = part("t10k")
    mean = xtr.mean(axis=0)
    std = xtr.std(axis=0)
    std[std < 1e-8] = 1.0
    xtr, xte = (xtr - mean) / std, (xte - mean) / std
    return [torch.from_numpy(a) for a in (xtr, ytr, xte, yte)]


def make_cnn():
    """jobs/fashion_mnist_cnn.toml's model."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Linear(128, 10),
    )


class ResNetSmall(nn.Module):
    """jobs/resnet_small.toml's model."""

    def __init__(self):
        super().__init__()
        bn = nn.BatchNorm2d
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), bn(16), nn.ReLU())
        self.block1 = nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1, bias=False), bn(16), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, bias=False), bn(16))
        self.block2 = nn.Sequential(
            nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), bn(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, bias=False), bn(32))
        self.shortcut = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2, bias=False), bn(32))
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.block1(x) + x)
        x = torch.relu(self.block2(x) + self.shortcut(x))
        return self.fc(x.mean(dim=(2, 3)))


def make_mlp(sizes):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="784,256,128,10")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=100, help="timed steps (synthetic only)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--data", choices=["fashion", "synthetic"], default="fashion")
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (data is moved to it first)")
    p.add_argument("--model", choices=["mlp", "cnn", "resnet"], default="mlp",
                   help="mlp: --layers; cnn: jobs/fashion_mnist_cnn.toml's conv net; resnet: "
                        "jobs/resnet_small.toml's (fashion data)")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="torch.autocast in this half type (fp16 with GradScaler), as "
                        "precision.mode does")
    args = p.parse_args()
    dev = torch.device(args.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    wall0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sizes = [int(s) for s in args.layers.split(",")]
    models = {"cnn": make_cnn, "resnet": ResNetSmall, "mlp": lambda: make_mlp(sizes)}
    model = models[args.model]().to(dev)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    scaler = torch.amp.GradScaler(dev.type, enabled=args.amp == "fp16")

    def step(xb, yb):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=half or torch.float32, enabled=half is not None):
            loss = loss_fn(model(xb), yb)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    acc = None
    train_s, samples = 0.0, 0
    if args.data == "fashion":
        xtr, ytr, xte, yte = (t.to(dev) for t in load_fashion(args.data_dir))
        if args.model in ("cnn", "resnet"):
            xtr, xte = xtr.reshape(-1, 1, 28, 28), xte.reshape(-1, 1, 28, 28)
        else:
            assert xtr.shape[1] == sizes[0] and sizes[-1] == 10, "layers must be 784,...,10"
        gen = torch.Generator().manual_seed(args.seed)
        n = len(xtr)
        for _ in range(args.epochs):
            perm = torch.randperm(n, generator=gen).to(dev)
            sync()
            t0 = time.perf_counter()
            for i in range(0, n, args.batch):
                idx = perm[i:i + args.batch]
                step(xtr[idx], ytr[idx])
            sync()
            train_s += time.perf_counter() - t0
            samples += n
        model.eval()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
    else:
        x = torch.randn(args.batch, sizes[0], device=dev)
        y = torch.randint(0, sizes[-1], (args.batch,), device=dev)
        for _ in range(5):
            step(x, y)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(x, y)
        sync()
        train_s = time.perf_counter() - t0
        samples = args.steps * args.batch

    print(json.dumps({
        "framework": "pytorch", "torch_version": torch.__version__, "data": args.data,
        "layers": sizes, "batch": args.batch, "samples_per_sec": samples / train_s,
        "train_s": train_s, "test_accuracy": acc,
        "wall_s": time.perf_counter() - wall0, "threads": torch.get_num_threads(), "device": str(dev),
        "amp": args.amp,
        "device_memory_peak_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else None,
    }))


if __name__ == "__main__":
    main()
