"""jobs/gpt2_finetune.toml's model in PyTorch: nanoGPT's GPT at GPT-2 small (12 layers, 12
heads, width 768, biases, tanh GELU, tied, vocabulary 50,257), AdamW with decay on matrices,
on random token windows. For tokens/s side by side with trainer; bench/gpt2_finetune_compare.sh
runs both.

python3 bench/gpt2_finetune_torch.py STEPS BLOCK BATCH   (2 threads, as trainer here)
"""

import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

torch.set_num_threads(2)
torch.manual_seed(1337)
steps, T, B = (int(a) for a in sys.argv[1:4])
C, H, L, V = 768, 12, 12, 50257


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
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(1024, C)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f, self.lm_head = nn.LayerNorm(C), nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


model = GPT()
params = list(model.parameters())
groups = [
    {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
]
opt = torch.optim.AdamW(groups, lr=3e-5, betas=(0.9, 0.95))
data = torch.randint(V, (100_000,))


def step():
    ix = torch.randint(len(data) - T - 1, (B,))
    x = torch.stack([data[i : i + T] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + T] for i in ix])
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


for _ in range(2):
    step()
start = time.perf_counter()
for _ in range(steps):
    loss = step()
elapsed = time.perf_counter() - start
print(f"pytorch {torch.__version__}: {steps} steps in {elapsed:.2f} s, "
      f"{steps * B * T / elapsed:.0f} tokens/s, loss {loss.item():.4f}")
