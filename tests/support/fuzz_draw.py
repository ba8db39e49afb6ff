"""The leak fuzzer's draws: an ordinary model (``fuzz_zoo``) and an ordinary private training loop, drawn
from a seed, and the runner that trains one draw on given data and records what it released.

The runner is the oracle's instrument, not part of the draw: noise 0, a clip function at R (Abadi,
AUTO-S, or one an extension registers), sampling rate 1 (the loader's batch size is the data set's size)
and learning rate 0, so the weights stay public (they never move) and each step's ``.grad`` times the
expected batch size is the released clipped sum. Everything else — layers, buffers, hooks, mixing, the
loop, its sampler, precision, loss — is what the draw says. ``UncheckedEngine`` runs a draw with no check
at all (the oracle's reference for a library that refuses nothing), so that the fuzzer's tests can show
that each leaking piece of the zoo leaks and the oracle sees it.
"""

from __future__ import annotations

import collections
import contextlib
import random
import traceback
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset, WeightedRandomSampler

import tunefree
from support.fuzz_zoo import (
    BLOCKS,
    HOOKS,
    IGNORE,
    INPUTS,
    STATEFUL,
    STEM_LAYOUT,
    B,
    Hook,
    Mix,
    ModelSpec,
    build_model,
    fresh_process,
    input_batch,
    targets,
)
from support.neighbour import RunTrace
from tunefree.clipping.functions import CLIP_FUNCTIONS, clip_function
from tunefree.guards.independence import Independence, first_levels

R = 1.0
TUNEFREE_SOURCE = str(Path(tunefree.__file__).parent)


# ------------------------------------------------------------------ clip functions of an extension
# Registered the way docs and tunefree.extend show it (``extension_clip``). Two read the whole batch's norms
# (each keeps w_i·‖g_i‖ ≤ R, so a per-example bound check passes, yet one example moves every other's
# weight); two weigh each example by its own norm (exact).
@dataclass(frozen=True)
class ClipByLargest(tunefree.extend.ClipFunction):
    """Scales every example by R over the largest norm of the batch ("normalise by the largest")."""

    normalising = False

    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        return torch.full_like(norms, threshold) / norms.max().clamp_min(1e-30)


@dataclass(frozen=True)
class ClipAtMeanNorm(tunefree.extend.ClipFunction):
    """Clips at the batch's mean norm: min(R/‖g_i‖, R/mean_j ‖g_j‖)."""

    normalising = False

    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        return torch.minimum(threshold / norms.clamp_min(1e-30), threshold / norms.mean().clamp_min(1e-30))


@dataclass(frozen=True)
class SoftClip(tunefree.extend.ClipFunction):
    """R·tanh(‖g‖/R)/‖g‖, each example by its own norm."""

    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        return threshold * torch.tanh(norms / threshold) / norms.clamp_min(1e-30)


@dataclass(frozen=True)
class OffsetClip(tunefree.extend.ClipFunction):
    """R/(‖g‖ + 0.1), each example by its own norm."""

    def weigh(self, norms: torch.Tensor, threshold: float) -> torch.Tensor:
        return threshold / (norms + 0.1)


EXTENSION_CLIPS: dict[str, type[tunefree.extend.ClipFunction]] = {
    "fuzz-batch-max": ClipByLargest, "fuzz-batch-mean": ClipAtMeanNorm, "fuzz-soft": SoftClip,
    "fuzz-offset": OffsetClip,
}


@contextlib.contextmanager
def extension_clip(name: str):
    """The extension's clip function ``name`` registered with ``@tunefree.extend.register_clip_function``,
    as a user writes it, while ``make_private`` reads it, then unregistered: the registry is the
    process's, and other tests iterate over it. A refused registration refuses the draw."""
    if name not in EXTENSION_CLIPS:
        yield
        return
    tunefree.extend.register_clip_function(name)(EXTENSION_CLIPS[name])
    try:
        yield
    finally:
        CLIP_FUNCTIONS.pop(name, None)


def clip_weights(name: str):
    """``weigh(norms, threshold)`` of the clip function ``name``, registered or not, as its code is
    written: called on every norm of the batch at once (what tunefree no longer does, for the check-free
    reference)."""
    own = {"fuzz-batch-max": ClipByLargest().weigh, "fuzz-batch-mean": ClipAtMeanNorm().weigh,
           "fuzz-soft": SoftClip().weigh,
           "fuzz-offset": lambda norms, threshold: OffsetClip().weigh(norms.double(), threshold)}
    return own[name] if name in own else clip_function(name).weigh


CLIPPINGS = {"abadi": False, "auto-s": False, "fuzz-batch-max": True, "fuzz-batch-mean": True,
             "fuzz-soft": False, "fuzz-offset": False}  # name: whether its weights read the batch
SAMPLERS = {None: False, "random": False, "weighted": False, "random-replacement": True,
            "weighted-replacement": True}  # poisson_sampling=False: whether it may repeat an example


@dataclass(frozen=True)
class LoopSpec:
    """An ordinary private training loop.

    loader: ``poisson`` (iterate ``engine.data_loader``), ``own`` (iterate the user's own fixed-batch
        loader instead), ``poisson-off`` (``make_private(poisson_sampling=False)``).
    physical: ``physical_batch_size`` (micro-batches of a logical batch).
    extra_forward: ``no-grad`` (a forward of the batch without gradients before the training one),
        ``eval-public`` / ``eval-private`` (after each step, an eval-mode forward on public data / on the
        private batch).
    split: ``halves`` (two forwards over the halves of the batch, one backward of the summed loss),
        ``examples`` (a forward per example, one backward), ``accumulate`` (a backward per half),
        ``subset`` (train on the examples whose first input value is positive).
    resume_at: before this step, save the run (engine, model, optimizer, scaler state), rebuild
        everything and ``make_private`` again; ``resume_engine_state=False`` forgets to load the
        engine's state (the ledger).
    precision: ``float32``, ``float64``, ``bf16`` (autocast), ``fp16`` (autocast and a GradScaler with
        ``init_scale``).
    loss, reduction: ``ce``, ``mse``, ``energy`` (no targets) or ``token-ce`` (a class per token, the
        model's ``pool="tokens"``), summed or averaged over the batch; ``declared``: the
        ``loss_reduction`` given to make_private (``None``: ``reduction``, as a user would write it).
    token_mean: ``token-ce``: ``example`` (each example's mean over its valid tokens, then ``reduction``
        over examples) or ``batch`` (a mean over every valid token of the batch, Hugging Face's causal-LM
        loss: each example weighs its share of the batch's tokens, whatever ``reduction`` says).
    target_norm: ``mse``: targets standardised inside the loss, by the ``batch``'s mean and std (mixes
        the examples) or by each ``example``'s own.
    clipping: a name in ``CLIPPINGS`` (Abadi, AUTO-S, or a clip function of an extension).
    sampler: ``poisson-off``: the loader's sampler (``SAMPLERS``; ``None``: ``shuffle=True``), drawing
        as many examples as the data set holds, with or without replacement.
    mix_before: mixing of the batch in the loop, before the model (``mixup``, ``standardise``,
        ``cutmix``, ``token_swap``); it and every ``Mix`` block in the model start at step
        ``mix_start``.
    """

    examples: int = 4
    steps: int = 2
    loader: str = "poisson"
    physical: int | None = None
    extra_forward: str | None = None
    split: str | None = None
    resume_at: int | None = None
    resume_engine_state: bool = True
    optimizer: str = "sgd"
    precision: str = "float32"
    init_scale: float = 2.0 ** 16
    loss: str = "ce"
    reduction: str = "sum"
    declared: str | None = None
    token_mean: str = "example"
    target_norm: str | None = None
    clipping: str = "abadi"
    sampler: str | None = None
    groups: str = "all-layer"
    verify_every: int | None = None
    mix_before: str | None = None
    mix_start: int = 0

    def __repr__(self) -> str:
        defaults = LoopSpec()
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if getattr(self, f.name) != getattr(defaults, f.name)]
        return f"LoopSpec({', '.join(parts)})"


@dataclass
class DrawTrace(RunTrace):
    """A ``RunTrace`` that also says, for each release, whether the run checked that step (the
    independence and input checks), whether the loop trained the model on data in it (a subset may
    come out empty), and how many times the loop's loader handed out the example it handed out most."""

    checked: list[bool] = field(default_factory=list)
    fed: list[bool] = field(default_factory=list)
    repeats: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Draw:
    model: ModelSpec
    loop: LoopSpec
    seed: int = 0  # weights, data, and the private run's seed (which steps it checks, on which examples)

    def __repr__(self) -> str:
        return f"Draw({self.model!r}, {self.loop!r}, seed={self.seed})"


# ------------------------------------------------------------------------------------------ sampling
def _block_args(kind: str, layout: str, rng: random.Random) -> dict[str, object]:
    if kind == "norm":
        choices = ["layer", "group", "batch"] + (["instance"] if layout != "vec" else [])
        norm = rng.choice(choices)
        args: dict[str, object] = {"kind": norm, "affine": rng.random() < 0.6}
        if norm in ("instance", "batch"):
            args["running"] = rng.random() < 0.5
        return args
    if kind == "recurrent":
        return {"kind": rng.choice(["lstm", "gru", "rnn"])}
    if kind == "attention":
        return {"causal": rng.random() < 0.4}
    if kind == "custom":
        return {"kind": rng.choice(["scale", "matrix"] + (["positional"] if layout == "seq" else []))}
    if kind == "running_center":
        return {"use": rng.random() < 0.7}
    if kind == "activation_cache":
        return {"when": rng.choice(["train", "always"])}
    if kind == "mix":
        return {"kind": rng.choice(["mean", "pairwise", "positional", "data", "backward"])}
    if kind in ("class_state", "foreign_state", "prototypes", "recent_deque", "global_state"):
        args = {"order": rng.choice(["update-first", "use-first"]), "update": rng.random() < 0.65}
        if kind == "recent_deque":
            args["maxlen"] = rng.choice([1, 2, 3])
        return args
    if kind == "grad_scale":
        return {"how": rng.choice(["tensor-hook", "function"]), "over": rng.choice(["batch", "example"])}
    return {}


# how often each block is drawn: ordinary layers three times as often as a block that keeps state or
# mixes examples; the state kept where a guard of attributes does not look, and the gradient rescaling,
# shared out so that exact draws stay common
_NEW_BLOCKS = {"class_state": 0.5, "foreign_state": 0.5, "prototypes": 0.5, "recent_deque": 0.5,
               "global_state": 0.5, "grad_scale": 1.0}


def _block_weight(kind: str) -> float:
    if kind in _NEW_BLOCKS:
        return _NEW_BLOCKS[kind]
    return 1.0 if kind in STATEFUL or kind == "mix" else 3.0


def sample_model(rng: random.Random) -> ModelSpec:
    inputs = rng.choice(INPUTS)
    layout = STEM_LAYOUT[inputs]
    kinds = [k for k, (_, layouts) in BLOCKS.items() if layout in layouts]
    weights = [_block_weight(k) for k in kinds]
    count = rng.choice([0, 1, 1, 2, 2, 3])
    blocks = tuple(B(k, **_block_args(k, layout, rng)) for k in rng.choices(kinds, weights, k=count))
    hooks: tuple[Hook, ...] = ()
    if rng.random() < 0.25:
        hooks = (Hook(rng.choice(list(range(len(blocks))) + [-1, -2]), rng.choice(sorted(HOOKS))),)
    tokens = inputs == "tokens"
    pool = "mean"
    if layout == "seq":  # a prediction per token (a token loss) in one sequence draw of five
        pool = "tokens" if rng.random() < 0.2 else rng.choice(["mean", "last"])
    return ModelSpec(inputs=inputs, blocks=blocks, hooks=hooks,
                     max_norm=1.0 if tokens and rng.random() < 0.3 else None,
                     tied_head=tokens and rng.random() < 0.2, pool=pool)


def _weighted(rng: random.Random, options: dict[object, float]) -> object:
    return rng.choices(list(options), weights=list(options.values()))[0]


def sample_loop(rng: random.Random, model: ModelSpec, outside: bool = False) -> LoopSpec:
    """A loop for ``model``. ``outside``: also draw the user errors no invariant can see, which
    docs/refusals.md lists under what tunefree cannot detect: a ``loss_reduction`` declared wrongly; a
    resume that forgets the engine's state (the optimizer's state, loaded before make_private, is taken
    for training outside the guarantee, such as public pre-training); mixing before the model with
    ``poisson_sampling=False`` (the batches are the user's, whose inputs tunefree does not check: the
    guarantee is labelled an approximation and the loop is the user's), or a swap of a few tokens between
    examples (below the half of a row that the integer input check sees); a loss the loop writes that mixes
    examples with labels that are not the private loader's (a token mean over the batch, targets
    standardised by the batch, under ``poisson_sampling=False``: the loss check sees the private loader's
    labels only)."""
    steps = _weighted(rng, {1: 0.2, 2: 0.5, 3: 0.3})
    deque = max((b.kwargs().get("maxlen", 0) for b in model.blocks if b.kind == "recent_deque"), default=0)
    steps = max(steps, deque)  # a deque of recent batches is read within the run
    loader = _weighted(rng, {"poisson": 0.75, "own": 0.1, "poisson-off": 0.15})
    resume_at = rng.randint(1, steps - 1) if steps > 1 and rng.random() < 0.2 else None
    forget = resume_at is not None and rng.random() < 0.2 and outside
    reduction = rng.choice(["sum", "mean"])
    misdeclared = outside and rng.random() < 0.15
    optimizer = _weighted(rng, {"sgd": 0.6, "momentum": 0.2, "adam": 0.2})
    mixes = any(b.kind == "mix" for b in model.blocks)
    mix_before = None
    if rng.random() < 0.15:
        mix_before = {"tokens": "token_swap", "image": rng.choice(["mixup", "standardise", "cutmix"])}.get(
            model.inputs, rng.choice(["mixup", "standardise"]))
    mix_start = 1 if (mixes or mix_before) and steps > 1 and rng.random() < 0.3 else 0
    if (loader == "poisson-off" or mix_before == "token_swap") and not outside:
        # inputs not from tunefree's loader are not checked; a swap of two tokens between examples is
        # below what the integer input check sees (half of a row, docs/refusals.md): outside the invariants
        mix_before = None
        mix_start = mix_start if mixes else 0
    loss = "token-ce" if model.pool == "tokens" else _weighted(rng, {"ce": 0.7, "mse": 0.15, "energy": 0.15})
    sampler = None
    if loader == "poisson-off":
        sampler = _weighted(rng, {None: 0.4, "random": 0.15, "weighted": 0.15, "random-replacement": 0.15,
                                  "weighted-replacement": 0.15})
    return LoopSpec(
        examples=rng.choice([3, 4, 5]), steps=steps, loader=loader,
        physical=2 if loader == "poisson" and rng.random() < 0.25 else None,
        extra_forward=_weighted(rng, {None: 0.6, "no-grad": 0.15, "eval-public": 0.15, "eval-private": 0.1}),
        split=_weighted(rng, {None: 0.8, "halves": 0.05, "examples": 0.05, "accumulate": 0.05,
                              "subset": 0.05}),
        resume_at=resume_at, resume_engine_state=not forget,
        optimizer=optimizer,
        precision=_weighted(rng, {"float32": 0.55, "float64": 0.1, "bf16": 0.15, "fp16": 0.2}),
        init_scale=rng.choice([2.0 ** 8, 2.0 ** 16, 2.0 ** 24]),
        loss=loss, reduction=reduction,
        declared={"sum": "mean", "mean": "sum"}[reduction] if misdeclared else None,
        # a loss written in the loop that mixes examples (a token mean over the batch, targets standardised
        # by the batch): the loss check replays it from the outputs and the private loader's labels; with
        # labels from elsewhere (poisson_sampling=False) it is outside what tunefree sees
        token_mean=rng.choice(["example", "batch"] if outside or loader == "poisson" else ["example"])
        if loss == "token-ce" else "example",
        target_norm=_weighted(rng, {None: 0.5, "batch": 0.3, "example": 0.2} if outside or loader == "poisson"
                              else {None: 0.6, "example": 0.4}) if loss == "mse" else None,
        clipping=_weighted(rng, {"abadi": 0.7, "auto-s": 0.15, "fuzz-batch-max": 0.04,
                                 "fuzz-batch-mean": 0.04, "fuzz-soft": 0.035, "fuzz-offset": 0.035}),
        sampler=sampler,
        groups=_weighted(rng, {"all-layer": 0.8, "per-layer": 0.2}),
        verify_every=_weighted(rng, {None: 0.8, 1: 0.2}),
        mix_before=mix_before, mix_start=mix_start)


def sample_draw(seed: int, outside: bool = False) -> Draw:
    """The draw of ``seed``: the same seed gives the same draw (``outside``: see ``sample_loop``)."""
    rng = random.Random(seed)
    model = sample_model(rng)
    loop = sample_loop(rng, model, outside)
    if loop.precision != "fp16":
        loop = replace(loop, init_scale=LoopSpec.init_scale)
    return Draw(model, loop, seed)


# -------------------------------------------------------------------------------------------- data
def dtype_of(loop: LoopSpec) -> torch.dtype:
    return torch.float64 if loop.precision == "float64" else torch.float32


def draw_data(draw: Draw, seed_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw's private data set D (``seed_offset`` 1: the other data the carry run's history sees)."""
    n, dtype = draw.loop.examples, dtype_of(draw.loop)
    seed = draw.seed * 10 + seed_offset
    return (input_batch(draw.model, n, seed, dtype),
            targets(draw.model, n, seed, draw.loop.loss == "mse", dtype))


# -------------------------------------------------------------------------------------- the loop
def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.0)
    return torch.optim.SGD(params, lr=0.0, momentum=0.9 if kind == "momentum" else 0.0)


def _autocast(loop: LoopSpec):
    if loop.precision in ("bf16", "fp16"):
        return torch.autocast("cpu", dtype=torch.bfloat16 if loop.precision == "bf16" else torch.float16)
    return contextlib.nullcontext()


def _loss(loop: LoopSpec, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if loop.loss == "energy":  # no targets: a per-example energy of the outputs (an autoencoder's kind)
        per_example = out.pow(2).sum(-1)
        return per_example.sum() if loop.reduction == "sum" else per_example.mean()
    if loop.loss == "token-ce":
        if loop.token_mean == "batch":  # Hugging Face's causal-LM loss: the mean over the batch's tokens
            return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        per_token = F.cross_entropy(out.transpose(1, 2), y, ignore_index=IGNORE, reduction="none")
        per_example = per_token.sum(1) / (y != IGNORE).sum(1)
        return per_example.sum() if loop.reduction == "sum" else per_example.mean()
    if loop.loss == "mse":
        y = y.to(out.dtype)
        if loop.target_norm == "batch":  # targets standardised by the batch's own statistics
            y = (y - y.mean(0)) / (y.std(0, correction=0) + 1e-3)
        elif loop.target_norm == "example":
            y = (y - y.mean(-1, keepdim=True)) / (y.std(-1, correction=0, keepdim=True) + 1e-3)
        return F.mse_loss(out, y, reduction=loop.reduction)
    return F.cross_entropy(out, y, reduction=loop.reduction)


def mix_inputs(kind: str, x: torch.Tensor) -> torch.Tensor:
    """Batch-level mixing a user might do in the loop, before the model."""
    if len(x) < 2:
        return x
    if kind == "mixup":
        return 0.7 * x + 0.3 * x.flip(0)
    if kind == "standardise":
        return (x - x.mean(0)) / (x.std(0) + 1e-3)
    x = x.clone()
    if kind == "cutmix":
        x[:, :, :2, :2] = x.flip(0)[:, :, :2, :2]
    else:  # token_swap
        x[:, :2] = x.flip(0)[:, :2]
    return x


class EveryPairChecked:
    """The oracle's instrument in place of a run's ``ProbeSchedule``: every step checked (the independence
    check and the input check), each with the levels of the first check, which see every pair (i, j).
    Mixing that the checks can see is then refused at the first step it happens; a run's random steps and
    halves catch it only with the probability ``ProbeSchedule`` states."""

    def due(self, step: int, every: int) -> bool:
        return True

    def levels(self, step: int, n: int, first: bool, ordered: bool = False, passes: int | None = None
               ) -> torch.Tensor:
        return first_levels(n, ordered, passes)


class RecordingDataset(TensorDataset):
    """The private data set as a ``TensorDataset`` that notes which examples are read (``read``), so that
    the oracle can count how often the loop's loader handed out one example."""

    def __init__(self, *tensors: torch.Tensor):
        super().__init__(*tensors)
        self.read: list[int] = []

    def __getitem__(self, index):
        self.read.append(int(index))
        return super().__getitem__(index)


def make_sampler(kind: str, dataset: TensorDataset) -> torch.utils.data.Sampler:
    """The sampler a user hands the loader: ``random`` or ``weighted`` (class-balancing weights, 1 / the
    count of the example's label, for class ids; equal weights otherwise), drawing as many examples as
    the data set holds, ``-replacement``: with replacement."""
    n, replacement = len(dataset), kind.endswith("replacement")
    if kind.startswith("random"):
        return RandomSampler(dataset, replacement=replacement, num_samples=n)
    labels = dataset.tensors[1]
    weights = torch.ones(n, dtype=torch.float64)
    if labels.dim() == 1 and not labels.is_floating_point():
        weights = 1.0 / torch.bincount(labels)[labels].double()
    return WeightedRandomSampler(weights, num_samples=n, replacement=replacement)


class UncheckedEngine:
    """The oracle's reference for "tunefree's checks bypassed": a private step with no check at all, in
    place of ``make_private``'s engine. Each example's gradient of every ``nn.Linear`` is computed from the
    batch's own forward and backward — the layer's input rows times its output-gradient rows, the way an
    engine of hooks computes it — then (times the batch size under a declared mean loss) weighed by the
    draw's clip function at R over one all-layer group, and summed. Whatever the code does across
    examples therefore reaches the release, as it would in a library that does not refuse it. Models
    whose trainable parameters all sit in ``nn.Linear`` layers; loops without micro-batches, resumes or
    loss scaling. Parts of ``DPEngine``'s interface the runner uses: ``data_loader`` (the user's loader
    as it is, as under ``poisson_sampling=False``), ``optimizer`` (itself), ``schedule``, ``steps``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader,
                 loop: LoopSpec):
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        owned = {p for m in linears for p in m.parameters(recurse=False)}
        if any(p.requires_grad and p not in owned for p in model.parameters()) or loop.physical \
                or loop.resume_at is not None or loop.precision == "fp16" or loop.groups != "all-layer":
            raise NotImplementedError("UncheckedEngine takes models of nn.Linear layers, one all-layer "
                                      "group, and loops without micro-batches, resumes or loss scaling")
        self.model, self.inner, self.data_loader = model, optimizer, loader
        self.optimizer, self.param_groups = self, optimizer.param_groups
        self.expected_batch_size = len(loader.dataset)
        self.schedule = SimpleNamespace(checking=False, ends_logical=True)
        self.weigh, self.mean = clip_weights(loop.clipping), (loop.declared or loop.reduction) == "mean"
        self.poisson_approximation = loop.loader == "poisson-off"
        self.steps = 0
        self.calls: dict[nn.Linear, list[list]] = collections.defaultdict(list)
        self.handles = [m.register_forward_hook(self._capture) for m in linears]
        self.pre_hooks: list = []
        self.post_hooks: list = []

    def _capture(self, module: nn.Linear, inputs: tuple, output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and output.requires_grad):
            return
        call = [inputs[0].detach(), None]
        self.calls[module].append(call)
        output.register_hook(lambda g: call.__setitem__(1, g.detach()))

    def _per_example(self) -> dict[nn.Parameter, torch.Tensor]:
        """[B, *shape] gradients of the step's examples, from the captured calls in order."""
        grads: dict[nn.Parameter, list[torch.Tensor]] = collections.defaultdict(list)
        for module, calls in self.calls.items():
            for a, g in calls:
                if g is None:
                    continue
                a, g = a.double().flatten(1, -2) if a.dim() > 2 else a.double().unsqueeze(1), \
                    g.double().flatten(1, -2) if g.dim() > 2 else g.double().unsqueeze(1)
                grads[module.weight].append(torch.einsum("bto,bti->boi", g, a))
                if module.bias is not None:
                    grads[module.bias].append(g.sum(1))
        return {p: torch.cat(parts) for p, parts in grads.items()}

    def step(self) -> None:
        for hook in self.pre_hooks:
            hook(self, (), {})
        per_example = self._per_example()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)  # nothing but the clipped sum is released
        if per_example:
            rows = next(iter(per_example.values())).shape[0]
            scale = rows if self.mean else 1.0
            norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_example.values())) * scale
            weights = self.weigh(norms, R) * scale
            for p, g in per_example.items():
                clipped = torch.einsum("b,b...->...", weights, g)
                p.grad = (clipped / self.expected_batch_size).to(p.dtype)
        self.inner.step()
        self.steps += 1
        for hook in self.post_hooks:
            hook(self, (), {})

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        self.calls.clear()

    def register_step_pre_hook(self, hook) -> None:
        self.pre_hooks.append(hook)

    def register_step_post_hook(self, hook) -> None:
        self.post_hooks.append(hook)

    def guarantee(self) -> SimpleNamespace:
        return SimpleNamespace(poisson_approximation=self.poisson_approximation)

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Run:
    """One private training run of a draw on a data set, recording every release into a ``DrawTrace``
    (``every_pair``: checked by ``EveryPairChecked`` instead of the run's random schedule; ``unchecked``:
    by ``UncheckedEngine`` instead of tunefree). Each run starts as a fresh process would
    (``fuzz_zoo.fresh_process``)."""

    def __init__(self, draw: Draw, dataset: RecordingDataset, trace: DrawTrace, plain: bool = False,
                 every_pair: bool = False, unchecked: bool = False):
        fresh_process()
        self.draw, self.loop, self.dataset, self.trace, self.plain = draw, draw.loop, dataset, trace, plain
        self.every_pair, self.unchecked = every_pair, unchecked
        self.dtype = dtype_of(self.loop)
        self.public = input_batch(draw.model, 3, draw.seed * 10 + 5, self.dtype)
        self.engine = self.scaler = None
        self.checking = True  # whether the run checks the step under way (private runs)
        self.fed = False      # whether the loop trained the model on data in the step under way
        self._start(build_model(draw.model, draw.seed, self.dtype))
        self.own = self._user_loader() if self.loop.loader == "own" or plain else None

    def _user_loader(self) -> DataLoader:
        """The user's loader over the whole data set (one batch a pass): in order for tunefree's Poisson
        loader to replace, shuffled (or with the draw's sampler) otherwise."""
        n, sampler = len(self.dataset), self.loop.sampler
        if sampler is None:
            return DataLoader(self.dataset, batch_size=n, shuffle=self.loop.loader != "poisson")
        return DataLoader(self.dataset, batch_size=n, sampler=make_sampler(sampler, self.dataset))

    def _resample(self) -> None:
        """After the data set's tensors changed: its weighted sampler's weights computed for the new ones
        (as a user builds a class-balancing sampler for the data it samples)."""
        loader = self.own if self.own is not None else self.engine.data_loader
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, WeightedRandomSampler):
            sampler.weights = make_sampler(self.loop.sampler, self.dataset).weights

    def _start(self, model: torch.nn.Module, moments: dict | None = None) -> None:
        """The model's optimizer (with ``moments``: a saved optimizer state) and private run."""
        loop = self.loop
        self.model, self.optimizer = model, _optimizer(loop.optimizer, model)
        if moments is not None:
            self.optimizer.load_state_dict(moments)
        if loop.precision == "fp16":
            self.scaler = torch.amp.GradScaler("cpu", init_scale=loop.init_scale)
        if self.plain:
            return
        loader = self._user_loader()
        if self.unchecked:
            self.engine = UncheckedEngine(model, self.optimizer, loader, loop)
        else:
            with extension_clip(loop.clipping):
                self.engine = tunefree.make_private(
                    model, self.optimizer, loader, target_delta=0.1 / len(self.dataset),
                    noise_multiplier=0.0, steps=loop.steps, clipping=loop.clipping, max_grad_norm=R,
                    groups=loop.groups, loss_reduction=loop.declared or loop.reduction, seed=self.draw.seed,
                    physical_batch_size=loop.physical if loop.loader == "poisson" else None,
                    poisson_sampling=loop.loader != "poisson-off", verify_every=loop.verify_every)
        if self.scaler is not None:
            self.engine.optimizer.attach_grad_scaler(self.scaler)
        if self.every_pair:
            self.engine.guards.of(Independence).probes = EveryPairChecked()
        self.engine.optimizer.register_step_pre_hook(self._note_check)
        self.engine.optimizer.register_step_post_hook(self._record)

    def _note_check(self, optimizer, args, kwargs) -> None:
        """Before a logical step: whether the run checks it (the independence check and the input check,
        ``StepSchedule.checking``, set at the end of the step before)."""
        self.checking = self.engine.schedule.checking

    def _record(self, optimizer, args, kwargs) -> None:
        names = {p: n for n, p in self.model.named_parameters()}
        self.trace.checked.append(self.checking)
        self.trace.fed.append(self.fed)
        self.trace.repeats.append(max(collections.Counter(self.dataset.read).values(), default=0))
        self.dataset.read = []
        self.fed = False
        self.trace.releases.append({
            names[p]: p.grad.detach().double() * optimizer.expected_batch_size
            for group in optimizer.param_groups for p in group["params"] if p.grad is not None})

    def resume(self) -> None:
        """Save everything, rebuild the model and optimizer from scratch, load, make_private again."""
        state = self.engine.state_dict() if self.engine is not None else None
        weights, moments = self.model.state_dict(), self.optimizer.state_dict()
        scaling = self.scaler.state_dict() if self.scaler is not None else None
        if self.engine is not None:
            self.engine.detach()
        model = build_model(self.draw.model, self.draw.seed, self.dtype)
        model.load_state_dict(weights)
        self._start(model, moments)
        if scaling is not None:
            self.scaler.load_state_dict(scaling)
        if state is not None and self.loop.resume_engine_state:
            self.engine.load_state_dict(state)

    def train(self, history: tuple[torch.Tensor, torch.Tensor] | None, private: tuple) -> None:
        loop = self.loop
        for t in range(loop.steps):
            if loop.resume_at == t:
                self.resume()
            if history is not None and t == loop.steps - 1:
                self.dataset.tensors = private  # the carry run's last step sees D
                self._resample()
            active = t >= loop.mix_start
            for module in self.model.modules():
                if isinstance(module, Mix):
                    module.active = active
            torch.manual_seed(1000 + t)
            self.dataset.read = []  # what the loader reads for this step (not make_private's digest)
            for xb, yb in self.own if self.own is not None else self.engine.data_loader:
                self._physical_step(xb, yb, active)
            if loop.extra_forward in ("eval-public", "eval-private"):
                self.model.eval()
                with torch.no_grad(), _autocast(loop):
                    self.model(self.public if loop.extra_forward == "eval-public" else xb)
                self.model.train()

    def _physical_step(self, xb: torch.Tensor, yb: torch.Tensor, active: bool) -> None:
        loop, model = self.loop, self.model
        if loop.mix_before is not None and active:
            xb = mix_inputs(loop.mix_before, xb)
        if loop.extra_forward == "no-grad":
            with torch.no_grad(), _autocast(loop):
                model(xb)
        half = len(xb) // 2
        if loop.split == "subset":  # train on the examples that pass a test of their own values
            keep = xb.flatten(1)[:, 0] > 0
            xb, yb = xb[keep], yb[keep]
            if len(xb) == 0:  # none passed: nothing to train on (the private step still comes)
                self._step()
                return
        self.fed = True
        if loop.split in (None, "subset") or half == 0:
            with _autocast(loop):
                loss = _loss(loop, model(xb), yb)
            self._backward(loss)
        elif loop.split in ("halves", "examples"):
            parts = [xb[:half], xb[half:]] if loop.split == "halves" else list(xb.split(1))
            with _autocast(loop):
                loss = _loss(loop, torch.cat([model(part) for part in parts]), yb)
            self._backward(loss)
        else:
            for part in (slice(0, half), slice(half, None)):
                with _autocast(loop):
                    loss = _loss(loop, model(xb[part]), yb[part])
                self._backward(loss)
        self._step()

    def _step(self) -> None:
        optimizer = self.optimizer if self.engine is None else self.engine.optimizer
        if self.scaler is not None:
            if self.engine is None or self.own is not None or self.engine.schedule.ends_logical:
                self.scaler.step(optimizer)
                self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()

    def _backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()


def _held(value: object, name: str, state: dict[str, object], depth: int = 0) -> None:
    """Add to ``state`` the data ``value`` holds under ``name``: tensors, NumPy arrays and numbers, also
    inside lists, tuples, deques and dicts of any length and inside the user's own helper objects (those
    of a class outside torch and tunefree), down to a few levels."""
    if isinstance(value, torch.Tensor):
        state[name] = value.detach().clone()
    elif isinstance(value, np.ndarray):
        state[name] = torch.from_numpy(value.copy())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        state[name] = value
    elif depth >= 4 or isinstance(value, (str, bytes, type, nn.Module)) or callable(value):
        return
    elif isinstance(value, (list, tuple, collections.deque)):
        state[name + ".len"] = len(value)
        for i, item in enumerate(value):
            _held(item, f"{name}[{i}]", state, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _held(item, f"{name}[{key!r}]", state, depth + 1)
    elif hasattr(value, "__dict__") and not type(value).__module__.startswith(("torch", "tunefree")):
        for key, item in vars(value).items():
            _held(item, f"{name}.{key}", state, depth + 1)


def model_state(model: torch.nn.Module) -> dict[str, object]:
    """Everything the model object holds after training (what saving the model object keeps):
    parameters, buffers (persistent or not) and the data its modules' attributes hold (``_held``). State
    kept on a class or in a module-level global is not the model object's: the oracle sees it where it
    reaches a release."""
    state: dict[str, object] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for key, value in [*module._parameters.items(), *module._buffers.items()]:
            if value is not None:
                state[prefix + key] = value.detach().clone()
        for key, value in vars(module).items():
            if not key.startswith("_") and key != "training":
                _held(value, prefix + key, state)
    return state


def refused_by_tunefree(error: BaseException) -> bool:
    """Whether tunefree refused on purpose: a PrivacyError, or an exception raised by a ``raise``
    statement in tunefree's own source (not a torch error surfacing through it)."""
    if isinstance(error, tunefree.PrivacyError):
        return True
    if not isinstance(error, (ValueError, TypeError, RuntimeError)):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(TUNEFREE_SOURCE) and \
        (frames[-1].line or "").lstrip().startswith("raise")


def run_draw(draw: Draw, x: torch.Tensor, y: torch.Tensor,
             history: tuple[torch.Tensor, torch.Tensor] | None = None, every_pair: bool = False,
             unchecked: bool = False) -> DrawTrace:
    """Train ``draw`` privately on D = (x, y) (with ``history``: on it for all steps but the last, which
    sees D) and record every release; an exception ends the run and is kept in the trace.
    ``every_pair``: check every step on every pair of examples (``EveryPairChecked``); ``unchecked``: run
    ``UncheckedEngine`` instead of tunefree (the oracle's reference with no checks)."""
    trace = DrawTrace()
    dataset = RecordingDataset(*(history if history is not None else (x, y)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run = _Run(draw, dataset, trace, every_pair=every_pair, unchecked=unchecked)
            run.train(history, (x, y))
            trace.state = model_state(run.model)
            trace.ledger_steps = run.engine.steps
            trace.poisson_approximation = run.engine.guarantee().poisson_approximation
        except Exception as error:  # noqa: BLE001 (every exception is a refusal or a crash to classify)
            trace.error = error
    return trace


def run_plain(draw: Draw, data: tuple[torch.Tensor, torch.Tensor] | None = None,
              history: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Train ``draw`` without tunefree (the same loop over the user's loader) on ``data`` (default: the
    draw's D), as ``run_draw`` would: the draw is ordinary code that runs there. Raises whatever plain
    PyTorch raises."""
    x, y = draw_data(draw) if data is None else data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = RecordingDataset(*(history if history is not None else (x, y)))
        _Run(draw, dataset, DrawTrace(), plain=True).train(history, (x, y))
