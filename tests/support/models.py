"""Small models covering every layer rule, sequence inputs, tied weights and the fallback."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Bias(nn.Module):
    """A custom module with a bare parameter: only the generic fallback can reach it."""

    def __init__(self, d: int):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(d) * 0.1)
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return torch.tanh(x * self.gain + self.shift)


class MLP(nn.Module):
    def __init__(self, d_in=6, hidden=5, classes=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class SequenceLinear(nn.Module):
    """Linear layers on rank-3 and rank-4 inputs, one wide enough for ghost norm and one narrow."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(12, 10)  # T=3: ghost is cheaper
        self.narrow = nn.Linear(10, 2, bias=False)  # T=3·2: materialising is cheaper
        self.head = nn.Linear(2, 3)

    def forward(self, x):  # x: [B, 3, 2, 12]
        h = torch.tanh(self.wide(x))
        h = self.narrow(h)
        return self.head(h.mean((1, 2)))


class ConvNet(nn.Module):
    def __init__(self, dims: int, **conv_kwargs):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.conv = conv(4, 6, 3, **conv_kwargs)
        self.conv2 = conv(6, 4, 2, padding=1, bias=False)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        h = torch.relu_(self.conv2(h))
        return self.fc(h.flatten(2).mean(2))


class EmbeddingModel(nn.Module):
    def __init__(self, vocab=7, d=4, padding_idx=0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.fc = nn.Linear(d, 3)

    def forward(self, ids):
        return self.fc(torch.tanh(self.emb(ids)).mean(1))


class TiedLM(nn.Module):
    """Embedding and output head share one weight; a block is called twice."""

    def __init__(self, vocab=9, d=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))
        return self.head(h).mean(1)


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.fc = nn.Linear(4 * 16, 6)
        self.ln = nn.LayerNorm(6)
        self.ln_nobias = nn.LayerNorm(6, bias=False)
        self.rms = nn.RMSNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):  # [B, 2, 4, 4]
        h = self.inorm(torch.tanh(self.gn(self.conv(x))))
        h = self.fc(torch.tanh(h).flatten(1))
        h = self.rms(self.ln_nobias(torch.tanh(self.ln(h))))
        return self.out(h)


class FallbackNet(nn.Module):
    """A bare-parameter module, and multi-head attention (reads out_proj's weight functionally)."""

    def __init__(self, d=4):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.bias = Bias(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.out = nn.Linear(d, 3)

    def forward(self, x):  # [B, T, 3]
        h = self.bias(self.inp(x))
        h, _ = self.attn(h, h, h)
        return self.out(h.mean(1))


class TinyTransformer(nn.Module):
    """A causal transformer block between tied input and output embeddings."""

    def __init__(self, vocab=11, d=8, heads=2, context=6):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.heads = heads

    def forward(self, ids):
        b, t = ids.shape
        x = self.tokens(ids) + self.positions(torch.arange(t).expand(b, t))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(y)
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return self.head(self.ln_f(x)).mean(1)


class IdentityForward(torch.autograd.Function):
    """An ``autograd.Function`` whose forward is the identity (a copy); a subclass writes the backward
    whose behaviour a test is about."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()
