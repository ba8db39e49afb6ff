"""Pipeline-parallel private training with per-device clipping (group-wise clipping paper, §per-device):
the front door of a run cut into stages (``parallel/stages.py``: the stages as a Parallelism).

Stage k's parameters are one clip group with its own threshold Rₖ, clipped inside the stage's own backward
pass (no per-sample norm leaves its stage); every stage adds its share of the noise of one Gaussian
mechanism of multiplier σ on √(Σₖ Rₖ²) and records that same event, so the K ledgers are identical. What
a step does and what crosses a stage boundary: docs/distributed.md, "Pipeline parallel".
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import dp_accounting as dpa
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

from .api import make_private
from .build import assemble, check_parallel_options, plan_run
from .components.thresholds import AdaptiveQuantile
from .config import RunConfig
from .data.provenance import handed_on
from .errors import SettingsRefused
from .parallel.stages import Stages
from .privacy.ledger import Ledger
from .privacy.randomness import side_randomness
from .run import DPEngine

# Seeded runs: stage k > 0 draws its noise from this stream of the seed (stage 0 from the seed itself),
# so that no two stages ever add the same noise numbers.
_STAGE_NOISE_STREAM = 0x5747


class PrivatePipelineStage:
    """One stage of a pipeline-parallel private run, built by :func:`make_private_pipeline`.

    ``engine`` is this stage's private run on its submodule (its ledger is the run's ledger, identical
    on every stage); :meth:`step` trains one logical (Poisson) batch through the whole pipeline."""

    def __init__(self, engine: DPEngine, loss_fn: Callable[[Any, Any], torch.Tensor] | None):
        self.engine, self.loss_fn = engine, loss_fn
        self.stages: Stages = engine.parallel  # this stage's place in the pipeline, and its transport
        self.module = engine.model
        self.device = next(self.module.parameters()).device
        self._batches: Iterator[Any] | None = None

    @property
    def ledger(self) -> Ledger:
        return self.engine.ledger

    @property
    def sensitivity(self) -> float:
        """√(Σₖ Rₖ²) of the current thresholds: the sensitivity each step's release is noised for (with
        adaptive thresholds the stages exchange them: every stage reads it together)."""
        return math.sqrt(sum(r * r for r in self.stage_thresholds()))

    def stage_thresholds(self) -> tuple[float, ...]:
        """Every stage's current clip threshold, in stage order: those the next step clips with (with
        adaptive thresholds the stages exchange them: every stage calls it together)."""
        own = {g.name: (self.engine.clip_thresholds[g.name], g.size) for g in self.engine.groups}
        return tuple(threshold for threshold, _ in self.stages.all_groups(own).values())

    @property
    def release(self) -> Any:
        """This stage's gradient mechanism (its noise is its share among every stage's threshold)."""
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
                return losses if self.stages.is_last else None

    @torch.no_grad()
    def predict(self, inputs: Any) -> torch.Tensor | None:
        """The model's output on ``inputs`` (held-out or public data: nothing is released or recorded), one
        forward through the stages in eval mode: the first stage takes ``inputs``, the last one returns
        the output (``None`` on the others). Every stage calls it together."""
        stages, was_training = self.stages, self.module.training
        self.module.eval()
        try:
            output = self.module(self._to_device(inputs) if stages.is_first else
                                 stages.receive(stages.index - 1))
        finally:
            self.module.train(was_training)
        if stages.is_last:
            return output
        stages.send(output, stages.index + 1)
        return None

    def _to_device(self, x: Any) -> Any:
        return x.to(self.device) if isinstance(x, torch.Tensor) else x

    def _forward_backward(self, inputs: Any, target: Any) -> torch.Tensor | None:
        stages = self.stages
        inputs, target = tree_map(self._to_device, (inputs, target))
        if stages.is_first:
            received = None
            output = self.module(inputs)
        else:
            received = stages.receive(stages.index - 1).requires_grad_()
            # the previous stage's activations of this batch, handed on for the loader
            output = self.module(handed_on(received, self.engine.schedule.batch_serial))
        loss = None
        if stages.is_last:
            loss = self.loss_fn(output, target)
            loss.backward()
        else:
            stages.send(output, stages.index + 1)
            output.backward(stages.receive(stages.index + 1))
        if received is not None:
            stages.send(received.grad, stages.index - 1)
        return loss


def make_private_pipeline(
    stage_module: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    *,
    stage_index: int,
    num_stages: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    group: Any = None,
    **settings: Any,
) -> PrivatePipelineStage:
    """Make stage ``stage_index`` of a ``num_stages``-stage pipeline train privately, with per-device
    clipping. Every process of the pipeline calls it with its own stage and the same ``settings``: those of
    :func:`tunefree.make_private` (``target_delta``, ``target_epsilon`` or ``noise_multiplier``, ``epochs``
    or ``steps``, ``clipping``, …), except that the stage is one clip group (no ``groups``), the run has no
    audit canaries, and:

    Args:
        stage_module: this stage's part of the model; its trainable parameters are one clip group.
        stage_index, num_stages: this stage's position; it must be this process's rank in ``group``,
            which holds exactly the pipeline's ``num_stages`` processes.
        data_loader: a loader of ``(inputs, target)`` pairs over the whole private data set (the same on
            every stage): the first stage feeds ``inputs`` to its module, the last one gives its output
            and ``target`` to ``loss_fn``. The first stage draws each step's Poisson sample.
        loss_fn: on the last stage, ``loss_fn(output, target)``, the micro-batch's loss (its mean over
            the examples, or their sum with ``loss_reduction="sum"``).
        group: the pipeline's process group (default: every process).
        settings: ``max_grad_norm`` is Rₖ, this stage's clip threshold (a number; the release's
            sensitivity is √(Σₖ Rₖ²) over all stages); ``physical_batch_size`` is the pipeline's
            micro-batch size; ``noise_allocation`` and ``thresholds`` per stage: docs/distributed.md.
    """
    _check_stage_settings(settings)
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
    seed = settings.get("seed")
    if seed is not None and stage_index > 0:
        seed = side_randomness(seed, _STAGE_NOISE_STREAM + stage_index).seed
    config = RunConfig.from_keywords(**{
        **settings, "max_grad_norm": {stage_name: settings.get("max_grad_norm", 1.0)},
        "groups": {stage_name: names}, "seed": seed})
    run = plan_run(config, stage_module, data_loader)  # this stage's group, planned as one process
    described = {k: v for k, v in run.plan.describe().items() if k != "settings.groups"}
    described.update(secret=run.randomness.secret,
                     physical_batch_size=config.performance.physical_batch_size)
    device = next(stage_module.parameters()).device
    stages = Stages.join(stage_index, num_stages, group, device, run.groups[0], described,
                         thresholds_move=isinstance(config.thresholds, AdaptiveQuantile))
    check_parallel_options(config, stages)
    return PrivatePipelineStage(assemble(replace(run, parallel=stages), stage_module, optimizer, data_loader),
                                loss_fn)


def _check_stage_settings(settings: dict[str, Any]) -> None:
    """``settings`` are ``make_private``'s keywords that a stage runs: its own clip group at one threshold,
    no audit canaries."""
    known = set(inspect.signature(make_private).parameters) - {"model", "optimizer", "data_loader"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"make_private_pipeline got unexpected settings {', '.join(unknown)}: the settings "
                        "are make_private's keywords")
    if "groups" in settings:
        raise SettingsRefused("a pipeline stage's trainable parameters are its one clip group: drop groups")
    if isinstance(settings.get("max_grad_norm"), Mapping):
        raise SettingsRefused("max_grad_norm of a pipeline stage is its clip threshold Rₖ, a number")
    if settings.get("audit_canaries") is not None:
        raise SettingsRefused("audit_canaries is not supported in a pipeline yet: audit a run in one process "
                              "or under DDP")
