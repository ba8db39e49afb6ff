"""Small models for the conformance cases: each puts one layer family in a configuration and returns one
tensor with the examples in the dimension of the model's inputs (batch-first unless the case declares
otherwise), so that every output of the layer reaches each example's loss."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class TimeMajor(nn.Module):
    """Takes ``[B, T, …]`` from the loader and runs ``layer`` on ``[T, B, …]`` (declared by the case)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.transpose(0, 1)).transpose(0, 1)


class TiedHead(nn.Module):
    """``features`` (an embedding, a bag, or a model around one) then an output head whose weight is the
    table of ``table``: one parameter used twice in a step, its per-sample gradient the sum of both uses."""

    def __init__(self, features: nn.Module, table: nn.Embedding | nn.EmbeddingBag):
        super().__init__()
        self.features = features
        self.head = nn.Linear(table.embedding_dim, table.num_embeddings, bias=False)
        self.head.weight = table.weight

    def forward(self, *inputs):
        return self.head(self.features(*inputs))


class Twice(nn.Module):
    """The same layer called twice in one forward."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(torch.tanh(self.layer(x)))


class BagOfPaddedIds(nn.Module):
    """``nn.EmbeddingBag``'s 1-D form built inside the model from padded ids ``[B, L]`` and lengths ``[B]``
    (what the loader gives): the ids of each example concatenated, with offsets (and per-id weights)."""

    def __init__(self, bag: nn.EmbeddingBag, weighted: bool = False):
        super().__init__()
        self.bag, self.weighted = bag, weighted

    def forward(self, ids, lengths, weights=None):
        keep = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        ends = lengths.cumsum(0)
        starts = ends - lengths
        offsets = torch.cat([starts, ends[-1:]]) if self.bag.include_last_offset else starts
        per_id = weights[keep] if self.weighted else None
        return self.bag(ids[keep], offsets, per_sample_weights=per_id)


class Bag(nn.Module):
    """``nn.EmbeddingBag`` on what the model is given (2-D ids, or 1-D ids and offsets), optionally with
    per-id weights."""

    def __init__(self, bag: nn.EmbeddingBag):
        super().__init__()
        self.bag = bag

    def forward(self, ids, *rest):
        if ids.dim() == 2:
            return self.bag(ids, per_sample_weights=rest[0] if rest else None)
        return self.bag(ids, rest[0])


class Recurrent(nn.Module):
    """A recurrent layer on the loader's batch-first ``x``: in its own layout, from an initial state
    (``state``: None, "batch" (a model input ``[B, layers, H]``), "learned", "computed" (a Linear of the
    first step)), on packed sequences (``packed``: None, "sorted", "unsorted"; lengths a model input);
    every output and final state reaches the loss."""

    def __init__(self, rnn: nn.RNNBase, state: str | None = None, packed: str | None = None):
        super().__init__()
        self.rnn, self.state, self.packed = rnn, state, packed
        layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
        hidden = rnn.proj_size or rnn.hidden_size if isinstance(rnn, nn.LSTM) else rnn.hidden_size
        self.shape = (layers, hidden)
        if state == "learned":
            self.h0 = nn.Parameter(torch.randn(layers, 1, hidden) * 0.5)
        if state == "computed":
            self.to_state = nn.Linear(rnn.input_size, layers * hidden)

    def _initial(self, x, extra):
        batch = x.shape[0]
        if self.state == "batch":
            h0 = extra.pop(0).transpose(0, 1).contiguous()
        elif self.state == "learned":
            h0 = self.h0.expand(-1, batch, -1)
        elif self.state == "computed":
            h0 = torch.tanh(self.to_state(x[:, 0])).reshape(batch, *self.shape).transpose(0, 1)
        else:
            return None
        if isinstance(self.rnn, nn.LSTM):
            c0 = torch.zeros(
                self.rnn.num_layers * (2 if self.rnn.bidirectional else 1),
                batch,
                self.rnn.hidden_size,
                dtype=x.dtype,
            )
            return (h0, c0 + 0.5 * torch.tanh(h0.sum(-1, keepdim=True)))
        return h0

    def forward(self, x, *extra):
        extra = list(extra)
        lengths = extra.pop(0) if self.packed else None
        hx = self._initial(x, extra)
        steps = x.shape[1]
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        if self.packed:
            seq = pack_padded_sequence(
                seq, lengths, batch_first=self.rnn.batch_first, enforce_sorted=self.packed == "sorted"
            )
        out, state = self.rnn(seq, hx)
        if self.packed:
            out = pad_packed_sequence(out, batch_first=True, total_length=steps)[0]
        elif not self.rnn.batch_first:
            out = out.transpose(0, 1)
        states = state if isinstance(state, tuple) else (state,)
        return torch.cat([out.flatten(1), *(s.transpose(0, 1).flatten(1) for s in states)], 1)


class CellLoop(nn.Module):
    """A cell called once per time step; the initial state from the loader (``[B, H]``) or none."""

    def __init__(self, cell: nn.RNNCellBase, with_state: bool = False):
        super().__init__()
        self.cell, self.with_state = cell, with_state

    def forward(self, x, *extra):
        lstm = isinstance(self.cell, nn.LSTMCell)
        state = None
        if self.with_state:
            state = (extra[0], torch.tanh(extra[0])) if lstm else extra[0]
        outputs = []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            outputs.extend(state if lstm else (state,))
        return torch.stack(outputs, 1)


class ShrinkingCellLoop(nn.Module):
    """A cell stepped over sequences sorted by length, on only the sequences still running at each step
    (as a hand-written loop over packed sequences does): its later calls see part of the batch."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 4)

    def forward(self, x, lengths):
        h = c = x.new_zeros(x.shape[0], 4)
        for t in range(x.shape[1]):
            running = int((lengths > t).sum())
            h_t, c_t = self.cell(x[:running, t], (h[:running], c[:running]))
            h, c = torch.cat([h_t, h[running:]]), torch.cat([c_t, c[running:]])
        return h


class LinearLSTM(nn.Module):
    """An LSTM made of two nn.Linear layers (as some libraries build one): ``ih`` on the whole
    time-major sequence ``[T, B, F]`` at once, ``hh`` once per step on ``[B, H]``."""

    def __init__(self, features: int, hidden: int, batch_first: bool = True):
        super().__init__()
        self.batch_first, self.hidden = batch_first, hidden
        self.ih = nn.Linear(features, 4 * hidden)
        self.hh = nn.Linear(hidden, 4 * hidden)

    def forward(self, x):
        seq = x.transpose(0, 1) if self.batch_first else x
        gates_x = self.ih(seq)
        h = c = seq.new_zeros(seq.shape[1], self.hidden)
        outputs = []
        for t in range(seq.shape[0]):
            i, f, g, o = (gates_x[t] + self.hh(h)).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        out = torch.stack(outputs, 0)
        return out.transpose(0, 1) if self.batch_first else out


class Attention(nn.Module):
    """``nn.MultiheadAttention`` on the loader's batch-first ``x`` (and key, value for cross-attention),
    in its own layout, with masks from the loader or built inside the model:

    ``key_padding``: None, "batch" (a model input ``[B, S]``), "built" (from lengths ``[B]``);
    ``mask``: None, "causal" (2-D, shared), "batch" (a model input ``[B, heads, T, S]``), "built"
    (3-D ``[B·heads, T, S]`` from lengths); ``weights``: the attention weights reach the loss too."""

    def __init__(
        self,
        mha: nn.MultiheadAttention,
        cross: bool = False,
        key_padding: str | None = None,
        mask: str | None = None,
        weights: bool = False,
    ):
        super().__init__()
        self.mha, self.cross, self.key_padding, self.mask, self.weights = (
            mha,
            cross,
            key_padding,
            mask,
            weights,
        )

    def forward(self, x, *extra):
        extra = list(extra)
        key, value = (extra.pop(0), extra.pop(0)) if self.cross else (x, x)
        lengths = extra.pop(0) if "built" in (self.key_padding, self.mask) else None
        steps, keys = x.shape[1], key.shape[1]
        padding = extra.pop(0) if self.key_padding == "batch" else None
        if self.key_padding == "built":
            padding = torch.arange(keys)[None, :] >= lengths[:, None]
        mask = None
        if self.mask == "causal":
            mask = torch.ones(steps, keys, dtype=torch.bool).triu(1)
        elif self.mask == "batch":
            mask = extra.pop(0).flatten(0, 1)
        elif self.mask == "built":
            blocked = torch.arange(keys)[None, None, :] >= lengths[:, None, None]
            mask = blocked.expand(-1, steps, -1).repeat_interleave(self.mha.num_heads, 0)
        if not self.mha.batch_first:
            x, key, value = x.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        out, attn = self.mha(
            x,
            key,
            value,
            key_padding_mask=padding,
            attn_mask=mask,
            need_weights=self.weights,
            average_attn_weights=False,
        )
        out = out if self.mha.batch_first else out.transpose(0, 1)
        return torch.cat([out.flatten(1), attn.flatten(1)], 1) if self.weights else out


class Encoder(nn.Module):
    """``nn.TransformerEncoderLayer`` on the loader's batch-first ``x`` in its own layout, optionally with
    a key padding mask built from lengths."""

    def __init__(self, layer: nn.TransformerEncoderLayer, padded: bool = False):
        super().__init__()
        self.enc, self.padded = layer, padded

    def forward(self, x, *extra):
        padding = torch.arange(x.shape[1])[None, :] >= extra[0][:, None] if self.padded else None
        first = self.enc.self_attn.batch_first
        out = self.enc(x if first else x.transpose(0, 1), src_key_padding_mask=padding)
        return out if first else out.transpose(0, 1)


class SequenceBias(nn.Module):
    """A custom module with a bare parameter (the generic fallback): appends a learned step to each
    sequence, ``[T, B, E]`` → ``[T + 1, B, E]`` (time-major) or ``[B, T, E]`` → ``[B, T + 1, E]``."""

    def __init__(self, embed: int, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.bias = nn.Parameter(torch.randn(embed))

    def forward(self, x):
        if self.batch_first:
            return torch.cat([x, self.bias.expand(x.shape[0], 1, -1)], 1)
        return torch.cat([x, self.bias.expand(1, x.shape[1], -1)], 0)


class Centered(nn.Module):
    """Subtracts the batch mean: mixes examples."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0)


class NoisyScale(nn.Module):
    """A custom module with dropout inside its own forward (the generic fallback cannot replay it)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return nn.functional.dropout(x * self.scale, 0.5, self.training)
