"""Runs one conformance case: the engine's clipped sums against the batch-size-1 autograd loop, or a refusal.

A case is exact when, in float64 with no noise, for each grouping (all-layer, per-layer) and each norm path
of its layers (ghost, materialised; one run when no layer has two), the engine's per-group norms and clipped
sums equal those of a plain loop over examples one at a time, and the example-independence check passes.
The batch is known by provenance, as the private loader gives it: the engine is told its count. Each
example's loss is ``Σ tanh(out_b) · W_b`` over its own output, so output gradients depend on the outputs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from support import pop_step
from support.brute_force import clipped_sum
from tunefree import verify_example_independence
from tunefree.clipping.functions import clip_function
from tunefree.clipping.groups import make_groups
from tunefree.errors import PrivacyError
from tunefree.persample.engine import ClippingEngine
from tunefree.rules.paths import PathChooser

GROUPINGS = ("all-layer", "per-layer")
CLIP = clip_function("auto-s")
EXAMPLES = 3  # the batch: three examples, so that the check probes first, middle and last


@dataclass(frozen=True)
class Case:
    """One layer configuration: its model, its inputs (one row per example in dimension ``root`` of each),
    where the user declares the examples (``batch_dim``), and what tunefree must do: ``refused`` (a regex
    of the refusal's message, and ``reason``, the true cause in words) or exact (``refused`` is None)."""

    family: str
    config: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple]
    batch_dim: Any = 0
    two_paths: bool = False
    refused: str | None = None
    reason: str = ""
    per_example: Callable[[tuple, int], tuple] | None = None  # example b's inputs (default: slice root dim)
    tags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def id(self) -> str:
        return f"{self.family}: {self.config}"

    @property
    def root(self) -> int:
        return self.batch_dim if isinstance(self.batch_dim, int) else self.batch_dim.get("", 0)


def _example_inputs(case: Case, inputs: tuple, b: int) -> tuple:
    if case.per_example is not None:
        return case.per_example(inputs, b)
    return tuple(
        x.narrow(case.root, b, 1) if isinstance(x, torch.Tensor) and x.dim() > case.root else x
        for x in inputs
    )


def _loss(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(out) * weights).sum()


def _model_and_inputs(case: Case, dtype: torch.dtype = torch.float64
                      ) -> tuple[nn.Module, tuple, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    torch.manual_seed(11)
    model = case.build().to(dtype).train()
    inputs = tuple(
        x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for x in case.inputs(generator)
    )
    with torch.no_grad():
        out = copy.deepcopy(model)(*inputs)
    weights = torch.randn(out.shape, generator=generator, dtype=dtype)
    return model, inputs, weights


def _forward(model: nn.Module, inputs: tuple, autocast: torch.dtype | None) -> torch.Tensor:
    """The model's output, in the weights' precision, from a forward in ``autocast`` (CPU) if given."""
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        return model(*inputs)


def _engine_run(
    case: Case,
    model: nn.Module,
    inputs: tuple,
    weights: torch.Tensor,
    grouping: str,
    path: str | None,
    check: bool,
    autocast: torch.dtype | None = None,
):
    groups = make_groups(model, grouping, 1.0)
    engine = ClippingEngine(model, groups, CLIP, loss_reduction="sum", batch_dim=case.batch_dim,
                            batch_source=SimpleNamespace(batch_serial=1, batch_examples=EXAMPLES),
                            path_chooser=PathChooser(measure=False, fixed=path))
    try:
        _loss(_forward(model, inputs, autocast).to(weights.dtype), weights).backward()
        sums, examples, norms = pop_step(engine)
        assert examples == EXAMPLES
        if check:
            verify_example_independence(model, engine, inputs, {}, examples=EXAMPLES)
    finally:
        engine.detach()
    assert all(p.grad is None for p in model.parameters()), "autograd must not compute ordinary gradients"
    return groups, sums, norms


def _reference(case: Case, model: nn.Module, inputs: tuple, weights: torch.Tensor, grouping: str,
               autocast: torch.dtype | None = None):
    groups = make_groups(model, grouping, 1.0)
    params = [p for p in model.parameters() if p.requires_grad]
    per_example = []
    for b in range(EXAMPLES):
        out = _forward(model, _example_inputs(case, inputs, b), autocast).to(weights.dtype)
        loss = _loss(out, weights.narrow(case.root, b, 1))
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        per_example.append({p: torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)})
    return groups, *clipped_sum(per_example, groups, CLIP)


def run(case: Case) -> str | None:
    """``None`` if the case is exact under every grouping and path; the refusal's message otherwise.
    A mismatch with the brute force fails the calling test (an AssertionError)."""
    model, inputs, weights = _model_and_inputs(case)
    reference = copy.deepcopy(model)
    runs = [
        (grouping, path)
        for grouping in GROUPINGS
        for path in (("ghost", "materialise") if case.two_paths else (None,))
    ]
    try:  # the independence check runs once: it does not depend on the grouping or the path
        results = [
            _engine_run(case, copy.deepcopy(model), inputs, weights, grouping, path, check=i == 0)
            for i, (grouping, path) in enumerate(runs)
        ]
    except (PrivacyError, ValueError) as refusal:
        return str(refusal)
    wanted = {grouping: _reference(case, reference, inputs, weights, grouping) for grouping in GROUPINGS}
    for (grouping, path), (groups, sums, norms) in zip(runs, results):
        _assert_same(case, groups, sums, norms, *wanted[grouping], grouping, path)
    return None


def _assert_same(case, groups, sums, norms, want_groups, want_sums, want_norms, grouping, path) -> None:
    where = f"{case.id} [{grouping}, {path or 'one path'}]"
    for g, ref_g in zip(groups, want_groups):
        torch.testing.assert_close(
            norms[g.name],
            want_norms[ref_g.name],
            rtol=1e-9,
            atol=1e-12,
            msg=lambda m, group=g.name: f"{where} norms of {group}: {m}",
        )
        for p, ref_p, name in zip(g.params, ref_g.params, g.param_names):
            torch.testing.assert_close(
                sums[p],
                want_sums[ref_p],
                rtol=1e-9,
                atol=1e-12,
                msg=lambda m, name=name: f"{where} {name}: {m}",
            )


def run_in_autocast(case: Case, dtype: torch.dtype) -> None:
    """An exact case's model in float32 trained under CPU autocast in ``dtype`` (per-layer groups, one
    path): the engine's norms and clipped sums agree with the batch-size-1 loop in the same autocast as
    closely as that loop's precision allows. Both round (the batch-1 kernels their activations, the rules
    convert 16-bit tensors to float32 exactly and compute there, recurrent ones recomputing the layer), so
    the tolerance is the larger of a few roundings (4 × 2⁻⁸ relative in bfloat16) and twice the distance
    the 16-bit precision itself moves the loop (its result in ``dtype`` against float32): a recurrent
    layer's fused 16-bit kernel rounds every time step, and the float32 recomputation is closer to the
    float32 loop than the 16-bit loop is."""
    eps = torch.finfo(dtype).eps / 2  # one rounding's relative error (2⁻⁸ in bfloat16)
    model, inputs, weights = _model_and_inputs(case, torch.float32)
    loop16, loop32 = copy.deepcopy(model), copy.deepcopy(model)
    groups, sums, norms = _engine_run(case, model, inputs, weights, "per-layer", None, check=False,
                                      autocast=dtype)
    groups16, sums16, norms16 = _reference(case, loop16, inputs, weights, "per-layer", dtype)
    groups32, sums32, norms32 = _reference(case, loop32, inputs, weights, "per-layer")
    for g, g16, g32 in zip(groups, groups16, groups32):
        got, want, other = norms[g.name].double(), norms16[g16.name].double(), norms32[g32.name].double()
        tolerance = torch.maximum(4 * eps * want, 2 * (want - other).abs()) + 1e-6
        assert ((got - want).abs() <= tolerance).all(), f"{case.id} norms of {g.name}: {got} vs {want}"
        for p, p16, p32, name in zip(g.params, g16.params, g32.params, g.param_names):
            got, want, other = sums[p].double(), sums16[p16].double(), sums32[p32].double()
            tolerance = max(4 * eps * want.abs().max(), 2 * (want - other).abs().max()) + 1e-6
            assert (got - want).abs().max() <= tolerance, f"{case.id} {name}"
