"""The leak fuzzer's draws: an ordinary model (``fuzz_zoo``) and an ordinary private training loop, drawn
from a seed, and the runner that trains one draw on given data and records what it released.

The runner is the oracle's instrument, not part of the draw: noise 0, Abadi (or AUTO-S) at R, sampling
rate 1 (the loader's batch size is the data set's size) and learning rate 0, so the weights stay public
(they never move) and each step's ``.grad`` times the expected batch size is the released clipped sum.
Everything else — layers, buffers, hooks, mixing, the loop, precision, loss — is what the draw says.
"""

from __future__ import annotations

import contextlib
import random
import traceback
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from fuzz_zoo import (
    BLOCKS,
    HOOKS,
    INPUTS,
    STATEFUL,
    STEM_LAYOUT,
    B,
    Hook,
    Mix,
    ModelSpec,
    build_model,
    input_batch,
    targets,
)
from neighbour import RunTrace
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.guards.independence import Independence, code_masks

R = 1.0
TUNEFREE_SOURCE = str(Path(tunefree.__file__).parent)


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
    loss, reduction: ``ce``, ``mse`` or ``energy`` (no targets), summed or averaged over the batch;
        ``declared``: the ``loss_reduction`` given to make_private (``None``: the true one).
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
    clipping: str = "abadi"
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
    independence and input checks) and whether the loop trained the model on data in it (a subset may
    come out empty)."""

    checked: list[bool] = field(default_factory=list)
    fed: list[bool] = field(default_factory=list)


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
    return {}


def sample_model(rng: random.Random) -> ModelSpec:
    inputs = rng.choice(INPUTS)
    layout = STEM_LAYOUT[inputs]
    kinds = [k for k, (_, layouts) in BLOCKS.items() if layout in layouts]
    # ordinary layers three times as often as a block that keeps state or mixes examples
    weights = [1.0 if k in STATEFUL or k == "mix" else 3.0 for k in kinds]
    count = rng.choice([0, 1, 1, 2, 2, 3])
    blocks = tuple(B(k, **_block_args(k, layout, rng)) for k in rng.choices(kinds, weights, k=count))
    hooks: tuple[Hook, ...] = ()
    if rng.random() < 0.25:
        hooks = (Hook(rng.choice(list(range(len(blocks))) + [-1, -2]), rng.choice(sorted(HOOKS))),)
    tokens = inputs == "tokens"
    return ModelSpec(inputs=inputs, blocks=blocks, hooks=hooks,
                     max_norm=1.0 if tokens and rng.random() < 0.3 else None,
                     tied_head=tokens and rng.random() < 0.2,
                     pool=rng.choice(["mean", "last"]) if layout == "seq" else "mean")


def _weighted(rng: random.Random, options: dict[object, float]) -> object:
    return rng.choices(list(options), weights=list(options.values()))[0]


def sample_loop(rng: random.Random, model: ModelSpec, outside: bool = False) -> LoopSpec:
    """A loop for ``model``. ``outside``: also draw the user errors no invariant can see, which
    docs/refusals.md lists under what tunefree cannot detect: a ``loss_reduction`` declared wrongly; a
    resume that forgets the engine's state (the optimizer's state, loaded before make_private, is taken
    for training outside the guarantee, such as public pre-training); mixing before the model with
    ``poisson_sampling=False`` (the batches are the user's, whose inputs tunefree does not check: the
    guarantee is labelled an approximation and the loop is the user's)."""
    steps = _weighted(rng, {1: 0.2, 2: 0.5, 3: 0.3})
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
    if loader == "poisson-off" and not outside:
        mix_before = None  # inputs not from tunefree's loader are not checked: outside the invariants
        mix_start = mix_start if mixes else 0
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
        loss=_weighted(rng, {"ce": 0.7, "mse": 0.15, "energy": 0.15}), reduction=reduction,
        declared={"sum": "mean", "mean": "sum"}[reduction] if misdeclared else None,
        clipping=_weighted(rng, {"abadi": 0.8, "auto-s": 0.2}),
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
    if loop.loss == "mse":
        return F.mse_loss(out, y.to(out.dtype), reduction=loop.reduction)
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
    check and the input check), each with the masks of the first check, which see every pair (i, j).
    Mixing that the checks can see is then refused at the first step it happens; a run's random steps and
    halves catch it only with the probability ``ProbeSchedule`` states."""

    def due(self, step: int, every: int) -> bool:
        return True

    def masks(self, step: int, n: int, first: bool, bits: int | None = None) -> tuple[torch.Tensor, ...]:
        return code_masks(n, bits)


class _Run:
    """One private training run of a draw on a data set, recording every release into a ``DrawTrace``
    (``every_pair``: checked by ``EveryPairChecked`` instead of the run's random schedule)."""

    def __init__(self, draw: Draw, dataset: TensorDataset, trace: DrawTrace, plain: bool = False,
                 every_pair: bool = False):
        self.draw, self.loop, self.dataset, self.trace, self.plain = draw, draw.loop, dataset, trace, plain
        self.every_pair = every_pair
        self.dtype = dtype_of(self.loop)
        self.public = input_batch(draw.model, 3, draw.seed * 10 + 5, self.dtype)
        self.engine = self.scaler = None
        self.checking = True  # whether the run checks the step under way (private runs)
        self.fed = False      # whether the loop trained the model on data in the step under way
        self._start(build_model(draw.model, draw.seed, self.dtype))
        self.own = (DataLoader(dataset, batch_size=len(dataset), shuffle=True)
                    if self.loop.loader == "own" or plain else None)

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
        loader = DataLoader(self.dataset, batch_size=len(self.dataset), shuffle=loop.loader != "poisson")
        self.engine = tunefree.make_private(
            model, self.optimizer, loader, target_delta=0.1 / len(self.dataset), noise_multiplier=0.0,
            steps=loop.steps, clipping=loop.clipping, max_grad_norm=R, groups=loop.groups,
            loss_reduction=loop.declared or loop.reduction, seed=self.draw.seed,
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
            active = t >= loop.mix_start
            for module in self.model.modules():
                if isinstance(module, Mix):
                    module.active = active
            torch.manual_seed(1000 + t)
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


def model_state(model: torch.nn.Module) -> dict[str, object]:
    """Everything the model object holds after training: parameters, buffers (persistent or not) and the
    tensor and number attributes of its modules."""
    state: dict[str, object] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for key, value in [*module._parameters.items(), *module._buffers.items()]:
            if value is not None:
                state[prefix + key] = value.detach().clone()
        for key, value in vars(module).items():
            if key.startswith("_") or key == "training" or isinstance(value, bool):
                continue
            if isinstance(value, torch.Tensor):
                state[prefix + key] = value.detach().clone()
            elif isinstance(value, (int, float)):
                state[prefix + key] = value
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
             history: tuple[torch.Tensor, torch.Tensor] | None = None, every_pair: bool = False) -> DrawTrace:
    """Train ``draw`` privately on D = (x, y) (with ``history``: on it for all steps but the last, which
    sees D) and record every release; an exception ends the run and is kept in the trace.
    ``every_pair``: check every step on every pair of examples (``EveryPairChecked``)."""
    trace = DrawTrace()
    dataset = TensorDataset(*(history if history is not None else (x, y)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run = _Run(draw, dataset, trace, every_pair=every_pair)
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
        dataset = TensorDataset(*(history if history is not None else (x, y)))
        _Run(draw, dataset, DrawTrace(), plain=True).train(history, (x, y))
