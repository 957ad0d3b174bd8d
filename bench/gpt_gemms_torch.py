"""The char GPT's matrix products in PyTorch, GFLOP/s on 1 and 2 threads (bench/gpt_gemms.rs
times the same through trainer's CPU matmul).

python3 bench/gpt_gemms_torch.py
"""

import time

import torch

rows = 768
for fan_in, fan_out in [(128, 384), (128, 128), (128, 512), (512, 128)]:
    x, w, dy = torch.randn(rows, fan_in), torch.randn(fan_out, fan_in), torch.randn(rows, fan_out)
    flops = 2.0 * rows * fan_in * fan_out
    for threads in (1, 2):
        torch.set_num_threads(threads)

        def rate(f, calls=300):
            for _ in range(20):
                f()
            t = time.perf_counter()
            for _ in range(calls):
                f()
            return flops / ((time.perf_counter() - t) / calls) / 1e9

        fwd = rate(lambda: x @ w.t())
        bwd_x = rate(lambda: dy @ w)
        bwd_w = rate(lambda: dy.t() @ x)
        print(f"{fan_in:>4} -> {fan_out:<4} {threads} threads: forward {fwd:.1f}, input grad "
              f"{bwd_x:.1f}, weight grad {bwd_w:.1f} GFLOP/s")
