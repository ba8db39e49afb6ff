"""The leak fuzzer's model zoo: ordinary building blocks a user writes, assembled from a plain-data spec.

A model is ``stem → blocks → pool → head``. Between blocks the hidden state is one of three layouts,
always examples first: ``vec`` (B, D), ``seq`` (B, T, D) or ``img`` (B, D, H, W). Every block is an
ordinary module (a torch layer, a user module with a bare ``nn.Parameter``, a module that keeps a buffer
or an attribute — or state on its class, in a foreign helper object, a list of 100, a deque or a
module-level global — one that mixes examples, one that rescales its gradient by a statistic of the
batch or of each example), and hooks are ordinary hooks. Nothing here knows tunefree: the zoo describes
what users write; ``fuzz_draw`` trains it privately and ``leak_fuzz`` judges the result.

``ModelSpec`` is plain data, so a draw prints as a reproducer and shrinks by editing fields.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

D = 6            # hidden width (two attention heads of 3)
FEATURES = 5     # input features of dense and sequence inputs
LENGTH = 4       # sequence length
VOCAB = 9        # token vocabulary
CHANNELS, SIDE = 2, 5  # image inputs: (B, 2, 5, 5)
CLASSES = 3

INPUTS = ("dense", "seq", "image", "tokens")
STEM_LAYOUT = {"dense": "vec", "seq": "seq", "image": "img", "tokens": "seq"}


@dataclass(frozen=True)
class Block:
    """One block: its kind (a key of ``BLOCKS``) and keyword arguments."""

    kind: str
    args: tuple[tuple[str, object], ...] = ()

    def kwargs(self) -> dict[str, object]:
        return dict(self.args)

    def __repr__(self) -> str:
        inner = ", ".join([repr(self.kind)] + [f"{k}={v!r}" for k, v in self.args])
        return f"B({inner})"


def B(kind: str, /, **kwargs: object) -> Block:  # noqa: N802 (reads like a constructor in reproducers)
    return Block(kind, tuple(sorted(kwargs.items())))


@dataclass(frozen=True)
class Hook:
    """A hook registered before make_private on block ``at`` (an index into ``ModelSpec.blocks``; -1: the
    head, -2: the stem's layer); ``kind`` is a key of ``HOOKS``."""

    at: int
    kind: str

    def __repr__(self) -> str:
        return f"Hook({self.at}, {self.kind!r})"


@dataclass(frozen=True)
class ModelSpec:
    inputs: str = "dense"
    blocks: tuple[Block, ...] = ()
    hooks: tuple[Hook, ...] = ()
    max_norm: float | None = None   # tokens: nn.Embedding(max_norm=…) renormalises rows in place
    tied_head: bool = False         # tokens: the head is an nn.Linear sharing the embedding's weight
    pool: str = "mean"              # seq: "mean", "last" or "tokens" (no pooling: a prediction per token,
    #                                 trained by the loop's token loss)

    def __repr__(self) -> str:
        defaults = ModelSpec()
        parts = [f"{f}={getattr(self, f)!r}" for f in self.__dataclass_fields__
                 if getattr(self, f) != getattr(defaults, f) or f == "inputs"]
        return f"ModelSpec({', '.join(parts)})"

    @property
    def classes(self) -> int:
        return VOCAB if self.tied_head else CLASSES


# ------------------------------------------------------------------------------------------- blocks
def _features_last(h: torch.Tensor, layout: str) -> torch.Tensor:
    """The hidden state with features in the last dimension (images: channels last)."""
    return h.movedim(1, -1) if layout == "img" else h


def _features_back(h: torch.Tensor, layout: str) -> torch.Tensor:
    return h.movedim(-1, 1) if layout == "img" else h


def _channels_first(h: torch.Tensor, layout: str) -> torch.Tensor:
    """(B, D, …) for the torch layers that want channels in dimension 1 (norms, convolutions)."""
    return h.transpose(1, 2) if layout == "seq" else h


_channels_back = _channels_first  # the same transpose undoes it


class Dense(nn.Module):
    """Linear on the feature dimension, then tanh."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout, self.fc = layout, nn.Linear(D, D)

    def forward(self, h):
        return _features_back(torch.tanh(self.fc(_features_last(h, self.layout))), self.layout)


class Norm(nn.Module):
    """A torch norm layer: ``kind`` layer | group | instance | batch."""

    def __init__(self, layout: str, kind: str = "layer", affine: bool = True, running: bool = False):
        super().__init__()
        self.layout, self.kind = layout, kind
        if kind == "layer":
            self.norm = nn.LayerNorm(D, elementwise_affine=affine)
        elif kind == "group":
            self.norm = nn.GroupNorm(2, D, affine=affine)
        elif kind == "instance":
            cls = nn.InstanceNorm2d if layout == "img" else nn.InstanceNorm1d
            self.norm = cls(D, affine=affine, track_running_stats=running)
        else:
            cls = nn.BatchNorm2d if layout == "img" else nn.BatchNorm1d
            self.norm = cls(D, affine=affine, track_running_stats=running)

    def forward(self, h):
        if self.kind == "layer":
            return _features_back(self.norm(_features_last(h, self.layout)), self.layout)
        return _channels_back(self.norm(_channels_first(h, self.layout)), self.layout)


class Conv(nn.Module):
    """Conv1d over the sequence, or Conv2d over the image, keeping the size."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.conv = nn.Conv2d(D, D, 3, padding=1) if layout == "img" else nn.Conv1d(D, D, 3, padding=1)

    def forward(self, h):
        return torch.tanh(_channels_back(self.conv(_channels_first(h, self.layout)), self.layout))


class Recurrent(nn.Module):
    def __init__(self, layout: str, kind: str = "lstm"):
        super().__init__()
        cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind]
        self.rnn = cls(D, D, batch_first=True)

    def forward(self, h):
        return self.rnn(h)[0]


class Attention(nn.Module):
    """Self-attention with a residual (``causal``: a [T, T] mask buffer shared by all examples)."""

    def __init__(self, layout: str, causal: bool = False):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.register_buffer("mask", torch.triu(torch.ones(LENGTH, LENGTH, dtype=torch.bool), 1)
                             if causal else None)

    def forward(self, h):
        return h + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]


class Encoder(nn.Module):
    def __init__(self, layout: str):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True)

    def forward(self, h):
        return self.layer(h)


class Custom(nn.Module):
    """A user module with a bare parameter: ``scale`` (D,), ``matrix`` (D, D), ``positional`` (T, D)."""

    def __init__(self, layout: str, kind: str = "scale"):
        super().__init__()
        self.layout, self.kind = layout, kind
        shape = {"scale": (D,), "matrix": (D, D), "positional": (LENGTH, D)}[kind]
        self.weight = nn.Parameter(torch.randn(shape) * 0.3 + (1.0 if kind == "scale" else 0.0))

    def forward(self, h):
        h = _features_last(h, self.layout)
        if self.kind == "scale":
            h = h * self.weight
        elif self.kind == "matrix":
            h = torch.tanh(h @ self.weight)
        else:
            h = h + self.weight
        return _features_back(h, self.layout)


def _feature_mean(h: torch.Tensor, layout: str) -> torch.Tensor:
    """Mean over every dimension but the features: a statistic of the whole batch, shape (D,)."""
    return _features_last(h, layout).reshape(-1, D).mean(0)


def _as_features(v: torch.Tensor, layout: str) -> torch.Tensor:
    """A (D,) vector shaped to broadcast over the layout's features."""
    return v.reshape(D, 1, 1) if layout == "img" else v


class RunningCenter(nn.Module):
    """Keeps a running mean of its input in a buffer, updated in training forwards; ``use``: subtract it."""

    def __init__(self, layout: str, use: bool = True):
        super().__init__()
        self.layout, self.use = layout, use
        self.register_buffer("running_mean", torch.zeros(D))

    def forward(self, h):
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * _feature_mean(h.float(), self.layout))
        return h - _as_features(self.running_mean, self.layout).to(h.dtype) if self.use else h


class ActivationCache(nn.Module):
    """Remembers its last input's mean over the batch in an attribute and adds a tenth of it next time
    (``when``: in training forwards only, or in every forward)."""

    def __init__(self, layout: str, when: str = "train"):
        super().__init__()
        self.layout, self.when = layout, when
        self.previous: torch.Tensor | None = None

    def forward(self, h):
        out = h if self.previous is None else h + 0.1 * self.previous.to(h.dtype)
        if self.training or self.when == "always":
            self.previous = h.detach().mean(0)
        return out


class RunningMax(nn.Module):
    """Divides by the largest magnitude seen so far, a Python float kept on the module."""

    def __init__(self, layout: str):
        super().__init__()
        self.largest = 1.0

    def forward(self, h):
        if self.training:
            self.largest = max(self.largest, float(h.detach().abs().max()))
        return h / self.largest


class StepCounter(nn.Module):
    """Counts its training forwards in a buffer (e.g. for a warm-up schedule); passes its input on."""

    def __init__(self, layout: str):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, h):
        if self.training:
            self.calls += 1
        return h


class WeightAverage(nn.Module):
    """A linear layer that keeps an average of its own weight in a buffer, updated in forward: a value
    of public weights only."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout, self.fc = layout, nn.Linear(D, D)
        self.register_buffer("average", self.fc.weight.detach().clone())

    def forward(self, h):
        if self.training:
            with torch.no_grad():
                self.average.mul_(0.9).add_(0.1 * self.fc.weight)
        return _features_back(torch.tanh(self.fc(_features_last(h, self.layout))), self.layout)


class _MixBackward(torch.autograd.Function):
    """Identity forward; the backward adds the batch's summed gradient to every example's."""

    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        return g + g.sum(0, keepdim=True)


class Mix(nn.Module):
    """Mixes the examples of the batch while ``active`` (the training loop switches it on at a step):

    ``mean``: subtracts the batch mean; ``pairwise``: adds half the previous example; ``positional``:
    only the middle example gets its predecessor added; ``data``: examples whose first feature is
    positive share their sum; ``backward``: identity forward, mixing output gradients."""

    def __init__(self, layout: str, kind: str = "mean"):
        super().__init__()
        self.kind, self.active = kind, True

    def forward(self, h):
        if not self.active:
            return h
        if self.kind == "mean":
            return h - h.mean(0, keepdim=True)
        if self.kind == "pairwise":
            return h + 0.5 * h.roll(1, 0)
        if self.kind == "positional":
            middle = h.shape[0] // 2
            if middle == 0:
                return h
            shift = torch.zeros_like(h)
            shift[middle] = h[middle - 1]
            return h + shift
        if self.kind == "data":
            gate = (h.reshape(h.shape[0], -1)[:, 0] > 0).to(h.dtype).reshape(-1, *([1] * (h.dim() - 1)))
            return h + gate * (gate * h).sum(0, keepdim=True)
        return _MixBackward.apply(h)


# ------------------------------------------------------- state kept where a guard of attributes does not look
class _Carried(nn.Module):
    """A block that keeps a statistic of the training batches (their feature mean) and uses it in its
    output. ``order``: "update-first" (the batch's own statistic reaches its output at once, and is carried
    into the next steps) or "use-first" (only earlier batches' statistics, from the next step on);
    ``update=False``: the state is a public constant that is only read (a variant that does not leak).
    Subclasses say where the state lives (``remember``, ``recalled``); the output is ``h − recalled``."""

    def __init__(self, layout: str, order: str = "update-first", update: bool = True):
        super().__init__()
        self.layout, self.order, self.update = layout, order, update

    def forward(self, h):
        writes = self.update and self.training
        if writes and self.order == "update-first":
            self.remember(_feature_mean(h.detach().float(), self.layout))
        out = self.use(h)
        if writes and self.order == "use-first":
            self.remember(_feature_mean(h.detach().float(), self.layout))
        return out

    def use(self, h):
        return h - _as_features(self.recalled().to(h.dtype), self.layout)

    def remember(self, mean: torch.Tensor) -> None:
        raise NotImplementedError

    def recalled(self) -> torch.Tensor:
        raise NotImplementedError


def _public_centre() -> torch.Tensor:
    return torch.linspace(-0.5, 0.5, D)


class ClassCentre(_Carried):
    """A running mean in a tensor defined on the class (``centre = torch.zeros(D)`` in the class body),
    updated in place: every instance, and every model built in the process, shares it."""

    centre = _public_centre()

    def remember(self, mean):
        with torch.no_grad():
            self.centre.mul_(0.9).add_(0.1 * mean)

    def recalled(self):
        return self.centre


class RunningMeanHelper:
    """A plain-Python helper a user keeps on the model: a running mean as a NumPy array."""

    def __init__(self, size: int):
        self.mean, self.count = _public_centre().double().numpy(), 0

    def update(self, value: np.ndarray) -> None:
        self.count += 1
        self.mean = 0.9 * self.mean + 0.1 * value


class ForeignState(_Carried):
    """A running mean kept in a foreign (non-torch) object on the module."""

    def __init__(self, layout: str, order: str = "update-first", update: bool = True):
        super().__init__(layout, order, update)
        self.stats = RunningMeanHelper(D)

    def remember(self, mean):
        self.stats.update(mean.double().numpy())

    def recalled(self):
        return torch.from_numpy(self.stats.mean)


class Prototypes(_Carried):
    """A memory of 100 prototype vectors in a Python list that each example reads by attention; a training
    forward moves the prototype nearest the batch's mean towards it, in place."""

    COUNT = 100

    def __init__(self, layout: str, order: str = "update-first", update: bool = True):
        super().__init__(layout, order, update)
        g = torch.Generator().manual_seed(0)
        self.prototypes = [torch.randn(D, generator=g) for _ in range(self.COUNT)]

    def remember(self, mean):
        nearest = int((torch.stack(self.prototypes) @ mean).argmax())
        self.prototypes[nearest].mul_(0.5).add_(0.5 * mean)

    def use(self, h):
        memory = torch.stack(self.prototypes).to(h.dtype)
        f = _features_last(h, self.layout)
        return _features_back(f + 0.1 * torch.softmax(f @ memory.T, -1) @ memory, self.layout)


class RecentFeatures(_Carried):
    """The feature means of the last ``maxlen`` training batches in a ``collections.deque(maxlen=…)``;
    once it is full, their mean is subtracted (so a run uses them from its ``maxlen``-th step on, or
    from the next one with ``order="use-first"``)."""

    def __init__(self, layout: str, order: str = "update-first", update: bool = True, maxlen: int = 2):
        super().__init__(layout, order, update)
        self.recent: collections.deque = collections.deque(maxlen=maxlen)
        if not update:
            self.recent.extend(_public_centre() * k for k in range(maxlen))

    def remember(self, mean):
        self.recent.append(mean)

    def use(self, h):
        if len(self.recent) < self.recent.maxlen:
            return h
        return super().use(h)

    def recalled(self):
        return torch.stack(list(self.recent)).mean(0)


RUNNING_MEAN = _public_centre()  # a module-level running mean (GlobalState)


class GlobalState(_Carried):
    """A running mean in a module-level global (``global RUNNING_MEAN`` in forward)."""

    def remember(self, mean):
        global RUNNING_MEAN
        RUNNING_MEAN = 0.9 * RUNNING_MEAN + 0.1 * mean

    def recalled(self):
        return RUNNING_MEAN


def fresh_process() -> None:
    """The state a new Python process starts with: the class-level and module-level values of the blocks
    above (each private run of the oracle is a process of its own)."""
    global RUNNING_MEAN
    ClassCentre.centre = _public_centre()
    RUNNING_MEAN = _public_centre()


# --------------------------------------------------------------------- scales computed in the backward
def _rows(scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return scale.reshape(-1, *([1] * (g.dim() - 1)))


def _unit_gradient(g: torch.Tensor, over: str) -> torch.Tensor:
    """``g / g.norm()``: the whole batch's gradient to norm 1 (``over`` "batch"), or each example's row."""
    if over == "batch":
        return g / g.norm().clamp_min(1e-12)
    return g / _rows(g.flatten(1).norm(dim=1).clamp_min(1e-12), g)


class _RescaleBackward(torch.autograd.Function):
    """Identity forward; the backward divides the output gradient by its mean magnitude, over the whole
    batch or over each example's row."""

    @staticmethod
    def forward(ctx, h, over):
        ctx.over = over
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.over == "batch":
            return g / g.abs().mean().clamp_min(1e-12), None
        return g / _rows(g.flatten(1).abs().mean(1).clamp_min(1e-12), g), None


class GradScale(nn.Module):
    """Rescales the gradient flowing back through it, in ways users stabilise training with: ``how``
    "tensor-hook" (``h.register_hook(lambda g: g / g.norm())``) or "function" (a custom
    ``autograd.Function`` dividing by the gradient's mean magnitude); ``over`` "batch" (one scalar from the
    whole batch's gradient: each example's gradient then depends on the others, yet no row is zeroed) or
    "example" (each example's row by its own statistic: exact)."""

    def __init__(self, layout: str, how: str = "tensor-hook", over: str = "batch"):
        super().__init__()
        self.how, self.over = how, over

    def forward(self, h):
        if self.how == "function":
            return _RescaleBackward.apply(h, self.over)
        out = h.clone()
        if out.requires_grad:
            out.register_hook(lambda g: _unit_gradient(g, self.over))
        return out


BLOCKS: dict[str, tuple[type[nn.Module], tuple[str, ...]]] = {
    # kind: (class, layouts it accepts)
    "dense": (Dense, ("vec", "seq", "img")),
    "norm": (Norm, ("vec", "seq", "img")),
    "conv": (Conv, ("seq", "img")),
    "recurrent": (Recurrent, ("seq",)),
    "attention": (Attention, ("seq",)),
    "encoder": (Encoder, ("seq",)),
    "custom": (Custom, ("vec", "seq", "img")),
    "running_center": (RunningCenter, ("vec", "seq", "img")),
    "activation_cache": (ActivationCache, ("vec", "seq", "img")),
    "running_max": (RunningMax, ("vec", "seq", "img")),
    "step_counter": (StepCounter, ("vec", "seq", "img")),
    "weight_average": (WeightAverage, ("vec", "seq", "img")),
    "mix": (Mix, ("vec", "seq", "img")),
    "class_state": (ClassCentre, ("vec", "seq", "img")),
    "foreign_state": (ForeignState, ("vec", "seq", "img")),
    "prototypes": (Prototypes, ("vec", "seq", "img")),
    "recent_deque": (RecentFeatures, ("vec", "seq", "img")),
    "global_state": (GlobalState, ("vec", "seq", "img")),
    "grad_scale": (GradScale, ("vec", "seq", "img")),
}
# blocks that keep what they saw of a batch (the unseen ones keep it unless built with update=False)
UNSEEN_STATE = {"class_state", "foreign_state", "prototypes", "recent_deque", "global_state"}
STATEFUL = {"running_center", "activation_cache", "running_max", "step_counter", "weight_average",
            *UNSEEN_STATE}


def keeps_state(block: Block) -> bool:
    """Whether the block writes what it saw of a training batch into the model or the process."""
    return block.kind in STATEFUL and block.kwargs().get("update", True)


def scales_backward_by_batch(block: Block) -> bool:
    """Whether the block rescales its gradient by a statistic of the whole batch."""
    return block.kind == "grad_scale" and block.kwargs().get("over", "batch") == "batch"


# -------------------------------------------------------------------------------------------- hooks
def _sin_output(module, inputs, output):
    return torch.sin(output) * 2


def _double_input(module, inputs):
    return tuple(t * 2 if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)


def _record_output(module, inputs, output):
    with torch.no_grad():
        module.hook_total += output.detach().float().abs().sum()


def _mix_output(module, inputs, output):
    return output + output.mean(0, keepdim=True)


def _halve_input_gradient(module, grad_input, grad_output):
    return tuple(None if g is None else g * 0.5 for g in grad_input)


def _record_gradient_norm(module, grad_input, grad_output):
    with torch.no_grad():
        module.hook_total.copy_(grad_output[0].detach().float().norm())


def _mix_input_gradient(module, grad_input, grad_output):
    return tuple(None if g is None else g + g.sum(0, keepdim=True) for g in grad_input)


def _clip_input_gradient(module, grad_input, grad_output):
    """Clip the gradient flowing into the trunk to norm 0.01 — its norm over the whole batch."""
    return tuple(None if g is None else g / torch.clamp(g.norm() / 0.01, min=1.0) for g in grad_input)


def _clip_input_gradient_per_example(module, grad_input, grad_output):
    """Clip each example's row of the gradient flowing into the trunk to norm 0.01."""
    return tuple(None if g is None else g / _rows(torch.clamp(g.flatten(1).norm(dim=1) / 0.01, min=1.0), g)
                 for g in grad_input)


HOOKS = {
    # kind: (registration, function, whether it needs a 'hook_total' buffer on the module)
    "forward_sin": ("forward", _sin_output, False),
    "forward_pre_double": ("forward_pre", _double_input, False),
    "forward_record": ("forward", _record_output, True),
    "forward_mix": ("forward", _mix_output, False),
    "backward_halve": ("backward", _halve_input_gradient, False),
    "backward_record": ("backward", _record_gradient_norm, True),
    "backward_mix": ("backward", _mix_input_gradient, False),
    "backward_clip_batch": ("backward", _clip_input_gradient, False),
    "backward_clip_example": ("backward", _clip_input_gradient_per_example, False),
}
MIXING_HOOKS = {"forward_mix", "backward_mix"}
BATCH_SCALE_HOOKS = {"backward_clip_batch"}  # a scalar of the whole batch's gradient; no row zeroed
ROW_SCALE_HOOKS = {"backward_clip_example"}    # each example's row by its own norm (not linear in it)
RECORDING_HOOKS = {"forward_record", "backward_record"}


# ---------------------------------------------------------------------------------------- the model
class Stem(nn.Module):
    def __init__(self, inputs: str, max_norm: float | None):
        super().__init__()
        self.inputs = inputs
        if inputs == "tokens":
            self.layer = nn.Embedding(VOCAB, D, max_norm=max_norm)
        elif inputs == "image":
            self.layer = nn.Conv2d(CHANNELS, D, 3, padding=1)
        else:
            self.layer = nn.Linear(FEATURES, D)

    def forward(self, x):
        return self.layer(x)


class FuzzNet(nn.Module):
    """stem → blocks → pool → head."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        layout = STEM_LAYOUT[spec.inputs]
        self.stem = Stem(spec.inputs, spec.max_norm)
        blocks = []
        for block in spec.blocks:
            cls, layouts = BLOCKS[block.kind]
            if layout not in layouts:
                raise ValueError(f"block {block} does not take the {layout} layout")
            blocks.append(cls(layout, **block.kwargs()))
        self.blocks = nn.Sequential(*blocks)
        self.layout = layout
        self.head = nn.Linear(D, spec.classes, bias=not spec.tied_head)
        if spec.tied_head:
            self.head.weight = self.stem.layer.weight

    def forward(self, x):
        h = self.blocks(self.stem(x))
        if self.layout == "img":
            h = h.mean((2, 3))
        elif self.layout == "seq" and self.spec.pool != "tokens":
            h = h.mean(1) if self.spec.pool == "mean" else h[:, -1]
        return self.head(h)


def build_model(spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32) -> FuzzNet:
    """The model of ``spec`` with weights from ``seed``, its hooks registered, in train mode."""
    torch.manual_seed(seed)
    model = FuzzNet(spec)
    for hook in spec.hooks:
        if hook.at == -1:
            target = model.head
        elif hook.at == -2:
            target = model.stem.layer
        else:
            target = model.blocks[hook.at]
        how, function, needs_buffer = HOOKS[hook.kind]
        if needs_buffer and not hasattr(target, "hook_total"):
            target.register_buffer("hook_total", torch.zeros(()))
        if how == "forward":
            target.register_forward_hook(function)
        elif how == "forward_pre":
            target.register_forward_pre_hook(function)
        else:
            target.register_full_backward_hook(function)
    return model.to(dtype).train()


def input_batch(spec: ModelSpec, examples: int, seed: int, dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:
    """``examples`` inputs for ``spec``; floats are large enough that clipping at R = 1 is active."""
    g = torch.Generator().manual_seed(seed)
    if spec.inputs == "tokens":
        return torch.randint(0, VOCAB, (examples, LENGTH), generator=g)
    shape = {"dense": (FEATURES,), "seq": (LENGTH, FEATURES), "image": (CHANNELS, SIDE, SIDE)}[spec.inputs]
    return (torch.randn(examples, *shape, generator=g) * 5).to(dtype)


IGNORE = -100  # a target token that is padding (PyTorch's and Hugging Face's ignore_index)


def targets(spec: ModelSpec, examples: int, seed: int, regression: bool,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Class ids, regression targets, or (``pool="tokens"``) a class id per token with the padding past
    each example's own length (1 to LENGTH tokens) set to ``IGNORE``."""
    g = torch.Generator().manual_seed(seed + 7)
    if spec.pool == "tokens":
        y = torch.randint(0, spec.classes, (examples, LENGTH), generator=g)
        lengths = torch.randint(1, LENGTH + 1, (examples, 1), generator=g)
        return y.masked_fill(torch.arange(LENGTH) >= lengths, IGNORE)
    if regression:
        return torch.randn(examples, spec.classes, generator=g).to(dtype)
    return torch.randint(0, spec.classes, (examples,), generator=g)
