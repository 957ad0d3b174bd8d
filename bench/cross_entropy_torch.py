"""PyTorch's cross-entropy over a large vocabulary, forward and gradient, as `trainer profile
bench/token_loading.toml` times trainer's: 512 rows of 50,257 logits, 2 threads.

    python3 bench/cross_entropy_torch.py [rows] [vocabulary]
"""

import sys
import time

import torch
import torch.nn.functional as F

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 512
vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 50257
torch.set_num_threads(2)
torch.manual_seed(0)
logits = (torch.randn(rows, vocab) * 0.1).requires_grad_()
targets = torch.randint(vocab, (rows,))


def step():
    logits.grad = None
    F.cross_entropy(logits, targets).backward()


for _ in range(3):
    step()
best = float("inf")
for _ in range(10):
    start = time.perf_counter()
    for _ in range(5):
        step()
    best = min(best, (time.perf_counter() - start) / 5)
print(f"PyTorch {torch.__version__}: cross-entropy forward and backward, {rows} x {vocab}: "
      f"{best * 1e3:.1f} ms (fastest of 10 rounds of 5)")
