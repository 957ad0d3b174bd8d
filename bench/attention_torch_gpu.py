"""PyTorch's flash attention (F.scaled_dot_product_attention, causal, bf16) at GPT-2 small's
shape, forward and forward + backward, for the attention rows of `trainer profile` beside it.
TFLOP/s count as FlashAttention-2's benchmark does: 4·B·H·T²·D for the forward, halved when
causal; the backward 2.5 times the forward. bench/gpu-quick.sh gpt2 runs it.

python3 bench/attention_torch_gpu.py [--batch 64] [--heads 12] [--block 1024] [--head-dim 64]
"""

import argparse

import torch
from torch.nn import functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=64)
p.add_argument("--heads", type=int, default=12)
p.add_argument("--block", type=int, default=1024)
p.add_argument("--head-dim", type=int, default=64)
p.add_argument("--repeats", type=int, default=30)
a = p.parse_args()
B, H, T, D = a.batch, a.heads, a.block, a.head_dim
q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dy = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)


def forward():
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def forward_backward():
    forward().backward(dy)


def ms(fn):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / a.repeats


forward_flops = 4 * B * H * T * T * D / 2
f, fb = ms(forward), ms(forward_backward)
b = fb - f
print(
    f"pytorch {torch.__version__} SDPA causal bf16, {B}x{H}x{T}x{D}: forward {f:.2f} ms "
    f"({forward_flops / f / 1e9:.0f} TFLOP/s), backward {b:.2f} ms "
    f"({2.5 * forward_flops / b / 1e9:.0f} TFLOP/s), both {fb:.2f} ms "
    f"({3.5 * forward_flops / fb / 1e9:.0f} TFLOP/s); one layer of a step"
)
