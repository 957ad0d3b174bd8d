"""The model of jobs/gpt_char.toml in PyTorch (nanoGPT's GPT: no biases, tied embeddings, AdamW
with decay on matrices), trained on random windows of the same text, for tokens/s side by
side with trainer.

python3 bench/gpt_char_torch.py [steps [B T C H L DROPOUT]]   (2 threads, as trainer here)

The shape defaults to jobs/gpt_char.toml's (12 64 128 4 4 0); jobs/gpt_shakespeare.toml's is
64 256 384 6 6 0.2. Dropout sits where nanoGPT's does.

ARCH=llama trains jobs/llama_char.toml's model instead: Hugging Face's Llama layer (RMSNorm,
rotary embedding with its cosines and sines computed once, SiLU-gated MLP of 352 values,
untied embeddings). KV_HEADS=2 gives it grouped-query attention: two key and value heads,
each shared by two query heads, through scaled_dot_product_attention's enable_gqa.
"""

import gzip
import math
import os
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

torch.set_num_threads(2)
torch.manual_seed(1337)
shape = sys.argv[2:8] if len(sys.argv) > 2 else ["12", "64", "128", "4", "4", "0"]
B, T, C, H, L = (int(v) for v in shape[:5])
P = float(shape[5])
KV = int(os.environ.get("KV_HEADS") or H)


def drop(x):
    return F.dropout(x, P) if P > 0 else x


text = gzip.open("jobs/data/shakespeare.txt.gz").read().decode()
chars = sorted(set(text))
V = len(chars)
index = {c: i for i, c in enumerate(chars)}
data = torch.tensor([index[c] for c in text], dtype=torch.long)
train = data[: int(0.9 * len(data))]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C, bias=False), nn.LayerNorm(C, bias=False)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=True)
        x = x + drop(self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(C, eps=1e-5)
        self.post_attention_layernorm = nn.RMSNorm(C, eps=1e-5)
        self.qkv_proj = nn.Linear(C, C + 2 * KV * (C // H), bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(C, 352, bias=False), nn.Linear(C, 352, bias=False)
        self.down_proj = nn.Linear(352, C, bias=False)

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        d = c // H
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split([C, KV * d, KV * d], dim=2)
        q = q.view(b, t, H, d).transpose(1, 2)
        k, v = (z.view(b, t, KV, d).transpose(1, 2) for z in (k, v))
        q, k = (z * cos + rotate_half(z) * sin for z in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
        h = x + self.o_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        n = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))


def rotate_half(x):
    d = x.shape[-1]
    return torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList(LlamaBlock() for _ in range(L))
        self.norm, self.lm_head = nn.RMSNorm(C, eps=1e-5), nn.Linear(C, V, bias=False)
        d = C // H
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        emb = torch.arange(T).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((emb, emb), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for block in self.layers:
            x = block(x, self.cos, self.sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f, self.lm_head = nn.LayerNorm(C, bias=False), nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, V), targets.view(-1))


model = Llama() if os.environ.get("ARCH") == "llama" else GPT()
# nanoGPT's initialisation of matrices and embeddings: PyTorch's N(0, 1) embedding, tied to
# the head, starts the loss far above ln(vocabulary).
for p in model.parameters():
    if p.dim() >= 2:
        nn.init.normal_(p, 0.0, 0.02)
params = list(model.parameters())
groups = [
    {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
]
opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200


def step():
    ix = torch.randint(len(train) - T, (B,))
    x = torch.stack([train[i : i + T] for i in ix])
    y = torch.stack([train[i + 1 : i + 1 + T] for i in ix])
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


for _ in range(20):
    step()
start = time.perf_counter()
for _ in range(steps):
    loss = step()
elapsed = time.perf_counter() - start
print(f"pytorch {torch.__version__}: {steps} steps in {elapsed:.2f} s, "
      f"{steps * B * T / elapsed:.0f} tokens/s, loss {loss.item():.4f}")
