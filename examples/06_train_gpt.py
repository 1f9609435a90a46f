"""Train a small GPT with numba_flash's attention and with PyTorch's SDPA, from one seed.

    python examples/06_train_gpt.py            # needs PyTorch (pip install numba_flash[torch])

Task: sequences of tokens where each token is the sum of the two before it, modulo V
(the first two are random). Attention must find the two previous positions; the loss
falls from log V towards 0. Both models start from the same weights and see the same
batches, so their loss curves agree up to rounding (bfloat16 on a GPU: the attention
kernels round differently, and training amplifies it a little). On a GPU the step time
and tokens per second of both are printed. Without a GPU (the simulator, CPU tensors)
the model, batch and run are tiny.
"""
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import numba_flash
import numba_flash.torch as nft

SIM = numba_flash.SIMULATOR or not torch.cuda.is_available()
DEVICE = "cpu" if SIM else "cuda"
DTYPE = torch.float32 if SIM else torch.bfloat16
V, T, LAYERS, HEADS, WIDTH = (11, 8, 1, 2, 32) if SIM else (97, 512, 2, 8, 512)
BATCH, STEPS, LR = (2, 2, 3e-3) if SIM else (32, 300, 1e-3)


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        a = self.attention(q, k, v)                                 # (b, heads, t, head dim)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, WIDTH), nn.Embedding(T, WIDTH)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, V)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def batch(gen):
    seq = torch.empty(BATCH, T + 1, dtype=torch.long)
    seq[:, :2] = torch.randint(0, V, (BATCH, 2), generator=gen)
    for t in range(2, T + 1):
        seq[:, t] = (seq[:, t - 1] + seq[:, t - 2]) % V
    seq = seq.to(DEVICE)
    return seq[:, :-1], seq[:, 1:]


def ours(q, k, v):
    return nft.attention(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), causal=True).to(q.dtype)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), is_causal=True).to(q.dtype)


def train(attention):
    torch.manual_seed(0)
    model = GPT(attention).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(STEPS):
        x, y = batch(gen)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


mine, t_mine = train(ours)
ref, t_ref = train(sdpa)
every = max(1, STEPS // 6)
print(f"{'step':>5} {'numba_flash':>12} {'SDPA':>8}   ({DTYPE}, {DEVICE}; log V = {math.log(V):.2f})")
for s in sorted(set(range(0, STEPS, every)) | {STEPS - 1}):
    print(f"{s:5d} {mine[s]:12.4f} {ref[s]:8.4f}")
if not SIM:
    warm = STEPS // 10                            # compile and allocator warm-up excluded
    for name, ts in (("numba_flash", t_mine), ("SDPA", t_ref)):
        step = sorted(ts[warm:])[len(ts[warm:]) // 2]
        print(f"{name}: median step {1e3 * step:.1f} ms, {BATCH * T / step:,.0f} tokens/s")
    assert mine[-1] < 0.5 * math.log(V), "numba_flash's model did not learn the task"
# Same weights, same batches: the curves agree (float32 in the simulator: closely).
tol = 1e-3 if SIM else 0.15
assert all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(mine[:every + 1], ref[:every + 1])), (mine, ref)
print("loss curves agree")
