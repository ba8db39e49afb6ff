"""The three benchmark models of the per-sample engine issue, and synthetic batches for them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def mnist_cnn() -> nn.Module:
    """The 4-layer MNIST CNN of Papernot et al. / Tramèr & Boneh (28×28×1 inputs)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10))


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 style causal transformer: 4 blocks, d 256, 4 heads, vocab 5000, untied head."""

    def __init__(self, vocab: int = 5000, d: int = 256, heads: int = 4, layers: int = 4,
                 context: int = 128):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # contiguous: Opacus' ghost mode fails on expanded (non-contiguous) embedding ids
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
        return self.head(self.ln(self.blocks(self.tokens(ids) + self.positions(positions))))


def conv_block(c_in: int, c_out: int, pool: bool = False) -> nn.Sequential:
    layers = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.GroupNorm(8, c_out), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class Residual(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(conv_block(c, c), conv_block(c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def resnet9(widths: tuple[int, int, int, int] = (16, 32, 64, 128), classes: int = 10) -> nn.Module:
    """ResNet-9 with GroupNorm for 32×32×3 inputs."""
    w1, w2, w3, w4 = widths
    return nn.Sequential(
        conv_block(3, w1), conv_block(w1, w2, pool=True), Residual(w2),
        conv_block(w2, w3, pool=True), conv_block(w3, w4, pool=True), Residual(w4),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(w4, classes))


def digits_mlp() -> nn.Module:
    """The tabular case: an MLP for 8×8 digits, 64 → 128 → 128 → 10."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


class Logits(nn.Module):
    """A Hugging Face model called on token ids, returning its logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def hf_model(name: str) -> nn.Module:
    """Tiny BERT (2 layers, d 128, sequence classification) and GPT-2 (2 layers, d 128, vocab 5000)."""
    import transformers as hf

    if name == "bert-tiny":
        config = hf.BertConfig(vocab_size=5000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=512, max_position_embeddings=128, num_labels=2,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return Logits(hf.BertForSequenceClassification(config))
    config = hf.GPT2Config(vocab_size=5000, n_embd=128, n_layer=2, n_head=2, n_positions=128,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return Logits(hf.GPT2LMHeadModel(config))


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's loss is the mean over its tokens; the batch's is their mean."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def benchmark(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable]:
    """Model, one synthetic batch (inputs, targets) and the loss function of a benchmark."""
    g = torch.Generator().manual_seed(0)
    if name == "digits-mlp":
        x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
        return digits_mlp(), x, y, F.cross_entropy
    if name in HF_BENCHMARKS:
        ids = torch.randint(0, 5000, (16, 128), generator=g)
        if name == "bert-tiny":
            return hf_model(name), ids, torch.randint(0, 2, (16,), generator=g), F.cross_entropy
        return hf_model(name), ids, torch.randint(0, 5000, (16, 128), generator=g), lm_loss
    if name == "mnist-cnn":
        x, y = torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g)
        return mnist_cnn(), x, y, F.cross_entropy
    if name == "gpt":
        ids = torch.randint(0, 5000, (16, 128), generator=g)
        targets = torch.randint(0, 5000, (16, 128), generator=g)

        return GPT(), ids, targets, lm_loss
    if name == "resnet9":
        x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
        return resnet9(), x, y, F.cross_entropy
    raise KeyError(name)


BENCHMARKS = ("mnist-cnn", "gpt", "resnet9")
SMALL_BENCHMARKS = ("digits-mlp",)
HF_BENCHMARKS = ("bert-tiny", "gpt2-tiny")  # need transformers
