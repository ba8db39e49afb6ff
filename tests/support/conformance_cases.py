"""The conformance cases: every layer family tunefree meets × its configuration space, each declared exact
(against the batch-size-1 loop, both groupings, both norm paths where a layer has two) or refused (with the
true cause, and a regex of the message). ``CASES`` is generated in a fixed order; ``conformance_matrix.py``
turns it into docs/support-matrix.md, and tests/rules/test_conformance.py runs every case."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from support.conformance_harness import EXAMPLES as B
from support.conformance_harness import Case
from support.conformance_models import (
    Attention,
    Bag,
    BagOfPaddedIds,
    CellLoop,
    Centered,
    Encoder,
    LinearLSTM,
    NoisyScale,
    Recurrent,
    SequenceBias,
    ShrinkingCellLoop,
    TiedHead,
    TimeMajor,
    Twice,
)

T = 4  # time steps (≠ B, so that a layout read in the wrong dimension shows)
LENGTHS_SORTED = (4, 3, 2)
LENGTHS_UNSORTED = (2, 4, 3)


def randn(*shape):
    return lambda g: (torch.randn(*shape, generator=g),)


def ids(vocab, *shape, padding=None):
    def make(g):
        x = torch.randint(1 if padding is not None else 0, vocab, shape, generator=g)
        x.view(-1)[1::3] = x.view(-1)[::3][: x.view(-1)[1::3].numel()]  # repeated ids in each example
        if padding is not None:
            x.view(-1)[2::5] = padding
        return (x,)

    return make


def _with(*parts):
    """Inputs made of several parts, each a function of the generator returning a tuple."""
    return lambda g: tuple(x for part in parts for x in part(g))


def _const(*values):
    return lambda g: tuple(torch.as_tensor(v) for v in values)


def _frozen(module: nn.Module, *names: str) -> nn.Module:
    for name in names:
        module.get_parameter(name).requires_grad_(False)
    return module


# ------------------------------------------------------------------------------------------------ Linear
def linear_cases() -> Iterator[Case]:
    yield Case("Linear", "batch-first [B, F]", lambda: nn.Linear(5, 4), randn(B, 5), two_paths=True)
    yield Case("Linear", "no bias", lambda: nn.Linear(5, 4, bias=False), randn(B, 5), two_paths=True)
    yield Case("Linear", "tokens [B, T, F]", lambda: nn.Linear(5, 4), randn(B, T, 5), two_paths=True)
    yield Case("Linear", "tokens [B, T, T', F]", lambda: nn.Linear(5, 4), randn(B, T, 2, 5), two_paths=True)
    yield Case(
        "Linear",
        "time-major [T, B, F] as the model's input, batch_dim=1",
        lambda: nn.Linear(5, 4),
        randn(T, B, 5),
        batch_dim=1,
        two_paths=True,
    )
    yield Case(
        "Linear",
        "time-major inside a batch-first model, batch_dim={'layer': 1}",
        lambda: TimeMajor(nn.Linear(5, 4)),
        randn(B, T, 5),
        batch_dim={"layer": 1},
        two_paths=True,
    )
    yield Case(
        "Linear",
        "time-major inside the model, undeclared (T ≠ B)",
        lambda: TimeMajor(nn.Linear(5, 4)),
        randn(B, T, 5),
        refused=r"shows 4 examples in dimension 0.*batch_dim=\{'layer': 1\}",
        reason="its tensors carry the examples in dimension 1, read in 0: the message names "
        "batch_dim={'layer': 1}",
    )
    yield Case(
        "Linear",
        "time-major inside the model, undeclared (T = B)",
        lambda: TimeMajor(nn.Linear(5, 4)),
        randn(B, B, 5),
        refused=r"mixes examples in its forward.*changed only rows? [\d, ]+ of dimension 1"
        r".*batch_dim=\{'layer': 1\}",
        reason="read in dimension 0 the examples mix; the check finds them in dimension 1 and "
        "names batch_dim={'layer': 1}",
    )
    yield Case(
        "Linear", "frozen bias", lambda: _frozen(nn.Linear(5, 4), "bias"), randn(B, T, 5), two_paths=True
    )
    yield Case(
        "Linear", "called twice per forward", lambda: Twice(nn.Linear(4, 4)), randn(B, T, 4), two_paths=True
    )


# ------------------------------------------------------------------------------------------- Convolutions
CONV_CONFIGS = [
    (1, {}),
    (1, {"stride": 2, "padding": 1}),
    (1, {"padding": "same", "dilation": 2}),
    (1, {"padding": 1, "padding_mode": "circular"}),
    (2, {}),
    (2, {"stride": (2, 1), "padding": (1, 0)}),
    (2, {"padding": "same"}),
    (2, {"padding": "same", "kernel_size": 2}),
    (2, {"padding": "valid", "dilation": (1, 2)}),
    (2, {"groups": 2, "padding": 1}),
    (2, {"groups": 4, "padding": 1}),
    (2, {"padding": 1, "padding_mode": "reflect"}),
    (2, {"padding": 1, "padding_mode": "replicate", "stride": 2}),
    (3, {}),
    (3, {"stride": 2, "padding": 1, "groups": 2}),
    (3, {"padding": "same", "dilation": 2}),
]


def _conv(dims, config):
    config = dict(config)
    kernel = config.pop("kernel_size", 3)
    return getattr(nn, f"Conv{dims}d")(4, 4, kernel, **config)


def conv_cases() -> Iterator[Case]:
    sizes = {1: (4, 9), 2: (4, 6, 7), 3: (4, 5, 4, 5)}
    for dims, config in CONV_CONFIGS:
        text = ", ".join(f"{k}={v!r}" for k, v in config.items()) or "defaults"
        yield Case(f"Conv{dims}d", text, partial(_conv, dims, config), randn(B, *sizes[dims]), two_paths=True)
    yield Case(
        "Conv2d",
        "frozen bias",
        lambda: _frozen(nn.Conv2d(4, 4, 3), "bias"),
        randn(B, 4, 6, 7),
        two_paths=True,
    )


# ------------------------------------------------------------------------------------------- Embeddings
def embedding_cases() -> Iterator[Case]:
    yield Case(
        "Embedding", "batch-first ids [B, T], repeated ids", lambda: nn.Embedding(10, 4), ids(10, B, T)
    )
    yield Case(
        "Embedding", "padding_idx", lambda: nn.Embedding(10, 4, padding_idx=0), ids(10, B, T, padding=0)
    )
    yield Case(
        "Embedding",
        "every row of a vocabulary of 3 repeated, padding_idx=-1 (the last row)",
        lambda: nn.Embedding(3, 4, padding_idx=-1),
        _const(EVERY_ROW_OF_3),
    )
    yield Case(
        "Embedding",
        "every row of a vocabulary of 3 repeated, padding_idx=0, output head tied to the table",
        _with_tied_head(lambda: nn.Embedding(3, 4, padding_idx=0), lambda embedding: embedding),
        _const(EVERY_ROW_OF_3),
        two_paths=True,
    )
    yield Case(
        "Embedding",
        "time-major ids [T, B], batch_dim=1",
        lambda: nn.Embedding(10, 4),
        ids(10, T, B),
        batch_dim=1,
    )
    yield Case(
        "Embedding",
        "frozen, trainable head",
        lambda: nn.Sequential(_frozen(nn.Embedding(10, 4), "weight"), nn.Linear(4, 3)),
        ids(10, B, T),
        two_paths=True,
    )
    yield Case(
        "Embedding",
        "scale_grad_by_freq=True",
        lambda: nn.Embedding(10, 4, scale_grad_by_freq=True),
        ids(10, B, T),
        refused="scale_grad_by_freq",
        reason="scales each example's gradient by id counts over the whole batch (mixes examples)",
    )
    yield Case(
        "Embedding",
        "sparse=True",
        lambda: nn.Embedding(10, 4, sparse=True),
        ids(10, B, T),
        refused="sparse=False",
        reason="private gradients are dense",
    )
    yield Case(
        "Embedding",
        "max_norm",
        lambda: nn.Embedding(10, 4, max_norm=1.0),
        ids(10, B, T),
        refused="max_norm=1.0: its forward rescales in place",
        reason="the forward rescales the batch's "
        "rows in place, an update of the parameters that is not noised",
    )


# Ids over a vocabulary of 3: every row (the last one too) in the batch, repeated within each bag, and a bag
# of one id repeated only.
EVERY_ROW_OF_3 = ((2, 0, 2, 1, 2, 2), (1, 1, 2, 0, 0, 1), (2, 2, 2, 2, 2, 2))
# Rows 1 and 3 of a vocabulary of 4 tie in their first two columns (``_tied``), in both orders in the bags.
TIES = ((3, 1, 0, 2), (1, 3, 3, 2), (2, 0, 1, 3))


def _bag(mode, vocabulary=10, **kwargs):
    return partial(nn.EmbeddingBag, vocabulary, 4, mode=mode, **kwargs)


def _with_tied_head(make_features, table_of):
    """A model of ``make_features()`` with an output head tied to its table ``table_of(features)``."""
    def build():
        features = make_features()
        return TiedHead(features, table_of(features))
    return build


def _tied(bag: nn.EmbeddingBag) -> nn.EmbeddingBag:
    """Rows 1 and 3 equal in columns 0 and 1: a max bag holding both has tied maxima there, and autograd
    sends the gradient to the first of them in the bag."""
    with torch.no_grad():
        bag.weight[3, :2] = bag.weight[1, :2]
    return bag


def _weights(g):
    return (torch.rand(B, T, generator=g) + 0.5,)


def embedding_bag_cases() -> Iterator[Case]:
    lengths = _const((3, 1, 4))
    for mode in ("sum", "mean", "max"):
        yield Case(
            "EmbeddingBag", f"2-D ids [B, L], mode={mode}", lambda m=mode: Bag(_bag(m)()), ids(10, B, T)
        )
        yield Case(
            "EmbeddingBag",
            f"2-D ids, mode={mode}, padding_idx",
            lambda m=mode: Bag(_bag(m, padding_idx=0)()),
            ids(10, B, T, padding=0),
        )
        for last in (False, True):
            yield Case(
                "EmbeddingBag",
                f"1-D ids and offsets built in the model, mode={mode}, include_last_offset={last}",
                lambda m=mode, last=last: BagOfPaddedIds(_bag(m, include_last_offset=last)()),
                _with(ids(10, B, T), lengths),
            )
        yield Case(
            "EmbeddingBag",
            f"1-D, mode={mode}, padding_idx, an empty bag",
            lambda m=mode: BagOfPaddedIds(_bag(m, padding_idx=0)()),
            _with(ids(10, B, T, padding=0), _const((2, 0, 4))),
        )
        yield Case(
            "EmbeddingBag",
            f"2-D ids, mode={mode}, every row of a vocabulary of 3 repeated in the bags",
            lambda m=mode: Bag(_bag(m, 3)()),
            _const(EVERY_ROW_OF_3),
        )
        for last in (False, True):
            yield Case(
                "EmbeddingBag",
                f"1-D ids, mode={mode}, every row of a vocabulary of 3 repeated, include_last_offset={last}",
                lambda m=mode, last=last: BagOfPaddedIds(_bag(m, 3, include_last_offset=last)()),
                _with(_const(EVERY_ROW_OF_3), _const((6, 3, 1))),
            )
        yield Case(
            "EmbeddingBag",
            f"2-D ids, mode={mode}, padding_idx=-1 (the last row)",
            lambda m=mode: Bag(_bag(m, 3, padding_idx=-1)()),
            _const(EVERY_ROW_OF_3),
        )
    yield Case(
        "EmbeddingBag", "2-D ids, mode=max, tied maxima", lambda: Bag(_tied(_bag("max", 4)())), _const(TIES)
    )
    yield Case(
        "EmbeddingBag",
        "1-D ids, mode=max, tied maxima",
        lambda: BagOfPaddedIds(_tied(_bag("max", 4)())),
        _with(_const(TIES), _const((4, 3, 2))),
    )
    for mode in ("sum", "max"):  # one table used twice: the bag's entries summed with the head's gradient
        yield Case(
            "EmbeddingBag",
            f"1-D ids, mode={mode}, every row of a vocabulary of 3 repeated, output head tied to the table",
            _with_tied_head(lambda m=mode: BagOfPaddedIds(_bag(m, 3)()), lambda model: model.bag),
            _with(_const(EVERY_ROW_OF_3), _const((6, 3, 1))),
            two_paths=True,
        )
    yield Case(
        "EmbeddingBag", "2-D, per_sample_weights", lambda: Bag(_bag("sum")()), _with(ids(10, B, T), _weights)
    )
    yield Case(
        "EmbeddingBag",
        "1-D, per_sample_weights, include_last_offset",
        lambda: BagOfPaddedIds(_bag("sum", include_last_offset=True)(), weighted=True),
        _with(ids(10, B, T), lengths, _weights),
    )
    yield Case(
        "EmbeddingBag",
        "1-D ids and offsets as the model's inputs",
        lambda: Bag(_bag("sum")()),
        _const((1, 4, 4, 2, 7, 1, 3), (0, 3, 4)),
        refused=r"takes its input 1 .*straight from the model's inputs.*build the offsets",
        reason="the offsets come straight from the model's inputs: the independence check cannot "
        "change one example's ids; pass padded ids (2-D form) or build ids and offsets in the "
        "model (exact, above)",
    )
    yield Case(
        "EmbeddingBag",
        "scale_grad_by_freq=True",
        lambda: Bag(_bag("sum", scale_grad_by_freq=True)()),
        ids(10, B, T),
        refused="scale_grad_by_freq",
        reason="mixes examples (id counts over the batch)",
    )


# ------------------------------------------------------------------------------------------------ Norms
def norm_cases() -> Iterator[Case]:
    yield Case("LayerNorm", "tokens [B, T, F]", lambda: nn.LayerNorm(4), randn(B, T, 4))
    yield Case(
        "LayerNorm", "over two dims, no bias", lambda: nn.LayerNorm((T, 4), bias=False), randn(B, T, 4)
    )
    yield Case("LayerNorm", "time-major, batch_dim=1", lambda: nn.LayerNorm(4), randn(T, B, 4), batch_dim=1)
    yield Case("RMSNorm", "tokens [B, T, F]", lambda: nn.RMSNorm(4), randn(B, T, 4))
    yield Case("GroupNorm", "[B, C, L]", lambda: nn.GroupNorm(2, 4), randn(B, 4, 5))
    yield Case("GroupNorm", "[B, C, H, W]", lambda: nn.GroupNorm(4, 4), randn(B, 4, 3, 3))
    yield Case("InstanceNorm1d", "affine", lambda: nn.InstanceNorm1d(4, affine=True), randn(B, 4, 5))
    yield Case("InstanceNorm2d", "affine", lambda: nn.InstanceNorm2d(4, affine=True), randn(B, 4, 3, 3))
    yield Case(
        "InstanceNorm1d",
        "track_running_stats=True",
        lambda: nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
        randn(B, 4, 5),
        refused="track_running_stats=False",
        reason="running statistics average over examples",
    )
    yield Case(
        "BatchNorm1d",
        "any",
        lambda: nn.BatchNorm1d(4),
        randn(B, 4),
        refused="BatchNorm1d, which mixes the examples",
        reason="batch statistics mix examples",
    )


# ------------------------------------------------------------------------------------------- Recurrent
RECURRENT = {"RNN": nn.RNN, "RNN(relu)": partial(nn.RNN, nonlinearity="relu"), "GRU": nn.GRU, "LSTM": nn.LSTM}


def _rnn(kind, state=None, packed=None, **kwargs):
    return lambda: Recurrent(RECURRENT[kind](3, 4, **kwargs), state=state, packed=packed)


def recurrent_cases() -> Iterator[Case]:
    for case in _recurrent_cases():  # every weight is a factored form: both norm paths
        yield replace(case, two_paths=True) if case.refused is None else case


def _recurrent_cases() -> Iterator[Case]:
    x = randn(B, T, 3)
    for kind in RECURRENT:
        yield Case(
            kind,
            "batch_first, 2 layers, bidirectional",
            _rnn(kind, num_layers=2, bidirectional=True, batch_first=True),
            x,
        )
        yield Case(kind, "time-major (batch_first=False)", _rnn(kind), x)
        yield Case(
            kind,
            "PackedSequence, unsorted (enforce_sorted=False)",
            _rnn(kind, packed="unsorted"),
            _with(x, _const(LENGTHS_UNSORTED)),
        )
    for kind in ("GRU", "LSTM"):
        yield Case(
            kind,
            "initial state from the batch, time-major, 2 layers",
            _rnn(kind, state="batch", num_layers=2),
            _with(x, randn(B, 2, 4)),
        )
        yield Case(
            kind,
            "PackedSequence, sorted",
            _rnn(kind, packed="sorted", batch_first=True),
            _with(x, _const(LENGTHS_SORTED)),
        )
    yield Case("LSTM", "learned initial state (a parameter of the model)", _rnn("LSTM", state="learned"), x)
    yield Case(
        "LSTM",
        "initial state computed from the batch (requires grad)",
        _rnn("LSTM", state="computed", batch_first=True),
        x,
        two_paths=True,
    )
    yield Case(
        "LSTM",
        "packed, bidirectional, 2 layers, initial state",
        _rnn("LSTM", state="batch", packed="unsorted", num_layers=2, bidirectional=True),
        _with(x, _const(LENGTHS_UNSORTED), randn(B, 4, 4)),
    )
    yield Case("LSTM", "proj_size=2, batch_first", _rnn("LSTM", proj_size=2, batch_first=True), x)
    yield Case(
        "LSTM",
        "proj_size=2, time-major, packed, bidirectional",
        _rnn("LSTM", packed="unsorted", proj_size=2, bidirectional=True),
        _with(x, _const(LENGTHS_UNSORTED)),
    )
    yield Case(
        "LSTM",
        "frozen, trainable head",
        lambda: nn.Sequential(
            _frozen(
                Recurrent(nn.LSTM(3, 4, batch_first=True)),
                "rnn.weight_ih_l0",
                "rnn.weight_hh_l0",
                "rnn.bias_ih_l0",
                "rnn.bias_hh_l0",
            ),
            nn.Linear(24, 2),
        ),
        x,
        two_paths=True,
    )
    yield Case(
        "GRU",
        "dropout between layers",
        _rnn("GRU", num_layers=2, dropout=0.5),
        x,
        refused="nn.Dropout between single-layer",
        reason="the fused kernel draws its masks; they cannot be replayed per example",
    )
    yield Case(
        "LSTM (made of nn.Linear)",
        "input-to-hidden on the whole time-major sequence, undeclared",
        lambda: LinearLSTM(3, 4),
        x,
        refused=r"'ih'.*shows 4 examples in dimension 0.*batch_dim=\{'ih': 1\}",
        reason="its nn.Linear sees [T, B, F]: the message names batch_dim={'ih': 1}",
    )
    yield Case(
        "LSTM (made of nn.Linear)",
        "input-to-hidden declared time-major, batch_dim={'ih': 1}",
        lambda: LinearLSTM(3, 4),
        x,
        batch_dim={"ih": 1},
        two_paths=True,
    )


def cell_cases() -> Iterator[Case]:
    x = randn(B, T, 3)
    cells = {
        "RNNCell": nn.RNNCell,
        "RNNCell(relu)": partial(nn.RNNCell, nonlinearity="relu"),
        "GRUCell": nn.GRUCell,
        "LSTMCell": nn.LSTMCell,
    }
    yield Case(
        "LSTMCell",
        "stepped over sorted sequences on only those still running (part of the batch per call)",
        ShrinkingCellLoop,
        _with(x, _const(LENGTHS_SORTED)),
        refused=r"shows \d examples.*holds 3: .*called on part of the batch.*call it on every example",
        reason="a call on part of the batch cannot be attributed to examples: call it on every example "
        "and mask, or use nn.LSTM with a PackedSequence (exact, above)",
    )
    for kind, cell in cells.items():
        yield Case(kind, "called once per time step", lambda c=cell: CellLoop(c(3, 4)), x, two_paths=True)
        yield Case(
            kind,
            "initial state from the batch, no bias",
            lambda c=cell: CellLoop(c(3, 4, bias=False), True),
            _with(x, randn(B, 4)),
            two_paths=True,
        )


# ------------------------------------------------------------------------------------------- Attention
def _mha(batch_first=True, **kwargs):
    return nn.MultiheadAttention(4, 2, batch_first=batch_first, **kwargs)


def attention_cases() -> Iterator[Case]:
    x = randn(B, T, 4)
    lengths = _const((4, 2, 3))
    for first in (True, False):
        layout = "batch_first" if first else "time-major (batch_first=False)"
        yield Case("MultiheadAttention", f"self-attention, {layout}", lambda f=first: Attention(_mha(f)), x)
        yield Case(
            "MultiheadAttention",
            f"add_bias_kv, add_zero_attn, {layout}",
            lambda f=first: Attention(_mha(f, add_bias_kv=True, add_zero_attn=True)),
            x,
        )
        yield Case(
            "MultiheadAttention",
            f"kdim/vdim cross-attention, {layout}",
            lambda f=first: Attention(_mha(f, kdim=3, vdim=5), cross=True),
            _with(x, randn(B, 5, 3), randn(B, 5, 5)),
        )
        yield Case(
            "MultiheadAttention",
            f"key_padding_mask built in the model, {layout}",
            lambda f=first: Attention(_mha(f), key_padding="built"),
            _with(x, lengths),
        )
        yield Case(
            "MultiheadAttention",
            f"3-D attn_mask [B·heads, T, S] built in the model, {layout}",
            lambda f=first: Attention(_mha(f), mask="built"),
            _with(x, lengths),
        )
    padding = _const([[False, False, True, True], [False, True, False, False], [False] * 4])
    yield Case(
        "MultiheadAttention",
        "key_padding_mask from the loader",
        lambda: Attention(_mha(), key_padding="batch"),
        _with(x, padding),
    )
    yield Case(
        "MultiheadAttention", "2-D causal attn_mask (shared)", lambda: Attention(_mha(), mask="causal"), x
    )
    yield Case(
        "MultiheadAttention",
        "3-D attn_mask from the loader ([B, heads, T, S])",
        lambda: Attention(_mha(), mask="batch"),
        _with(x, lambda g: (torch.rand(B, 2, T, T, generator=g) > 0.7,)),
    )
    yield Case(
        "MultiheadAttention",
        "per-head attention weights in the loss",
        lambda: Attention(_mha(add_bias_kv=True), weights=True),
        x,
    )
    yield Case(
        "MultiheadAttention",
        "time-major, key padding and 3-D masks built in the model, bias_kv",
        lambda: Attention(_mha(False, add_bias_kv=True), key_padding="built", mask="built"),
        _with(x, lengths),
    )
    yield Case(
        "MultiheadAttention",
        "frozen input projection",
        lambda: Attention(_frozen(_mha(), "in_proj_weight")),
        x,
    )
    yield Case(
        "MultiheadAttention",
        "attention dropout inside",
        lambda: Attention(_mha(dropout=0.5)),
        x,
        refused="draws random numbers.*set its probability to 0.*self_attn.dropout = 0.0",
        reason="at make_private: its dropout is drawn inside the module and cannot be replayed one example "
               "at a time; the message names the fix, module.dropout = 0.0 (in a TransformerEncoderLayer, "
               "layer.self_attn.dropout = 0.0: the layer's other dropouts stay)",
    )


def _encoder(first=True, **kwargs):
    return nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=first, **kwargs)


def encoder_cases() -> Iterator[Case]:
    x = randn(B, T, 4)
    yield Case("TransformerEncoderLayer", "batch_first", lambda: Encoder(_encoder()), x, two_paths=True)
    yield Case(
        "TransformerEncoderLayer",
        "norm_first, key padding mask built in the model",
        lambda: Encoder(_encoder(norm_first=True), padded=True),
        _with(x, _const((4, 2, 3))),
        two_paths=True,
    )
    yield Case(
        "TransformerEncoderLayer",
        "time-major, batch_dim={'enc': 1}",
        lambda: Encoder(_encoder(False)),
        x,
        batch_dim={"enc": 1},
        two_paths=True,
    )
    yield Case(
        "TransformerEncoderLayer",
        "time-major, undeclared",
        lambda: Encoder(_encoder(False)),
        x,
        refused=r"'enc\.\w+'.*shows 4 examples.*batch_dim=\{'enc\.\w+': 1\}.*parent module",
        reason="its linear and norm layers see [T, B, E]: the message names the declaration",
    )


# ------------------------------------------------------------------------------------ custom modules, misc
def custom_cases() -> Iterator[Case]:
    yield Case(
        "SequenceBias (custom, generic fallback)",
        "batch-first",
        lambda: SequenceBias(4, True),
        randn(B, T, 4),
    )
    yield Case(
        "SequenceBias (custom, generic fallback)",
        "time-major, batch_dim={'layer': 1}",
        lambda: TimeMajor(SequenceBias(4, False)),
        randn(B, T, 4),
        batch_dim={"layer": 1},
    )
    yield Case(
        "SequenceBias (custom, generic fallback)",
        "time-major, undeclared",
        lambda: TimeMajor(SequenceBias(4, False)),
        randn(B, T, 4),
        refused=r"'layer'.*shows 5 examples in dimension 0.*batch_dim=\{'layer': 1\}",
        reason="its tensors carry the examples in dimension 1: the message names the declaration",
    )
    yield Case(
        "Custom module",
        "dropout inside its forward (generic fallback)",
        NoisyScale,
        randn(B, 3),
        refused="draws random numbers",
        reason="random numbers drawn inside cannot be replayed per example",
    )
    yield Case(
        "Custom computation",
        "batch mean subtracted (h - h.mean(0))",
        Centered,
        randn(B, 3),
        refused="mixes examples in its",
        reason="each example's activations depend on the others",
    )


def all_cases() -> list[Case]:
    cases = [
        case
        for family in (
            linear_cases,
            conv_cases,
            embedding_cases,
            embedding_bag_cases,
            norm_cases,
            recurrent_cases,
            cell_cases,
            attention_cases,
            encoder_cases,
            custom_cases,
        )
        for case in family()
    ]
    ids = [case.id for case in cases]
    assert len(set(ids)) == len(ids), "case ids must be unique"
    return cases


CASES = all_cases()
