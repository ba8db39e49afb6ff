"""Pipeline-parallel private training with per-device clipping (group-wise clipping paper, §per-device).

The model is cut into K stages, one process each (``torchrun --nproc-per-node K``). Stage k's parameters
are one clip group with its own threshold Rₖ: each stage clips its per-sample gradients inside its own
backward pass (the engine runs on the stage's submodule), so no per-sample norm ever leaves its stage.
Every stage adds the noise of its own parameters, with the standard deviation the noise allocation gives
stage k among all K (``group_noise_stds``), so that together the K releases are one Gaussian mechanism of
multiplier σ on the sensitivity S = √(Σₖ Rₖ²): every stage records that same single event per step and
the K ledgers are identical.

What crosses a stage boundary: the activations of each micro-batch forwards, their gradients backwards
(per example, as in one process), the Poisson sample of each step (from the first stage, which draws it)
and, once at setup, each stage's threshold, size and plan. The Poisson loader's physical batches are the
pipeline's micro-batches; their sizes vary with the sample, so tensors travel with a small shape header
(``torch.distributed.pipelining`` sizes its buffers at the first step and aborts on another batch size).
Micro-batches run one at a time through the stages (the engine holds one forward pass in flight).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

from .build import assemble, plan_run, threshold_component
from .clipping.groups import ClipGroup
from .components.thresholds import AdaptiveQuantile, QuantileEstimator
from .config import RunConfig
from .data.provenance import handed_on
from .errors import PrivacyError
from .privacy.ledger import Ledger
from .privacy.mechanisms import GradientRelease, group_noise_stds
from .privacy.randomness import NoiseSource, side_randomness
from .run import DPEngine
from .step.component import StepReport

# Seeded runs: stage k > 0 draws its noise from this stream of the seed (stage 0 from the seed itself),
# so that no two stages ever add the same noise numbers.
_STAGE_NOISE_STREAM = 0x5747
_MAX_DIMS = 8  # dimensions of an activation that the shape header carries
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StageLayout:
    """Where this process sits in the pipeline, and what every stage set up (public, exchanged once):
    ``thresholds[k]`` is stage k's clip threshold Rₖ and ``sizes[k]`` its number of trainable
    coordinates."""

    index: int
    num_stages: int
    thresholds: tuple[float, ...]
    sizes: tuple[int, ...]
    group: Any = None  # the pipeline's process group (None: the default group)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of one example's clipped gradient over all stages: √(Σₖ Rₖ²)."""
        return math.sqrt(sum(r * r for r in self.thresholds))


class StageRelease(GradientRelease):
    """The gradient release of one stage: its own parameters' clipped sum plus its share of the noise.

    The standard deviation of stage k is the one ``group_noise_stds`` gives group k among all stages'
    thresholds and sizes, so the K stage releases together are exactly the release of one process with
    one clip group per stage: one Gaussian event of multiplier σ, recorded by every stage."""

    def __init__(self, groups: list[ClipGroup], noise_multiplier: float, randomness: NoiseSource,
                 allocation: str, layout: StageLayout):
        super().__init__(groups, noise_multiplier, randomness, allocation)
        if len(self.groups) != 1:
            raise ValueError("a pipeline stage releases exactly one clip group (its parameters)")
        self.layout = layout
        self.stage_thresholds = layout.thresholds  # every stage's current threshold

    def noise_stds(self, thresholds: dict[str, float]) -> list[float]:
        (group,) = self.groups
        everyone = list(self.stage_thresholds)
        everyone[self.layout.index] = thresholds[group.name]
        stds = group_noise_stds(everyone, self.layout.sizes, self.noise_multiplier, self.allocation)
        return [stds[self.layout.index]]


class StageQuantileEstimator(QuantileEstimator):
    """Adaptive thresholds per stage: stage k releases its own count of examples within its estimate
    Qₖ (norms never leave the stage) with the noise of one of K counts, σ_b = σ_counts·√K/2, and
    records the joint event of the K counts, Gaussian of multiplier σ_counts, as every stage does.
    After the update the stages exchange their new estimates (public: functions of released counts),
    which set every stage's noise and, for the normalising clip functions, the total scale.

    Args:
        group: this stage's clip group; its threshold is the initial estimate.
        settings, randomness, expected_batch_size: as for :class:`QuantileEstimator`.
        count_noise: σ_counts, the joint noise multiplier of the K counts (``Plan.count_noise``).
        release: this stage's release, told every stage's thresholds after each update.
        scale: ``None`` (Abadi: Cₖ = Qₖ) or the constant total sensitivity √(Σₖ Cₖ²).
    """

    state_key = "StageQuantileEstimator"

    def __init__(self, group: ClipGroup, settings: AdaptiveQuantile, count_noise: float,
                 randomness: NoiseSource, expected_batch_size: float, release: StageRelease,
                 scale: float | None):
        layout = release.layout
        super().__init__([group], settings, count_noise, randomness, expected_batch_size, scale)
        self.joint_counts = layout.num_stages  # this stage's count is one of the K stages' counts
        self.release, self.layout = release, layout
        self.estimates = list(layout.thresholds)  # every stage's Qₖ

    def thresholds(self) -> dict[str, float]:
        (group,) = self.groups
        own = self.quantiles[group.name]
        if self.scale is None:
            return {group.name: own}
        return {group.name: self.scale * own / math.sqrt(sum(q * q for q in self.estimates))}

    def update(self, report: StepReport) -> list[dpa.DpEvent]:
        (group,) = self.groups
        events = super().update(report)  # the joint event of the K counts, as every stage records it
        estimates = [0.0] * self.layout.num_stages
        dist.all_gather_object(estimates, self.quantiles[group.name], group=self.layout.group)
        self.estimates = [float(q) for q in estimates]
        norm = math.sqrt(sum(q * q for q in self.estimates))
        self.release.stage_thresholds = tuple(
            q if self.scale is None else self.scale * q / norm for q in self.estimates)
        return events

    def state_dict(self) -> dict[str, Any]:
        """With every stage's estimate: a resumed stage must noise for all stages' current thresholds."""
        return {**super().state_dict(), "estimates": list(self.estimates),
                "stage_thresholds": list(self.release.stage_thresholds)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state.get("estimates", ())) != self.layout.num_stages:
            raise ValueError(f"this checkpoint holds no estimates of the {self.layout.num_stages} stages: "
                             "resume a pipeline stage from its own checkpoint")
        super().load_state_dict(state)
        self.estimates = [float(q) for q in state["estimates"]]
        self.release.stage_thresholds = tuple(float(c) for c in state["stage_thresholds"])


class _SharedSampling:
    """The Poisson sample of each step, drawn by the first stage and broadcast to the others, so that
    every stage trains on the same examples (secret randomness cannot be replayed elsewhere)."""

    def __init__(self, randomness: NoiseSource, layout: StageLayout, device: torch.device):
        self.randomness, self.layout, self.device = randomness, layout, device

    def inclusion(self, step: int, num_examples: int, sample_rate: float) -> torch.Tensor:
        mask = torch.zeros(num_examples, dtype=torch.uint8)
        if self.layout.is_first:
            mask = self.randomness.inclusion(step, num_examples, sample_rate).to(torch.uint8)
        mask = mask.to(self.device)  # where the backend communicates (NCCL: the GPU)
        dist.broadcast(mask, group_src=0, group=self.layout.group)
        return mask.cpu().bool()


def _send(tensor: torch.Tensor, stage: int, group: Any) -> None:
    """Send ``tensor`` to ``stage``, after a header with its dtype and shape (sizes vary per batch)."""
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ValueError(f"a stage output must be one floating tensor of at most {_MAX_DIMS} dimensions "
                         f"(dtypes {_DTYPES}), got {tensor.dtype} of shape {tuple(tensor.shape)}")
    shape = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64,
                          device=tensor.device)
    dist.send(header, group_dst=stage, group=group)
    dist.send(tensor.detach().contiguous(), group_dst=stage, group=group)


def _recv(stage: int, group: Any, device: torch.device) -> torch.Tensor:
    """Receive what :func:`_send` sent from ``stage``."""
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, group_src=stage, group=group)
    code, dims, *shape = header.tolist()
    tensor = torch.empty(shape[:dims], dtype=_DTYPES[code], device=device)
    dist.recv(tensor, group_src=stage, group=group)
    return tensor


class PrivatePipelineStage:
    """One stage of a pipeline-parallel private run, built by :func:`make_private_pipeline`.

    ``engine`` is this stage's private run on its submodule (its ledger is the run's ledger, identical
    on every stage); :meth:`step` trains one logical (Poisson) batch through the whole pipeline."""

    def __init__(self, engine: DPEngine, layout: StageLayout,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None):
        self.engine, self.layout, self.loss_fn = engine, layout, loss_fn
        self.module = engine.model
        self.device = next(self.module.parameters()).device
        self._batches: Iterator[Any] | None = None

    @property
    def ledger(self) -> Ledger:
        return self.engine.ledger

    @property
    def sensitivity(self) -> float:
        """√(Σₖ Rₖ²) of the current thresholds: the sensitivity each step's release is noised for."""
        return math.sqrt(sum(r * r for r in self.release.stage_thresholds))

    @property
    def release(self) -> StageRelease:
        return self.engine.optimizer.release

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far (the same on every stage)."""
        return self.engine.epsilon(delta)

    def event(self) -> dpa.DpEvent:
        """Everything released so far, as one DpEvent."""
        return self.ledger.event()

    def _next_batch(self) -> Any:
        if self._batches is None:
            self._batches = iter(self.engine.data_loader)
        try:
            return next(self._batches)
        except StopIteration:  # an epoch of the Poisson loader is over: the next one starts
            self._batches = iter(self.engine.data_loader)
            return next(self._batches)

    def step(self) -> list[torch.Tensor] | None:
        """One private step: every micro-batch of the next Poisson batch forwards and backwards through
        the stages, then each stage releases its noisy clipped sum and updates its parameters. Every
        stage must call it together. Returns the micro-batches' losses on the last stage (training
        diagnostics: private, not released), ``None`` elsewhere."""
        schedule, optimizer = self.engine.schedule, self.engine.optimizer
        losses: list[torch.Tensor] = []
        while True:
            inputs, target = self._next_batch()
            last = schedule.ends_logical
            optimizer.zero_grad()
            if schedule.batch_examples:  # an empty micro-batch releases noise only: nothing to run
                loss = self._forward_backward(inputs, target)
                if loss is not None:
                    losses.append(loss.detach())
            optimizer.step()
            if last:
                return losses if self.layout.is_last else None

    def _to_device(self, x: Any) -> Any:
        return x.to(self.device) if isinstance(x, torch.Tensor) else x

    def _forward_backward(self, inputs: Any, target: Any) -> torch.Tensor | None:
        layout, group = self.layout, self.layout.group
        inputs, target = tree_map(self._to_device, (inputs, target))
        if layout.is_first:
            received = None
            output = self.module(inputs)
        else:
            received = _recv(layout.index - 1, group, self.device).requires_grad_()
            # the previous stage's activations of this batch, handed on for the loader
            output = self.module(handed_on(received, self.engine.schedule.batch_serial))
        loss = None
        if layout.is_last:
            loss = self.loss_fn(output, target)
            loss.backward()
        else:
            _send(output, layout.index + 1, group)
            output.backward(_recv(layout.index + 1, group, self.device))
        if received is not None:
            _send(received.grad, layout.index - 1, group)
        return loss


def _exchange(layout_facts: dict[str, Any], group: Any, index: int) -> list[dict[str, Any]]:
    """Every stage's setup facts, in stage order; refuses stages set up with different privacy
    settings (their ledgers must be one ledger)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, layout_facts, group=group)
    mine = gathered[index]["run"]
    for stage, facts in enumerate(gathered):
        if facts["run"] != mine:
            keys = sorted(k for k in set(mine) | set(facts["run"]) if mine.get(k) != facts["run"].get(k))
            raise PrivacyError(
                f"stage {stage} was set up differently from stage {index} (it differs in {keys}): every "
                "stage must call make_private_pipeline with the same data set and privacy settings")
    return gathered


def make_private_pipeline(
    stage_module: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    *,
    stage_index: int,
    num_stages: int,
    target_delta: float,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    clipping: Any = "auto-s",
    max_grad_norm: float = 1.0,
    loss_reduction: str = "mean",
    accountant: str = "pld",
    seed: int | None = None,
    physical_batch_size: int | None = None,
    noise_allocation: str = "global",
    thresholds: Any = "fixed",
    group: Any = None,
) -> PrivatePipelineStage:
    """Make stage ``stage_index`` of a ``num_stages``-stage pipeline train privately, with per-device
    clipping. Every process of the pipeline calls it with its own stage; the arguments are those of
    :func:`tunefree.make_private` except:

    Args:
        stage_module: this stage's part of the model; its trainable parameters are one clip group.
        stage_index, num_stages: this stage's position; it must be this process's rank in ``group``,
            which holds exactly the pipeline's ``num_stages`` processes.
        data_loader: a loader of ``(inputs, target)`` pairs over the whole private data set (the same on
            every stage): the first stage feeds ``inputs`` to its module, the last one gives its output
            and ``target`` to ``loss_fn``. The first stage draws each step's Poisson sample.
        loss_fn: on the last stage, ``loss_fn(output, target)``, the micro-batch's loss (its mean over
            the examples, or their sum with ``loss_reduction="sum"``).
        max_grad_norm: Rₖ, this stage's clip threshold. The release's sensitivity is √(Σₖ Rₖ²) over all
            stages; with AUTO-S/V the thresholds set the stages' relative scales.
        noise_allocation: how σ·S is spread over the stages (``"global"``, ``"equal-budget"``,
            ``"weighted"``, the group-wise clipping paper's allocations); the privacy cost is the same.
        thresholds: ``"fixed"`` or ``"adaptive"``/``AdaptiveQuantile(...)``: each stage's threshold
            tracks a private quantile of its own norms (its count is one of the K counts released
            jointly each step; the stages then exchange their new estimates).
        physical_batch_size: the micro-batch size of the pipeline (the Poisson batch is cut into
            micro-batches of at most this many examples).
        group: the pipeline's process group (default: every process).
    """
    if not dist.is_initialized():
        raise ValueError("make_private_pipeline needs torch.distributed: call "
                         "torch.distributed.init_process_group first (launch with torchrun)")
    if dist.get_world_size(group) != num_stages or dist.get_rank(group) != stage_index:
        raise ValueError(
            f"stage {stage_index} of {num_stages} must run as rank {stage_index} of a process group of "
            f"{num_stages} processes; this process is rank {dist.get_rank(group)} of "
            f"{dist.get_world_size(group)}: launch one process per stage, in stage order")
    if (loss_fn is None) == (stage_index == num_stages - 1):
        raise ValueError("loss_fn is required on the last stage, and only there")
    if getattr(data_loader, "num_workers", 0) > 0:
        raise ValueError("make_private_pipeline needs a data loader with num_workers=0: its Poisson "
                         "sample is broadcast from the first stage in step with the pipeline's messages")
    names = [name for name, p in stage_module.named_parameters() if p.requires_grad]
    stage_name = f"stage{stage_index}"
    stage_seed = seed if seed is None or stage_index == 0 else \
        side_randomness(seed, _STAGE_NOISE_STREAM + stage_index).seed
    config = RunConfig.from_keywords(
        target_delta=target_delta, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
        epochs=epochs, steps=steps, clipping=clipping, max_grad_norm={stage_name: max_grad_norm},
        groups={stage_name: names}, loss_reduction=loss_reduction, accountant=accountant, seed=stage_seed,
        physical_batch_size=physical_batch_size, noise_allocation=noise_allocation, thresholds=thresholds)
    run = plan_run(config, stage_module, data_loader)
    local = threshold_component(run)  # refuses what one stage's group cannot do
    described = {k: v for k, v in run.plan.describe().items() if k != "settings.groups"}
    described.update(secret=run.randomness.secret, physical_batch_size=physical_batch_size)
    facts = {"run": described, "threshold": float(max_grad_norm), "size": run.groups[0].size}
    gathered = _exchange(facts, group, stage_index)
    layout = StageLayout(stage_index, num_stages, tuple(f["threshold"] for f in gathered),
                         tuple(f["size"] for f in gathered), group)
    release = StageRelease(run.groups, run.plan.gradient_noise, run.randomness, noise_allocation, layout)
    estimator = None if local is None else StageQuantileEstimator(  # one of the K counts of the joint release
        run.groups[0], local.settings, run.plan.count_noise, run.randomness, run.plan.expected_batch_size,
        release, None if local.scale is None else layout.sensitivity)
    device = next(stage_module.parameters()).device
    engine = assemble(run, stage_module, optimizer, data_loader, release, estimator,
                      sampling=_SharedSampling(run.randomness, layout, device))
    return PrivatePipelineStage(engine, layout, loss_fn)
