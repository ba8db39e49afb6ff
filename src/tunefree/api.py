"""``make_private``: the front door. Turns a model, an optimizer and a data loader into a private run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import dp_accounting as dpa
import torch
from torch import nn
from torch.utils.data import DataLoader

from .build import build_run, detect_parallel
from .clipping.functions import ClipFunction
from .clipping.groups import GroupSpec
from .config import LearningRateRule, RunConfig, Thresholds
from .run import DPEngine


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
    clipping: str | ClipFunction = "auto-s",
    max_grad_norm: float | Mapping[str, float] = 1.0,
    groups: GroupSpec = "all-layer",
    loss_reduction: str = "mean",
    accountant: str = "pld",
    seed: int | None = None,
    poisson_sampling: bool = True,
    physical_batch_size: int | None = None,
    noise_allocation: str = "global",
    thresholds: str | Thresholds = "fixed",
    lr: str | LearningRateRule | None = None,
    verify_every: int | None = None,
    audit_canaries: int | None = None,
    batch_dim: int | Mapping[str, int] = 0,
    public_buffers: list[str] | tuple[str, ...] = (),
    norm_path: str = "auto",
    prior_releases: Sequence[dpa.DpEvent] = (),
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
            ``tunefree.extend.register_clip_function``), or typed: ``AutoS(gamma=0.01)``, ``AutoV()``,
            ``PSAC(r=0.1)``, ``Abadi()``.
        max_grad_norm: the sensitivity R of one example's clipped gradient (split as R/√K over K
            groups), or for explicit groups a mapping group name → threshold. With AUTO-S/V, R only
            rescales the update, which a learning rate absorbs.
        groups: ``"all-layer"``, ``"per-layer"``, ``"per-param"`` (or a name added with
            ``tunefree.extend.register_grouping``), or explicit groups of parameter
            names (a list of lists, or a dict name → list).
        loss_reduction: ``"mean"`` or ``"sum"`` of the per-example losses over the batch.
        accountant: ``"pld"`` (tight, default) or ``"rdp"``.
        seed: ``None`` (default): sampling and noise are drawn from the OS's cryptographically
            secure generator. An int asks for a reproducible run (replayable bit for bit) — and
            anyone who knows it can remove the noise; the guarantee says so.
        poisson_sampling: ``False`` keeps the user's loader as is; the guarantee is then reported as
            the Poisson approximation it is.
        physical_batch_size: cut logical batches into micro-batches of at most this many examples;
            the optimizer steps (and the ledger records) once per logical batch.
        noise_allocation: how the gradient noise is spread over clip groups (``"global"``,
            ``"equal-budget"``, ``"weighted"``); the privacy cost is the same.
        thresholds: ``"fixed"``/``Fixed()`` (``max_grad_norm`` throughout) or ``"adaptive"``/
            ``AdaptiveQuantile(target=0.5, lr=0.3, budget=0.01)``: every step each
            group privately releases its count of examples below its estimate, which moves towards
            the ``target`` quantile of the group's per-sample gradient norms (group-wise clipping
            paper, Algorithm 1, with the geometric step ``lr`` η: Cₖ ← Cₖ·exp(−η(b̃ₖ − q))); the
            count releases spend a fraction ``budget`` of each step's budget (of σ⁻², i.e. of Rényi-DP)
            and the total stays ``target_epsilon``. The estimates start at ``max_grad_norm``'s split.
            Abadi clipping clips at the estimates; AUTO-S/V and PSAC, whose thresholds only scale the
            update, take them as relative group scales at the constant total sensitivity of
            ``max_grad_norm``.
            σ (given or calibrated) is that of the step's joint release: the gradient gets σ/√(1−r).
        lr: ``None`` keeps the optimizer's learning rate (and any scheduler). ``"auto"`` (``DoG()``)
            sets the step size of the optimizer from the released gradients alone: noise-aware DoG within
            a noise budget over the planned run (no release, no ε, no closure; see
            ``tunefree.components.dog``); after training, ``engine.lr_rule.apply_average()`` loads its
            averaged weights, the model to evaluate and keep. ``HyFreeDP()`` is the HyFreeDP paper's
            learning rate for any optimizer: GeN-DP every ``interval`` steps from privatised losses of the
            current batch, which ``optimizer.step(closure)`` must supply (the closure returns per-sample
            losses; with ``physical_batch_size``, those of the whole logical batch); the gradient noise
            grows by ``gradient_noise_increase`` and the loss noise is solved so that the whole run, every
            release included, spends what plain DP-SGD at σ would.
        verify_every: besides the first step's check (certain for every pair of examples, before the
            first release), each step checks example independence
            (``tunefree.verify_example_independence``) with probability 1/verify_every, at steps drawn
            from the run's secret randomness (``None``: 24, about 7% of a long run's time; 1: every
            step).
        audit_canaries: m, audit this run (``tunefree.audit.audit_training(engine)`` after training):
            m gradient canaries, each a member with probability ½, released with the gradient on a
            block of coordinates outside the model (``tunefree.privacy.canaries``). They touch no
            private data, so the ledger and ε are unchanged, and never reach the model or optimizer.
        batch_dim: where the model's layers carry the examples of a batch, for layers whose type does not
            fix it (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``, HF ``Conv1D``, custom
            modules): ``0`` (batch-first, the default), another dimension for the whole model and its
            inputs (``1``: time-major ``[T, B, …]``), or a mapping from module names to dimensions (``""``:
            the model itself; a module takes its closest named ancestor's entry), e.g.
            ``{"encoder": 1}``. Recurrent layers and ``nn.MultiheadAttention`` follow their
            ``batch_first``, convolutions and GroupNorm dimension 0. Privacy does not rest on it: a layer
            whose tensors do not show the batch's examples where declared is refused, and so is one whose
            examples mix (``verify_every``).
        public_buffers: names of buffers or module attributes (as ``model.named_buffers()`` spells them)
            that forward passes write from public information only, e.g. a cache that depends only on
            the sequence length. Every other change of the model's parameters, buffers and attributes
            between private steps, except the optimizer's update, is refused (``docs/refusals.md``);
            writes between steps that depend on public values only go inside
            ``with engine.public_writes():``.
        norm_path: ``"auto"`` (default), ``"formula"``, ``"ghost"`` or ``"materialise"``: how layers
            with two exact per-sample norm paths pick one (timed per layer shape; a seeded run follows
            the cost formula). Speed only: both paths give the exact norms.
        prior_releases: releases of the same private data made before training, as ``dp_accounting``
            DpEvents at their own fixed noise (e.g. a private category set or scaling the model's inputs
            depend on). The ledger holds them before the first step, and ``target_epsilon`` is the ε of
            the whole ledger: σ is calibrated on their composition with the planned steps (refused when
            they alone spend the target).

    Every setting is defined and validated once, in :class:`tunefree.config.RunConfig`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    parallel = detect_parallel(model)
    if not model.training:
        raise ValueError("the model is in eval mode: call model.train() before make_private")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters")
    config = RunConfig.from_keywords(
        target_delta=target_delta, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
        epochs=epochs, steps=steps, clipping=clipping, max_grad_norm=max_grad_norm, groups=groups,
        loss_reduction=loss_reduction, accountant=accountant, seed=seed, poisson_sampling=poisson_sampling,
        physical_batch_size=physical_batch_size, noise_allocation=noise_allocation, thresholds=thresholds,
        lr=lr, verify_every=verify_every, norm_path=norm_path, audit_canaries=audit_canaries,
        batch_dim=batch_dim, public_buffers=public_buffers, prior_releases=prior_releases)
    return build_run(config, model, optimizer, data_loader, parallel)
