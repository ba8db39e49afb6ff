"""``make_private``: the front door. Turns a model, an optimizer and a data loader into a private run."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .clipping.functions import ClipFunction
from .clipping.groups import ClipGroup, GroupSpec, make_groups, sensitivity
from .components.dog import DistanceOverGradients
from .components.hyfreedp import AutoLearningRate
from .components.thresholds import QuantileEstimator, QuantileSettings
from .config import AutoLR, Clipping, Thresholds, resolve_options
from .data.poisson import StepSchedule, from_loader, planned_steps, sample_rate_of
from .parallel.ddp import DataParallel, DistributedRelease, check_same_run, data_parallel, run_identity
from .parallel.fsdp import (
    ShardedAccumulator,
    ShardedDataParallel,
    ShardedRelease,
    check_sharded_options,
    sharded_data_parallel,
)
from .persample.accumulator import StepAccumulator
from .persample.engine import ClippingEngine
from .privacy.canaries import CanaryRelease, GradientCanaries, canary_randomness
from .privacy.ledger import Ledger
from .privacy.mechanisms import GradientRelease
from .privacy.plan import CountShare, LossShare, Plan, data_digest
from .privacy.randomness import NoiseSource, run_randomness
from .rules.paths import PathChooser
from .run import DPEngine
from .step.component import StepComponent
from .step.optimizer import DPOptimizer


def _check_delta(delta: float, num_examples: int | None) -> None:
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"target_delta must be in (0, 1), got {delta!r}")
    if num_examples is not None and delta >= 1 / num_examples:
        raise ValueError(
            f"target_delta={delta:.3g} is not below 1/N = {1 / num_examples:.3g} for N = "
            f"{num_examples} examples: such a δ allows leaking whole examples; use δ ≪ 1/N, "
            f"e.g. {1 / num_examples ** 1.1:.2g}"
        )


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader,
    *,
    target_delta: float,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    clipping: str | Clipping = "auto-s",
    max_grad_norm: float | Mapping[str, float] = 1.0,
    groups: GroupSpec = "all-layer",
    loss_reduction: str = "mean",
    accountant: str = "pld",
    seed: int | None = None,
    secure_rng: bool = False,
    poisson_sampling: bool = True,
    max_physical_batch_size: int | None = None,
    physical_batch_size: int | None = None,
    clip_gamma: float | None = None,
    psac_r: float | None = None,
    noise_allocation: str = "global",
    thresholds: str | Thresholds = "fixed",
    target_quantile: float | None = None,
    quantile_lr: float | None = None,
    quantile_budget: float | None = None,
    lr: str | AutoLR | None = None,
    verify_every: int | None = None,
    audit_canaries: int | None = None,
    batch_dim: int | Mapping[str, int] = 0,
    public_buffers: list[str] | tuple[str, ...] = (),
) -> DPEngine:
    """Make ``model`` train with an (ε, δ)-DP guarantee, accounted exactly from every release.

    Args:
        model: any ``nn.Module`` in train mode; it is hooked in place and stays a plain module. A model
            wrapped in ``DistributedDataParallel`` trains as one private run across the processes
            (``docs/distributed.md``): each rank samples its shard, the clipped sums are all-reduced and
            the noise is added once in total.
        optimizer: any ``torch.optim.Optimizer`` over the model's trainable parameters.
        data_loader: a loader over the private data set; its ``batch_size`` sets the sampling rate
            q = batch_size / N and it is replaced by a Poisson-sampled loader (``engine.data_loader``).
        target_delta: δ of the guarantee; must be below 1/N.
        target_epsilon: the privacy budget ε; the noise is calibrated so that the planned run (``epochs``
            or ``steps``) spends at most this, within 1%.
        noise_multiplier: σ, instead of ``target_epsilon`` (0 disables privacy, for debugging: ε = ∞).
        epochs, steps: the planned length of training (one of them with ``target_epsilon``).
        clipping: ``"auto-s"`` (default), ``"auto-v"``, ``"psac"``, ``"abadi"`` (or a name added with
            ``tunefree.clipping.register_clip_function``), or typed: ``AutoS(gamma=0.01)``, ``AutoV()``,
            ``PSAC(r=0.1)``, ``Abadi()``.
        max_grad_norm: the sensitivity R of one example's clipped gradient (split as R/√K over K
            groups), or for explicit groups a mapping group name → threshold. With AUTO-S/V, R only
            rescales the update, which a learning rate absorbs.
        groups: ``"all-layer"``, ``"per-layer"``, ``"per-param"`` (or a name added with
            ``tunefree.grouping.register_grouping``), or explicit groups of parameter
            names (a list of lists, or a dict name → list).
        loss_reduction: ``"mean"`` or ``"sum"`` of the per-example losses over the batch.
        accountant: ``"pld"`` (tight, default) or ``"rdp"``.
        seed: ``None`` (default): sampling and noise are drawn from the OS's cryptographically
            secure generator. An int asks for a reproducible run (replayable bit for bit) — and
            anyone who knows it can remove the noise; the guarantee says so.
        secure_rng: the secure default, said explicitly (refused together with ``seed``).
        poisson_sampling: ``False`` keeps the user's loader as is; the guarantee is then reported as
            the Poisson approximation it is.
        physical_batch_size (alias ``max_physical_batch_size``): cut logical batches into
            micro-batches of at most this many
            examples; the optimizer steps (and the ledger records) once per logical batch.
        clip_gamma, psac_r: legacy forms of ``AutoS(gamma)`` and ``PSAC(r)``, the stability constants
            (no effect on privacy); valid only with that clipping.
        noise_allocation: how the gradient noise is spread over clip groups (``"global"``,
            ``"equal-budget"``, ``"weighted"``); the privacy cost is the same.
        thresholds: ``"fixed"``/``Fixed()`` (``max_grad_norm`` throughout) or ``"adaptive"``/
            ``AdaptiveQuantile(target=0.5, lr=0.3, budget=0.01)``: every step each
            group privately releases its count of examples below its estimate, which moves towards
            the ``target_quantile`` of the group's per-sample gradient norms (group-wise clipping
            paper, Algorithm 1); the estimates start at ``max_grad_norm``'s split. Abadi clipping
            clips at the estimates; AUTO-S/V and PSAC, whose thresholds only scale the update, take
            them as relative group scales at the constant total sensitivity of ``max_grad_norm``.
            σ (given or calibrated) is that of the step's joint release: the gradient gets σ/√(1−r).
        target_quantile, quantile_lr, quantile_budget: legacy forms of ``AdaptiveQuantile``'s
            fields, valid only with adaptive thresholds.
        target_quantile: q in (0, 1), the quantile of the norms each threshold tracks (default 0.5).
        quantile_lr: η, the geometric step of the update Cₖ ← Cₖ·exp(−η(b̃ₖ − q)) (default 0.3).
        quantile_budget: r in (0, 1), the fraction of the budget (of σ⁻², i.e. of Rényi-DP) spent on
            the count releases (default 0.01); the total stays ``target_epsilon``.
        lr: ``None`` keeps the optimizer's learning rate (and any scheduler). ``"auto"`` (``AutoLR()``)
            sets the step size of plain ``torch.optim.SGD`` from the released gradients alone: noise-aware
            DoG within a noise budget over the planned run (no release, no ε, no closure; see
            ``tunefree.autolr_dog``); after training, ``engine.dog_lr.apply_average()`` loads its
            averaged weights, the model to evaluate and keep. ``AutoLR(mode="safeguarded")``
            (or ``"paper"``) is HyFreeDP for any optimizer: GeN-DP every ``interval`` steps from privatised
            losses of the current batch, which ``optimizer.step(closure)`` must supply (the closure returns
            per-sample losses; with ``physical_batch_size``, those of the whole logical batch); the
            gradient noise grows by ``gradient_noise_increase`` and the loss noise is solved so that the
            whole run, every release included, spends what plain DP-SGD at σ would.
        verify_every: besides the check before the first release, re-check example independence
            (``tunefree.independence``) every this many steps; ``None``: once.
        batch_dim: where the model's layers carry the examples of a batch, for layers whose type does not
            fix it (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``, HF ``Conv1D``, custom
            modules): ``0`` (batch-first, the default), another dimension for the whole model and its
            inputs (``1``: time-major ``[T, B, …]``), or a mapping from module names to dimensions (``""``:
            the model itself; a module takes its closest named ancestor's entry), e.g.
            ``{"encoder": 1}``. Recurrent layers and ``nn.MultiheadAttention`` follow their
            ``batch_first``, convolutions and GroupNorm dimension 0. Privacy does not rest on it: a layer
            whose tensors do not show the batch's examples where declared is refused, and so is one whose
            examples mix (``verify_every``).
        audit_canaries: m, audit this run (``tunefree.audit.audit_training(engine)`` after training):
            m gradient canaries, each a member with probability ½, released with the gradient on a
            block of coordinates outside the model (``tunefree.privacy.canaries``). They touch no
            private data, so the ledger and ε are unchanged, and never reach the model or optimizer.
        public_buffers: names of buffers or module attributes (as ``model.named_buffers()`` spells them)
            that forward passes write from public information only, e.g. a cache that depends only on
            the sequence length. Every other change of the model's parameters, buffers and attributes
            between private steps, except the optimizer's update, is refused (``docs/refusals.md``);
            writes between steps that depend on public values only go inside
            ``with engine.public_writes():``.

    Any option given where it has no effect, or together with its typed form, is refused with a
    ``ValueError`` naming it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    parallel = sharded_data_parallel(model) or data_parallel(model)
    if not model.training:
        raise ValueError("the model is in eval mode: call model.train() before make_private")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters")
    options = resolve_options(
        target_delta=target_delta, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
        epochs=epochs, steps=steps, clipping=clipping, max_grad_norm=max_grad_norm, groups=groups,
        loss_reduction=loss_reduction, accountant=accountant, seed=seed, secure_rng=secure_rng,
        poisson_sampling=poisson_sampling, max_physical_batch_size=max_physical_batch_size,
        physical_batch_size=physical_batch_size, clip_gamma=clip_gamma, psac_r=psac_r,
        noise_allocation=noise_allocation, thresholds=thresholds, target_quantile=target_quantile,
        quantile_lr=quantile_lr, quantile_budget=quantile_budget, lr=lr, verify_every=verify_every,
        batch_dim=batch_dim)
    quantile, max_physical_batch_size = options.quantile, options.physical_batch_size
    auto = options.auto_lr
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}")
    if parallel is not None:
        _check_data_parallel_options(quantile, auto, poisson_sampling, audit_canaries,
                                     sharded=isinstance(parallel, ShardedDataParallel))
    if isinstance(parallel, ShardedDataParallel):
        check_sharded_options(max_physical_batch_size)

    randomness = run_randomness(seed, secure_rng)
    schedule = StepSchedule()
    num_examples, sample_rate = sample_rate_of(data_loader)
    if poisson_sampling:
        loader: Any = from_loader(data_loader, randomness, schedule, max_physical_batch_size,
                                  shard=(0, 1) if parallel is None else parallel.shard)
    else:  # resolve_options refused a physical batch size without the Poisson loader
        loader = data_loader
        warnings.warn(
            "poisson_sampling=False: the loader is not Poisson-sampled, so the reported ε is the "
            "Poisson approximation, not a proof of privacy", stacklevel=2)
    _check_delta(target_delta, num_examples)

    clip = options.clip
    module = model if parallel is None else parallel.module
    clip_groups = make_groups(module, groups, max_grad_norm)
    plan = Plan(
        sample_rate=sample_rate, steps=planned_steps(epochs, steps, sample_rate),
        num_examples=num_examples, delta=target_delta, accountant=accountant,
        noise_multiplier=0.0 if noise_multiplier is None else noise_multiplier,
        counts=None if quantile is None else CountShare(quantile.budget, len(clip_groups)),
        losses=None if auto is None or auto.releases_per_update == 0 else LossShare(
            auto.interval, auto.loss_privacy, auto.gradient_noise_increase, auto.releases_per_update),
        settings=_run_settings(clip, clip_groups, quantile, noise_allocation, loss_reduction,
                               data_loader.dataset, num_examples, auto),
    ).solve(target_epsilon)
    if parallel is not None:
        check_same_run(parallel, run_identity(plan.describe(), clip_groups, randomness))
    canaries = None if audit_canaries is None else GradientCanaries(
        audit_canaries, clip_groups, plan.sample_rate, canary_randomness(seed))
    return _build_engine(plan, model, optimizer, loader, randomness, schedule, clip, clip_groups,
                         quantile, noise_allocation, loss_reduction, poisson_sampling,
                         options.verify_every, parallel, canaries, options.batch_dim, public_buffers)


def _dog(optimizer: torch.optim.Optimizer, release: GradientRelease, plan: Plan) -> DistanceOverGradients:
    """The DoG rule of ``AutoLR(mode="dog")``: it sets the step size of plain SGD only."""
    plain = all(not (g.get("momentum") or g.get("weight_decay") or g.get("nesterov"))
                for g in optimizer.param_groups)
    if type(optimizer) is not torch.optim.SGD or not plain:
        raise ValueError(
            "lr='auto' (AutoLR(mode='dog')) sets the step size of plain SGD: pass "
            "torch.optim.SGD(model.parameters(), lr=1.0) without momentum or weight decay, or "
            "lr=tunefree.AutoLR(mode='safeguarded') (HyFreeDP) for another optimizer; "
            f"got {type(optimizer).__name__}")
    settings = plan.settings["auto_lr"]
    if plan.steps is None and settings["noise_budget"] is not None:
        raise ValueError("lr='auto' spends its noise budget over the planned run: give epochs or steps "
                         "(or lr=tunefree.AutoLR(noise_budget=None) for DoG without it)")
    return DistanceOverGradients(release, plan.expected_batch_size,
                                 initial_distance=settings["initial_distance"], planned_steps=plan.steps,
                                 noise_budget=settings["noise_budget"])


def _check_data_parallel_options(quantile: QuantileSettings | None, auto: AutoLR | None,
                                 poisson_sampling: bool, audit_canaries: int | None = None,
                                 sharded: bool = False) -> None:
    """Refuse what the data-parallel paths (DDP; FSDP2 when ``sharded``) do not reduce across ranks yet.
    DoG's learning rate reads only the released gradient and the weights, the same on every DDP rank;
    under FSDP2 both are sharded, and its norms are not reduced across shards."""
    kind = "FSDP2 (fully_shard)" if sharded else "DistributedDataParallel"
    hyfreedp = auto is not None and (sharded or auto.mode != "dog")
    unsupported = [name for name, used in (("thresholds='adaptive'", quantile is not None),
                                           (f"lr=AutoLR(mode={auto.mode!r})" if auto else "", hyfreedp),
                                           ("poisson_sampling=False", not poisson_sampling),
                                           ("audit_canaries", audit_canaries is not None)) if used]
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)} is not supported with {kind} yet (their "
            "releases are not reduced across ranks): use fixed thresholds, the optimizer's learning "
            "rate or lr='auto' (DDP only), and tunefree's Poisson sampling, or train in one process")


def _run_settings(clip: ClipFunction, groups: list[ClipGroup], quantile: QuantileSettings | None,
                  noise_allocation: str, loss_reduction: str, dataset: Any, num_examples: int,
                  auto: AutoLR | None = None) -> dict[str, Any]:
    """What identifies the run beyond its noise, for the plan's fingerprint."""
    learning_rate: dict[str, Any] = {}
    if auto is not None and auto.mode == "dog":
        learning_rate = {"auto_lr": {"mode": auto.mode, "initial_distance": auto.initial_distance,
                                     "noise_budget": auto.noise_budget}}
    elif auto is not None:
        learning_rate = {"auto_lr": {"mode": auto.mode, "probes": auto.probes, "initial_lr": auto.initial_lr}}
    return {**learning_rate, "clipping": {"name": clip.name, "gamma": clip.gamma, "r": clip.r},
            "groups": {g.name: [list(g.param_names), g.threshold] for g in groups},
            "thresholds": "fixed" if quantile is None else vars(quantile),
            "noise_allocation": noise_allocation, "loss_reduction": loss_reduction,
            "data": data_digest(dataset, num_examples)}


def _build_engine(plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
                  randomness: NoiseSource, schedule: StepSchedule, clip: ClipFunction,
                  clip_groups: list[ClipGroup], quantile: QuantileSettings | None,
                  noise_allocation: str, loss_reduction: str, poisson_sampling: bool,
                  verify_every: int | None, parallel: DataParallel | ShardedDataParallel | None = None,
                  canaries: GradientCanaries | None = None, batch_dim: int | Mapping[str, int] = 0,
                  public_buffers: list[str] | tuple[str, ...] = ()) -> DPEngine:
    """The run's parts, with every noise read off the solved ``plan``."""
    auto_lr = None
    if plan.losses is not None:
        policy = plan.settings.get("auto_lr", {})
        auto_lr = AutoLearningRate(plan.losses.interval, plan.loss_noise, plan.expected_batch_size,
                                   randomness, plan.losses.privacy, **policy)
        if auto_lr.releases_per_update != plan.losses.releases:
            raise ValueError("the plan's loss share does not match the learning-rate probes")
    estimator = None
    if quantile is not None:
        # Normalising clip functions keep the initial total sensitivity; Abadi's clips at the estimates
        # unless asked to rescale them (group-wise paper), which needs more than one group.
        rescale = clip.name != "abadi" or quantile.rescale
        if clip.name == "abadi" and quantile.rescale and len(clip_groups) < 2:
            raise ValueError("AdaptiveQuantile(rescale=True) with Abadi clipping rescales the thresholds of "
                             "several clip groups to a fixed total; with one group the threshold would "
                             "never move: use groups='per-layer' (or similar) or rescale=False")
        scale = sensitivity(clip_groups) if rescale else None
        estimator = QuantileEstimator(clip_groups, quantile, plan.count_std, randomness,
                                      plan.expected_batch_size, scale)
    if parallel is None:
        release = GradientRelease(clip_groups, plan.gradient_noise, randomness, noise_allocation)
        if canaries is not None:
            release = CanaryRelease(release, canaries)
    elif isinstance(parallel, ShardedDataParallel):
        release = ShardedRelease(clip_groups, plan.gradient_noise, randomness, noise_allocation, parallel)
    else:
        release = DistributedRelease(clip_groups, plan.gradient_noise, randomness, noise_allocation, parallel)
    lr_rule: StepComponent | None = auto_lr
    if plan.settings.get("auto_lr", {}).get("mode") == "dog":
        lr_rule = _dog(optimizer, release, plan)
    module = model if parallel is None else parallel.module
    ledger = Ledger(poisson_approximation=not poisson_sampling, seeded=not randomness.secret)
    # Hooks go on last, so that a refused argument leaves the model as it was given.
    # The engine books into it, the optimizer releases from it; FSDP2 keeps only this rank's shards.
    accumulator = ShardedAccumulator(parallel, clip_groups) if isinstance(parallel, ShardedDataParallel) \
        else StepAccumulator()
    clipping_engine = ClippingEngine(module, clip_groups, clip, loss_reduction, accumulator, batch_dim)
    clipping_engine.batch_source = schedule  # the Poisson loader tells the engine each batch's examples
    if randomness.replayable:  # a seeded run repeats bit for bit: no norm path picked by a timing
        clipping_engine.path_chooser = PathChooser(measure=False)
    if estimator is not None:
        clipping_engine.set_thresholds(estimator.thresholds())
    try:
        private_optimizer = DPOptimizer(optimizer, clipping_engine, release, ledger, plan.sample_rate,
                                        plan.expected_batch_size, schedule, accumulator, public_buffers)
    except ValueError:
        clipping_engine.detach()
        raise
    if parallel is not None:
        parallel.take_over()
    private_optimizer.components = [c for c in (estimator, lr_rule) if c is not None]
    private_optimizer.verify_every = verify_every
    if isinstance(parallel, ShardedDataParallel):
        private_optimizer.every_rank = parallel.every_rank
    private_optimizer.closure_gives_per_sample_losses = auto_lr is not None
    private_optimizer.planned_steps = plan.steps
    return DPEngine(model=model, optimizer=private_optimizer, data_loader=loader,
                    clipping_engine=clipping_engine, ledger=ledger, randomness=randomness,
                    schedule=schedule, groups=clip_groups, plan=plan, parallel=parallel,
                    canaries=canaries)
