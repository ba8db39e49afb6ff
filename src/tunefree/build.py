"""Complete objects from a :class:`RunConfig`: the model, optimizer and loader of a private run, each
part constructed with everything it needs (nothing is set on an object after it is built).

:func:`build_run` is :func:`plan_run` (the clip groups, and the plan solved once: every noise is read off
it), then :func:`assemble`, which makes in order the gradient mechanism (with the audit canaries if asked),
the Poisson loader, the step components of the options, the accumulator, the state guard, the engine, the
ledger and the private optimizer (the engine's hooks are removed again if the optimizer refuses its
arguments, so that a refused argument leaves the model as it was given).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .clipping.groups import ClipGroup, make_groups
from .components.dog import DistanceOverGradients, DoG
from .components.dog_optimizers import OptimizerDoG
from .components.hyfreedp import HyFreeDP, HyFreeDPStep, LossShare
from .components.thresholds import AdaptiveQuantile, QuantileEstimator
from .config import RunConfig
from .data.own_loader import own_loader
from .data.poisson import StepSchedule, from_loader, planned_steps, sample_rate_of
from .errors import SettingsRefused
from .guards.base import Guards
from .guards.independence import Independence, ProbeSchedule
from .guards.inputs import InputProvenance
from .guards.loss import LossCheck
from .guards.purity import Purity
from .guards.state import StateGuard
from .guards.trainable import TrainableSet
from .parallel.base import DDP, FSDP2, ONE_PROCESS, STAGES, Parallelism, Single
from .parallel.ddp import check_same_run, data_parallel, run_identity
from .parallel.fsdp import check_sharded_options, sharded_data_parallel
from .persample.accumulator import StepAccumulator
from .persample.engine import ClippingEngine
from .privacy.accounting import check_delta
from .privacy.canaries import CanaryRelease, GradientCanaries, canary_randomness
from .privacy.ledger import Ledger
from .privacy.mechanisms import GradientRelease
from .privacy.plan import Plan, data_digest
from .privacy.randomness import NoiseSource, SeededSource, run_randomness, secret_seed
from .rules.paths import path_chooser
from .run import DPEngine
from .step.component import StepComponent
from .step.optimizer import DPOptimizer
from .step.private_step import PrivateStep


def detect_parallel(model: nn.Module) -> Parallelism:
    """How ``model`` spans processes: FSDP2 (sharded parameters), DDP, or one process."""
    return sharded_data_parallel(model) or data_parallel(model) or Single()


@dataclass(frozen=True)
class PlannedRun:
    """What a run is before anything is hooked: its randomness, logical-step schedule, clip groups and
    solved plan (every noise is read off it). A pipeline stage exchanges it with the other stages before
    its parts are made."""

    config: RunConfig
    module: nn.Module
    randomness: NoiseSource
    schedule: StepSchedule
    groups: list[ClipGroup]
    plan: Plan
    parallel: Parallelism


def plan_run(config: RunConfig, model: nn.Module, data_loader: Any, parallel: Parallelism | None = None
             ) -> PlannedRun:
    """The plan of ``config`` over ``model`` and ``data_loader``; ``parallel`` is how the run spans
    processes (:func:`detect_parallel`; one process by default)."""
    parallel = Single() if parallel is None else parallel
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
    check_parallel_options(config, parallel)
    if parallel.kind == FSDP2:
        check_sharded_options(config.performance.physical_batch_size)
    randomness = run_randomness(config.seed)
    num_examples, sample_rate = sample_rate_of(data_loader)
    check_delta(config.target_delta, num_examples, option="target_delta")
    module = getattr(parallel, "module", model)
    groups = make_groups(module, config.groups, config.max_grad_norm)
    # each component's option declares its share of the budget (in the order of its component's releases)
    shares = (config.thresholds.share(len(groups)), None if config.lr is None else config.lr.share())
    plan = Plan(
        sample_rate=sample_rate, steps=planned_steps(config.epochs, config.steps, sample_rate),
        num_examples=num_examples, delta=config.target_delta, accountant=config.accountant,
        noise_multiplier=0.0 if config.noise_multiplier is None else config.noise_multiplier,
        prior=config.prior_releases, shares=tuple(share for share in shares if share is not None),
        settings={**config.identity(), "groups": {g.name: [list(g.param_names), g.threshold] for g in groups},
                  "data": data_digest(data_loader.dataset, num_examples)},
    ).solve(config.target_epsilon)
    if parallel.kind != ONE_PROCESS:
        check_same_run(parallel, run_identity(plan.describe(), groups, randomness))
    return PlannedRun(config, module, randomness, StepSchedule(), groups, plan, parallel)


def build_run(config: RunConfig, model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: Any,
              parallel: Parallelism | None = None) -> DPEngine:
    """The private run of ``config`` over ``model`` (hooked in place), ``optimizer`` and ``data_loader``;
    ``parallel`` is how the run spans processes (:func:`detect_parallel`; one process by default)."""
    return assemble(plan_run(config, model, data_loader, parallel), model, optimizer, data_loader)


def assemble(run: PlannedRun, model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: Any
             ) -> DPEngine:
    """The parts of a planned run, in order: the Poisson loader (its samples from the parallelism's
    sampling), the gradient mechanism (decorated with the audit canaries if asked), the step components
    (thresholds, then the learning-rate rule), the engine (hooks go on last, so that a refused argument
    leaves the model as it was given) and the private optimizer."""
    config, plan, schedule, parallel = run.config, run.plan, run.schedule, run.parallel
    release: GradientRelease | CanaryRelease = GradientRelease(
        run.groups, plan.gradient_noise, run.randomness, config.noise_allocation, parallel)
    canaries = None
    if config.audit_canaries is not None:
        seed = config.seed
        if seed is None and parallel.kind != ONE_PROCESS:  # the processes share the canaries' randomness
            seed = parallel.from_first(secret_seed())
        canaries = GradientCanaries(config.audit_canaries, run.groups, plan.sample_rate,
                                    canary_randomness(seed))
        release = CanaryRelease(release, canaries, adds_contributions=parallel.shard[0] == 0)
    if config.poisson_sampling:
        loader: Any = from_loader(data_loader, parallel.sampling(run.randomness), schedule,
                                  config.performance.physical_batch_size, shard=parallel.shard)
    else:  # each example at most once per epoch, watched in the loader itself (issue 29.5)
        loader = own_loader(data_loader)
        warnings.warn(
            "poisson_sampling=False: the loader is not Poisson-sampled, so the reported ε is the "
            "Poisson approximation, not a proof of privacy", stacklevel=4)
    components = [c for c in (threshold_component(run), _learning_rate(run, optimizer, release))
                  if c is not None]
    # The engine books into the accumulator, the optimizer releases from it; its sink is the parallelism's
    # (FSDP2 keeps only this rank's shards).
    accumulator = StepAccumulator(parallel.sink(run.groups))
    chooser = path_chooser(config.performance.norm_path, replayable=run.randomness.replayable)
    trainable = [p for g in run.groups for p in g.params]
    inputs = InputProvenance(schedule) if config.poisson_sampling else None
    engine = ClippingEngine(run.module, run.groups, config.clipping, config.loss_reduction, accumulator,
                            config.batch_dim, batch_source=schedule, path_chooser=chooser, inputs=inputs)
    try:
        guards = run_guards(run, engine, trainable, optimizer, accumulator)
        engine.guards = guards  # the guards read the engine's units: they are told of forwards from now on
        ledger = Ledger(poisson_approximation=not config.poisson_sampling, seeded=not run.randomness.secret)
        for event in plan.prior:  # the releases made before training come first in the run's ledger
            ledger.record(event)
        private_step = PrivateStep(optimizer, engine, release, ledger, accumulator, guards, plan.sample_rate,
                                   plan.expected_batch_size, components, planned_steps=plan.steps,
                                   parallelism=parallel)
        private_optimizer = DPOptimizer(optimizer, engine, schedule, private_step)
    except ValueError:
        engine.detach()
        raise
    parallel.take_over()
    return DPEngine(model=model, optimizer=private_optimizer, data_loader=loader, clipper=engine,
                    ledger=private_optimizer.ledger, randomness=run.randomness, schedule=schedule,
                    groups=run.groups, plan=plan, parallel=parallel, guards=guards, canaries=canaries)


def run_guards(run: PlannedRun, engine: ClippingEngine, trainable: list[nn.Parameter],
               optimizer: torch.optim.Optimizer, accumulator: StepAccumulator) -> Guards:
    """The run's guards, in the order each point of the step runs them: the trainable set (and no
    ordinary gradient), the model's state (tensors and numbers where they live), its function (the
    state by behaviour, on checked steps), the loss and example independence (on checked steps). A
    refusal drops the step's booked sums."""
    config = run.config
    state = StateGuard(run.module, trainable, config.public_buffers)
    every_rank = run.parallel.agree if run.parallel.kind == FSDP2 else None
    probes = ProbeSchedule(run.randomness)
    if every_rank is not None and run.randomness.secret:
        # FSDP2's forward passes are collectives: every rank draws its checked steps and halves from one
        # secret seed rank 0 draws (each rank's own secret randomness would diverge)
        probes = ProbeSchedule(SeededSource(run.parallel.from_first(secret_seed())))
    # Under FSDP2 every forward is a collective, and a rank whose batch is empty has nothing to probe: the
    # model's function is not probed there (its state is still compared where it lives).
    purity = [] if every_rank is not None else [
        Purity(run.module, engine, run.schedule, after_probes=state.after_probes)]
    return Guards([
        TrainableSet(run.module, trainable, optimizer, leaks=lambda: engine.check_no_leak()),
        state,
        *purity,
        # a pipeline stage's backward starts from the next stage's gradient, not from a loss it computes
        *([] if run.parallel.kind == STAGES else
          [LossCheck(run.schedule, probes, quiet=engine.running_model, drop=accumulator.pop,
                     reduction=config.loss_reduction)]),
        Independence(run.module, engine, run.schedule, probes,
                     config.performance.verify_every, every_rank, after_probes=state.after_probes),
    ], drop=accumulator.pop)


def threshold_component(run: PlannedRun) -> QuantileEstimator | None:
    """The estimator of adaptive thresholds. Normalising clip functions keep the initial total
    sensitivity (of every clip group of the run: pipeline stages hold one each); Abadi's clips at the
    estimates unless asked to rescale them (group-wise paper), which needs more than one group."""
    rule, groups = run.config.thresholds, run.groups
    if not isinstance(rule, AdaptiveQuantile):
        return None
    normalising = run.config.clipping.normalising
    every_group = run.parallel.all_groups({g.name: (g.threshold, g.size) for g in groups})
    if not normalising and rule.rescale and len(every_group) < 2:
        raise SettingsRefused(
            "AdaptiveQuantile(rescale=True) with Abadi clipping rescales the thresholds of several clip "
            "groups to a fixed total; with one group the threshold would never move: use "
            "groups='per-layer' (or similar) or rescale=False")
    scale = math.sqrt(sum(t ** 2 for t, _ in every_group.values())) if normalising or rule.rescale else None
    return QuantileEstimator(groups, rule, run.plan.count_noise, scale, run.parallel)


def _learning_rate(run: PlannedRun, optimizer: torch.optim.Optimizer,
                   release: GradientRelease) -> StepComponent | None:
    """The component of ``lr``: HyFreeDP at the loss noise the plan solved, or DoG (its SGD step, translated
    to the learning rate of another optimizer: ``components/dog_optimizers.py``)."""
    rule, plan = run.config.lr, run.plan
    if isinstance(rule, HyFreeDP):
        return HyFreeDPStep(rule, plan.share(LossShare).noise)
    if not isinstance(rule, DoG):
        return None
    if plan.steps is None and rule.noise_budget is not None:
        raise ValueError("lr='auto' spends its noise budget over the planned run: give epochs or steps "
                         "(or lr=tunefree.DoG(noise_budget=None) for DoG without it)")
    plain = all(not (g.get("momentum") or g.get("weight_decay") or g.get("nesterov"))
                for g in optimizer.param_groups)
    if type(optimizer) is torch.optim.SGD and plain:
        return DistanceOverGradients(release, plan.expected_batch_size, rule, planned_steps=plan.steps)
    return OptimizerDoG(optimizer, release, plan.expected_batch_size, rule, planned_steps=plan.steps)


def check_parallel_options(config: RunConfig, parallel: Parallelism) -> None:
    """Refuse the options the run's parallelism does not run: each option lists the kinds it runs under
    (``parallelisms``; a learning-rate rule reads norms of the weights, which FSDP2 shards, so it runs in
    one process or under DDP). Several processes need tunefree's Poisson sampler (it gives each rank its
    shard); FSDP2 releases sharded parameters only, so the audit canaries' block is not released there."""
    if parallel.kind == ONE_PROCESS:
        return
    lr = config.lr
    unsupported = [name for name, refused in (
        ("thresholds='adaptive'", parallel.kind not in config.thresholds.parallelisms),
        (f"lr={type(lr).__name__}()", lr is not None and parallel.kind not in (ONE_PROCESS, DDP)),
        ("poisson_sampling=False", not config.poisson_sampling),
        ("audit_canaries", config.audit_canaries is not None and parallel.kind == FSDP2)) if refused]
    if unsupported:
        kind = {FSDP2: "FSDP2 (fully_shard)", STAGES: "pipeline stages"}.get(parallel.kind,
                                                                           "DistributedDataParallel")
        raise SettingsRefused(
            f"{', '.join(unsupported)} is not supported with {kind} yet: use the optimizer's learning rate "
            "(or, under DDP, lr='auto' or HyFreeDP: under FSDP2 they would read norms of sharded "
            "parameters), tunefree's Poisson sampling and (under FSDP2) no audit canaries, or DDP, or "
            "train in one process")
