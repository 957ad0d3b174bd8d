"""jobs/gpt2_124m.toml's model and step in PyTorch, for tokens/s side by side with trainer on a
GPU: nanoGPT's GPT at GPT-2 small (12 layers, 12 heads, width 768, biases, tanh GELU, tied,
vocabulary padded to 50,304), bf16 autocast, SDPA (flash) attention, fused AdamW with decay on
matrices, clipping at 1.0, on random token windows. bench/gpu-quick.sh gpt2 runs it.

python3 bench/gpt2_torch_gpu.py --batch 64 --steps 60 [--compile] [--device cuda]
  [--layers 12 --block 1024]   (smaller for a smoke test on a CPU)
"""

import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=64)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--compile", action="store_true")
p.add_argument("--device", default="cuda")
p.add_argument("--layers", type=int, default=12)
p.add_argument("--block", type=int, default=1024)
a = p.parse_args()
torch.manual_seed(1337)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
B, T, C, H, L, V = a.batch, a.block, 768, 12, a.layers, 50304
dev = a.device


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f, self.lm_head = nn.LayerNorm(C), nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


model = GPT().to(dev)
# GPT-2's initialisation, as nanoGPT's _init_weights: N(0, 0.02), zero biases.
for m in model.modules():
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
params = list(model.parameters())
n_params = sum(p.numel() for p in params) - model.wpe.weight.numel()
groups = [
    {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
]
fused = dev.startswith("cuda")
opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=fused)
train_step_model = torch.compile(model) if a.compile else model
data = torch.randint(50257, (B * (T + 1) * 8,), device=dev)


def step():
    ix = torch.randint(len(data) - T - 1, (B,), device=dev)
    offsets = torch.arange(T, device=dev)
    x = data[ix[:, None] + offsets]
    y = data[ix[:, None] + offsets + 1]
    with torch.autocast(device_type=dev.split(":")[0], dtype=torch.bfloat16):
        loss = train_step_model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss


def sync():
    if fused:
        torch.cuda.synchronize()


for _ in range(a.warmup):
    step()
sync()
start = time.perf_counter()
for _ in range(a.steps):
    loss = step()
sync()
elapsed = time.perf_counter() - start
tokens_per_sec = a.steps * B * T / elapsed
# nanoGPT's estimate_mfu against an H100/H200's dense bf16 peak.
flops_per_token = 6 * n_params + 12 * L * H * (C // H) * T
mfu = tokens_per_sec * flops_per_token / 989.4e12
mode = "compiled" if a.compile else "eager"
print(f"pytorch {torch.__version__} {mode}: {a.steps} steps of {B}x{T} in {elapsed:.2f} s, "
      f"{tokens_per_sec:.0f} tokens/s, MFU {100 * mfu:.1f}% (of 989.4 TFLOP/s), "
      f"loss {loss.item():.4f}")
