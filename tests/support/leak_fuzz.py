"""The leak fuzzer: every drawn model and loop (``fuzz_draw``) must be exact under the neighbour test or
refused by tunefree. A draw that is neither is a finding, classified by the invariant it breaks and
shrunk to a minimal reproducer.

The oracle (``neighbour.compare_runs``, noise 0, Abadi at R, sampling rate 1, learning rate 0) checks:

- ``sensitivity``: every step of the run on D∖{j} within R of the same step on D, for every j;
- ``state``: the model's state after the run the same bit for bit on D and every D∖{j};
- ``carry``: a run whose earlier steps saw other data releases at its last step (on D) exactly what the
  run on D releases there;
- ``sampling``: a loop that feeds the model batches of its own loader (not ``engine.data_loader``) is
  refused before its first release, and no release comes from a batch that holds one example more than
  once (a sampler with replacement under ``poisson_sampling=False``: its sensitivity is a multiple of R);
- ``ledger``: a finished run's ledger holds every step taken (also across a resume), and a run without
  Poisson sampling says that its guarantee is the Poisson approximation;
- ``crash``: tunefree fails with an error it did not raise on purpose, on code plain PyTorch runs.

A finding's class (``classify``) is the invariant it breaks, read from the failed checks and what the
draw holds: state written or carried (also state on a class, in foreign objects, long containers, deques
and globals), mixing in the model or before it, a batch-wide scale in the backward, mixing in the loss
(a token mean over the batch, targets standardised by the batch), clip weights that read the batch, a
sampling or ledger fault, a batch-dependent sensitivity, or anything else.

Refused means a ``PrivacyError``, or a ValueError/TypeError/RuntimeError raised by a ``raise`` statement
in tunefree (a named refusal). A refusal after a leaky release does not excuse the release: released
steps are compared whatever happened later.

**Random check**: tunefree checks example independence and the inputs' provenance on random steps (each
with probability 1/verify_every), the independence check on a random half of the batch, so mixing is
caught with a stated probability, not with certainty (docs/refusals.md). A draw whose only violation is
sensitivity from mixing, and whose rerun checked at every step on every pair of examples releases
nothing beyond R, is counted as ``random-check``, apart from exact and from findings; a leak that such
checking still lets through stays a finding.

    from support.leak_fuzz import check; check(sample_draw(7))   # one draw
    python benchmarks/leak_fuzz.py --seeds 0:2000         # the long run
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from support.fuzz_draw import (
    CLIPPINGS,
    SAMPLERS,
    Draw,
    LoopSpec,
    R,
    draw_data,
    refused_by_tunefree,
    run_draw,
    run_plain,
    sample_draw,
)
from support.fuzz_zoo import (
    BATCH_SCALE_HOOKS,
    BLOCKS,
    MIXING_HOOKS,
    RECORDING_HOOKS,
    ROW_SCALE_HOOKS,
    STEM_LAYOUT,
    ModelSpec,
    build_model,
    keeps_state,
    scales_backward_by_batch,
)
from support.neighbour import MultiStepReport, RunTrace, StepExcess, compare_runs, release_distance

# Rounding: a float32/float64 release of N clipped gradients is exact to ~N·R·1e-7. Under bf16/fp16
# autocast the other examples' activations are computed by kernels that may block a batch of N and of
# N−1 examples differently, each rounding at 2⁻⁸ (bf16) relative: the neighbour distance may exceed R by
# that much without any leak. Leaks measured so far are ≥ 1.1·R.
TOLERANCE = {"float32": 1e-5, "float64": 1e-5, "bf16": 2.0 ** -7, "fp16": 2.0 ** -7}

WRITTEN = "model state written from the batch"
CARRIED = "state carried across batches"
MIXING_INSIDE = "mixing in the model the independence check misses"
MIXING_OUTSIDE = "mixing outside the model"
BACKWARD_SCALE = "a batch-wide scale in the backward"
MIXING_LOSS = "mixing in the loss"
CLIP_BATCH = "clip weights that read the batch"
BATCH_SENSITIVITY = "batch-dependent sensitivity"
SAMPLING = "sampling not as the guarantee says"
LEDGER = "ledger"
UNNOISED = "unnoised outputs"
OTHER = "anything else"
RANDOM_CHECK = "random-check"  # the verdict of a leak the random checks missed by chance (see check)
CLASSES = (WRITTEN, CARRIED, MIXING_INSIDE, MIXING_OUTSIDE, BACKWARD_SCALE, MIXING_LOSS, CLIP_BATCH,
           BATCH_SENSITIVITY, SAMPLING, LEDGER, UNNOISED, OTHER)


@dataclass
class Violation:
    check: str      # sensitivity | state | carry | sampling | ledger | crash
    detail: str
    ratio: float | None = None  # distance / R (sensitivity, carry)


@dataclass
class Outcome:
    draw: Draw
    verdict: str                # exact | refused | random-check | finding | invalid (plain PyTorch cannot
    #                             run it); random-check: a leak from mixing that the run's random checks
    #                             missed and checking every step catches (_missed_by_chance)
    violations: list[Violation] = field(default_factory=list)
    refusal: str | None = None  # the first refusal's type and first line
    invariant: str | None = None
    seconds: float = 0.0
    ratio: float = 0.0          # the largest neighbour distance over R (0: nothing compared)
    split_refusal: bool = False  # the run on D finished, yet a run on some D∖{j} was refused
    missed: str | None = None   # random-check: "unchecked step" or "random half" (_missed_by_chance)

    def line(self) -> str:
        what = "; ".join(f"{v.check}: {v.detail}" for v in self.violations)
        chance = f" (random check: {self.missed}; caught checking every step)" if self.missed else ""
        return f"[{self.invariant}] {what}{chance}\n    {self.draw!r}"


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def _crash(trace: RunTrace | None) -> str | None:
    if trace is None or trace.error is None or refused_by_tunefree(trace.error):
        return None
    return _first_line(trace.error)


def _violations(draw: Draw, report: MultiStepReport) -> list[Violation]:
    loop, full = draw.loop, report.full
    found: list[Violation] = []
    bound = R * (1 + TOLERANCE[loop.precision])
    if report.worst.distance > bound:
        w = report.worst
        found.append(Violation("sensitivity", f"{w.distance / R:.3g}·R at step {w.step} without example "
                                              f"{w.removed}", w.distance / R))
    if report.state_diffs:
        j, names = next(iter(report.state_diffs.items()))
        found.append(Violation("state", f"{names} differ on D and D∖{{{j}}} after the run"))
    if report.carry_distance:
        found.append(Violation("carry", f"last step's release moves by {report.carry_distance / R:.3g}·R "
                                        "with other data in the earlier steps", report.carry_distance / R))
    trained = sum(full.fed)  # a step whose subset came out empty trained on nothing: its release is noise
    if loop.loader == "own" and trained:
        found.append(Violation("sampling", f"{trained} step(s) released from the user's own loader's "
                                           "batches, accounted as Poisson samples"))
    runs = [("D", full), *((f"D∖{{{j}}}", n) for j, n in enumerate(report.neighbours)),
            ("carry", report.carry)]
    repeated = [(name, t, m) for name, run in runs if run is not None
                for t, (m, fed) in enumerate(zip(run.repeats, run.fed)) if m > 1 and fed]
    if repeated:
        name, t, m = max(repeated, key=lambda r: r[2])
        found.append(Violation("sampling", f"{len(repeated)} release(s) from batches that hold an example "
                                           f"more than once (the run on {name}, step {t}: {m} times), "
                                           "accounted at sensitivity R"))
    if full.state is not None:
        if full.ledger_steps != loop.steps:
            found.append(Violation("ledger", f"the ledger holds {full.ledger_steps} steps of {loop.steps} "
                                             "taken"))
        if loop.loader == "poisson-off" and not full.poisson_approximation:
            found.append(Violation("ledger", "poisson_sampling=False, yet the guarantee is not labelled "
                                             "the Poisson approximation"))
    crash = next((c for c in map(_crash, [full, *report.neighbours, report.carry]) if c is not None), None)
    if crash is not None:
        found.append(Violation("crash", crash))
    return found


def _plain_fails_where_private_crashed(draw: Draw, report: MultiStepReport, x, y, history) -> bool:
    """Whether plain PyTorch fails on the data of the first run that crashed: then the draw's own code
    cannot run there (e.g. an empty batch), and tunefree is not to blame."""
    data = [(x, y, None)] + [(torch.cat([x[:j], x[j + 1:]]), torch.cat([y[:j], y[j + 1:]]), None)
                             for j in range(len(report.neighbours))] + [(x, y, history)]
    runs = [report.full, *report.neighbours, report.carry]
    for trace, (a, b, h) in zip(runs, data):
        if _crash(trace) is not None:
            try:
                run_plain(draw, (a, b), h)
            except Exception:  # noqa: BLE001
                return True
            return False
    return False


def _mixes_in_model(spec: ModelSpec) -> bool:
    return any(b.kind == "mix" for b in spec.blocks) or any(h.kind in MIXING_HOOKS for h in spec.hooks)


def _scales_backward(draw: Draw) -> bool:
    """A scalar of the whole batch's gradient rescales it (a hook, a tensor hook, a Function), or each
    example's row is rescaled by its own statistic under a mean loss: the rescaling then takes the
    mean's 1/B out of some parameters' gradients but not others', so an example's clipped gradient
    depends on how many others the batch holds."""
    spec = draw.model
    return any(map(scales_backward_by_batch, spec.blocks)) or \
        any(h.kind in BATCH_SCALE_HOOKS for h in spec.hooks) or _rescales_a_mean(draw)


def _rescales_a_mean(draw: Draw) -> bool:
    """A per-example gradient rescaling (not linear in the loss) under a declared mean loss."""
    spec = draw.model
    per_example = any(b.kind == "grad_scale" and not scales_backward_by_batch(b) for b in spec.blocks) or \
        any(h.kind in ROW_SCALE_HOOKS for h in spec.hooks)
    return per_example and (draw.loop.declared or draw.loop.reduction) == "mean"


def _mixes_in_loss(loop: LoopSpec) -> bool:
    """A token mean over the whole batch, or targets standardised by the batch's statistics."""
    return (loop.loss == "token-ce" and loop.token_mean == "batch") or \
        (loop.loss == "mse" and loop.target_norm == "batch")


def _randomly_checked(draw: Draw) -> bool:
    """Whether the draw holds something the checks look for on random steps and halves: mixing in the
    model, before it or in the loss, or a batch-wide scale in the backward (which a gradient check may
    see)."""
    return draw.loop.mix_before is not None or _mixes_in_model(draw.model) or _scales_backward(draw) or \
        _mixes_in_loss(draw.loop)


def without_sampled_mixing(draw: Draw) -> Draw:
    """``draw`` without what the checks look for on random steps and halves (``_randomly_checked``): its
    mixing blocks and hooks, its gradient rescalings that read the batch (or that rescale a mean loss
    per example), its mixing before the model."""
    spec, loop = draw.model, draw.loop
    mean = (loop.declared or loop.reduction) == "mean"
    for i in reversed(range(len(spec.blocks))):
        b = spec.blocks[i]
        if b.kind == "mix" or (b.kind == "grad_scale" and (scales_backward_by_batch(b) or mean)):
            spec = _without_block(spec, i)
    sampled = MIXING_HOOKS | BATCH_SCALE_HOOKS | (ROW_SCALE_HOOKS if mean else set())
    spec = replace(spec, hooks=tuple(h for h in spec.hooks if h.kind not in sampled))
    return _consistent(replace(draw, model=spec, loop=replace(loop, mix_before=None, mix_start=0)))


def _writes_state(spec: ModelSpec) -> bool:
    return (spec.max_norm is not None or any(map(keeps_state, spec.blocks))
            or any(b.kwargs().get("running") for b in spec.blocks)
            or any(h.kind in RECORDING_HOOKS for h in spec.hooks))


def leak_features(draw: Draw) -> list[str]:
    """What in the draw may leak (and so may rightly be refused): a block that keeps state or mixes, a
    norm with running statistics or batch statistics, a mixing, recording or batch-scaling hook, a
    gradient rescaled by a batch statistic (or per example under a mean loss), a renormalising
    embedding, mixing before the model or in the loss, a clip function that reads the batch, a sampler
    that repeats examples, the user's own loader, a forgotten engine state, a wrongly declared loss
    reduction. A refusal of a draw with none of them refuses code that does not leak."""
    spec, loop = draw.model, draw.loop
    found = [b.kind for b in spec.blocks if b.kind == "mix" or keeps_state(b)]
    found += ["grad_scale over the batch"] if any(map(scales_backward_by_batch, spec.blocks)) else []
    found += ["gradient rescaled per example under a mean loss"] if _rescales_a_mean(draw) else []
    found += [f"{b.kwargs()['kind']} norm" for b in spec.blocks
              if b.kind == "norm" and (b.kwargs().get("running") or b.kwargs()["kind"] == "batch")]
    found += [h.kind for h in spec.hooks if h.kind in MIXING_HOOKS | RECORDING_HOOKS | BATCH_SCALE_HOOKS]
    found += ["max_norm"] if spec.max_norm is not None else []
    found += [f"mix_before={loop.mix_before}"] if loop.mix_before else []
    found += ["token mean over the batch"] if loop.loss == "token-ce" and loop.token_mean == "batch" else []
    found += ["targets standardised by the batch"] if loop.loss == "mse" and loop.target_norm == "batch" \
        else []
    found += [f"clipping={loop.clipping}"] if CLIPPINGS[loop.clipping] else []
    found += [f"sampler={loop.sampler}"] if SAMPLERS[loop.sampler] else []
    found += ["own loader"] if loop.loader == "own" else []
    found += ["forgotten engine state"] if not loop.resume_engine_state else []
    found += ["misdeclared loss_reduction"] if loop.declared not in (None, loop.reduction) else []
    return found


def classify(draw: Draw, violations: list[Violation], report: MultiStepReport | None) -> str:
    """The invariant a finding breaks, from the failed checks and what the (shrunk) draw contains."""
    checks = {v.check for v in violations}
    if "sampling" in checks:
        return SAMPLING
    if "ledger" in checks:
        return LEDGER
    if "sensitivity" in checks:
        if draw.loop.mix_before is not None:
            return MIXING_OUTSIDE
        if _mixes_in_model(draw.model):
            return MIXING_INSIDE
        if _scales_backward(draw):
            return BACKWARD_SCALE
        if _mixes_in_loss(draw.loop):
            return MIXING_LOSS
        if CLIPPINGS[draw.loop.clipping]:
            return CLIP_BATCH
    if "state" in checks and report is not None:
        params = {n for n, _ in build_model(draw.model, draw.seed).named_parameters()}
        if any(name in params for names in report.state_diffs.values() for name in names):
            return WRITTEN  # the weights themselves were written outside the private step
    if "carry" in checks or ("sensitivity" in checks and report is not None and report.worst.step > 0
                             and _writes_state(draw.model)):
        return CARRIED
    if "state" in checks:
        return WRITTEN
    if "sensitivity" in checks:
        return WRITTEN if _writes_state(draw.model) else BATCH_SENSITIVITY
    return OTHER


def _compare(draw: Draw, x, y, history, every_pair: bool = False
             ) -> tuple[MultiStepReport, list[Violation]] | None:
    """The neighbour comparison of ``draw`` and its violations (``None``: only the draw's own code
    failed, on data where plain PyTorch fails too). ``every_pair``: see ``fuzz_draw.EveryPairChecked``."""
    first = run_draw(draw, x, y, every_pair=every_pair)
    if first.error is not None and not first.releases:
        # refused (or crashed) before releasing anything: there is nothing to compare
        report = MultiStepReport(worst=StepExcess(), state_diffs={}, carry_distance=None, full=first,
                                 neighbours=[], carry=None)
    else:
        report = compare_runs(lambda a, b, h: run_draw(draw, a, b, h, every_pair), x, y, history,
                              full=first)
    violations = _violations(draw, report)
    if any(v.check == "crash" for v in violations) and \
            _plain_fails_where_private_crashed(draw, report, x, y, history):
        violations = [v for v in violations if v.check != "crash"]  # the draw's own code failed there
        if not violations:
            return None
    return report, violations


def leaky_steps(draw: Draw, report: MultiStepReport) -> list[tuple[int, int, bool]]:
    """Each (step, removed example, checked) whose neighbour distance exceeds R: ``checked`` when both
    runs checked that step before releasing it."""
    bound = R * (1 + TOLERANCE[draw.loop.precision])
    found = []
    for j, neighbour in enumerate(report.neighbours):
        for t, (a, b) in enumerate(zip(report.full.releases, neighbour.releases)):
            if release_distance(a, b) > bound:
                found.append((t, j, report.full.checked[t] and neighbour.checked[t]))
    return found


def _missed_by_chance(draw: Draw, violations: list[Violation], report: MultiStepReport, x, y,
                      history) -> str | None:
    """How the run's random checks missed mixing that the checks see, or ``None``.

    A run checks example independence and its inputs on random steps (each with probability
    1/verify_every), the independence check on a random half of the batch (a mixing pair is caught with
    probability ≥ 1/8 per check; ``ProbeSchedule``): a leak from mixing on a step they skip, or on a
    checked step whose half missed it, is the detection probability the design states, not a hole. It is
    that only when the only violation is sensitivity, the draw mixes (in the model or before it, or
    rescales its gradients by a statistic of the batch, which a gradient check may see), the draw without
    them (``without_sampled_mixing``) does not leak (``check``: the caller's), and the same draw checked
    at every step on every pair (``EveryPairChecked``) releases nothing beyond R
    (exact, or refused first); a leak that such checking still lets through stays a finding. Returns
    ``"unchecked step"`` (every leaky release was on a step the run did not check) or ``"random half"``
    (some leaky release was on a checked step)."""
    if any(v.check != "sensitivity" for v in violations) or not _randomly_checked(draw):
        return None
    again = _compare(draw, x, y, history, every_pair=True)
    if again is None or again[1]:
        return None
    leaks = leaky_steps(draw, report)
    return "random half" if any(checked for _, _, checked in leaks) else "unchecked step"


def check(draw: Draw) -> Outcome:
    """Run the oracle on one draw."""
    start = time.perf_counter()
    try:
        run_plain(draw)
    except Exception:  # noqa: BLE001 (plain PyTorch cannot run this draw: not ordinary code)
        return Outcome(draw, "invalid", seconds=time.perf_counter() - start)
    x, y = draw_data(draw)
    history = draw_data(draw, seed_offset=1) if draw.loop.steps > 1 else None
    compared = _compare(draw, x, y, history)
    if compared is None:
        return Outcome(draw, "invalid", seconds=time.perf_counter() - start)
    report, violations = compared
    errors = [t.error for t in [report.full, *report.neighbours, report.carry] if t is not None and t.error]
    refusal = next((_first_line(e) for e in errors if refused_by_tunefree(e)), None)
    verdict = "finding" if violations else "refused" if refusal else "exact"
    invariant = classify(draw, violations, report) if violations else None
    missed = None
    if violations and all(v.check == "sensitivity" for v in violations) and _randomly_checked(draw):
        rest = without_sampled_mixing(draw)
        apart = check(rest) if leak_features(rest) else None
        if apart is not None and apart.verdict == "finding":
            invariant = apart.invariant  # the rest leaks on its own: the class of its leak
        else:
            missed = _missed_by_chance(draw, violations, report, x, y, history)
    if missed is not None:
        verdict = RANDOM_CHECK
    split = report.full.error is None and any(t.error is not None and refused_by_tunefree(t.error)
                                              for t in report.neighbours)
    return Outcome(draw, verdict, violations, refusal, invariant, time.perf_counter() - start,
                   report.worst.distance / R, split, missed)


def fuzz(seeds, on_outcome=None, outside: bool = False) -> list[Outcome]:
    """``check`` every seed's draw (``on_outcome`` sees each as it comes; ``outside``: see
    ``fuzz_draw.sample_loop``)."""
    outcomes = []
    for seed in seeds:
        outcome = check(sample_draw(seed, outside))
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return outcomes


# ---------------------------------------------------------------------------------------- shrinking
def _valid(draw: Draw) -> bool:
    spec, loop = draw.model, draw.loop
    layout = STEM_LAYOUT[spec.inputs]
    if any(layout not in BLOCKS[b.kind][1] for b in spec.blocks):
        return False
    if any(h.at >= len(spec.blocks) for h in spec.hooks):
        return False
    if spec.inputs != "tokens" and (spec.max_norm is not None or spec.tied_head):
        return False
    if (spec.pool == "tokens") != (loop.loss == "token-ce") or (spec.pool != "mean" and layout != "seq"):
        return False
    if (loop.token_mean != "example" and loop.loss != "token-ce") or \
            (loop.target_norm is not None and loop.loss != "mse"):
        return False
    if loop.sampler is not None and loop.loader != "poisson-off":
        return False
    if any(b.kind == "recent_deque" and b.kwargs().get("maxlen", 2) > loop.steps for b in spec.blocks):
        return False  # a deque of recent batches is read within the run
    if loop.resume_at is not None and not 1 <= loop.resume_at < loop.steps:
        return False
    if loop.mix_start >= loop.steps or (loop.physical is not None and loop.loader != "poisson"):
        return False
    if not loop.resume_engine_state and loop.resume_at is None:
        return False
    mixes = {"tokens": ("token_swap",), "image": ("mixup", "standardise", "cutmix")}.get(
        spec.inputs, ("mixup", "standardise"))
    return loop.mix_before is None or loop.mix_before in mixes


def _without_block(spec: ModelSpec, i: int) -> ModelSpec:
    hooks = tuple(replace(h, at=h.at - 1 if h.at > i else h.at) for h in spec.hooks if h.at != i)
    return replace(spec, blocks=spec.blocks[:i] + spec.blocks[i + 1:], hooks=hooks)


def _consistent(draw: Draw) -> Draw:
    """``draw`` with the fields that depend on a simplified one set to match it: a prediction per token
    goes with the token loss (whichever of the two was simplified away), a sampler and a target
    standardisation, a token mean with what they belong to."""
    spec, loop = draw.model, draw.loop
    if spec.pool == "tokens" and loop.loss != "token-ce":
        spec = replace(spec, pool="mean")
    if loop.loss == "token-ce" and (spec.pool != "tokens" or STEM_LAYOUT[spec.inputs] != "seq"):
        loop = replace(loop, loss="ce")
        spec = replace(spec, pool="mean") if spec.pool == "tokens" else spec
    if loop.loss != "token-ce":
        loop = replace(loop, token_mean="example")
    if loop.loss != "mse":
        loop = replace(loop, target_norm=None)
    if loop.loader != "poisson-off":
        loop = replace(loop, sampler=None)
    return replace(draw, model=spec, loop=loop)


def simpler(draw: Draw) -> list[Draw]:
    """Drafts one simplification away from ``draw``: a block or hook fewer, a field at its default (and
    the fields that depend on it made consistent, ``_consistent``)."""
    spec, loop = draw.model, draw.loop
    models = [_without_block(spec, i) for i in range(len(spec.blocks))]
    models += [replace(spec, hooks=spec.hooks[:k] + spec.hooks[k + 1:]) for k in range(len(spec.hooks))]
    plain = ModelSpec()
    models += [replace(spec, **{f: getattr(plain, f)}) for f in ("max_norm", "tied_head", "pool")
               if getattr(spec, f) != getattr(plain, f)]
    if spec.inputs != "dense":
        models.append(replace(spec, inputs="dense", max_norm=None, tied_head=False, pool="mean"))
    drafts = [replace(draw, model=m) for m in models]
    default = LoopSpec()
    for f in loop.__dataclass_fields__:
        if getattr(loop, f) != getattr(default, f):
            drafts.append(replace(draw, loop=replace(loop, **{f: getattr(default, f)})))
    if loop.steps > 1:
        drafts.append(replace(draw, loop=replace(loop, steps=loop.steps - 1)))
    if loop.examples > 3:
        drafts.append(replace(draw, loop=replace(loop, examples=loop.examples - 1)))
    drafts = [_consistent(d) for d in drafts]
    return [d for d in drafts if _valid(d) and d != draw]


def shrink(draw: Draw, still_fails, budget: int = 200) -> Draw:
    """The smallest draw reached by taking simplifications one at a time while ``still_fails(draft)``
    holds (greedy, at most ``budget`` calls of ``still_fails``)."""
    calls = 0
    progress = True
    while progress and calls < budget:
        progress = False
        for draft in simpler(draw):
            calls += 1
            if still_fails(draft):
                draw, progress = draft, True
                break
            if calls >= budget:
                break
    return draw


def shrink_outcome(outcome: Outcome, budget: int = 200, keep=None) -> Outcome:
    """Shrink a finding to a minimal draw that still breaks the same invariant, or a refusal of a draw
    without leak features to a minimal draw refused the same way (and, if given, ``keep(outcome)`` still
    holds); returns the minimal draw's outcome."""
    cache: dict[str, Outcome] = {}

    def same(draft: Draw) -> bool:
        key = repr(draft)
        if key not in cache:
            cache[key] = check(draft)
        got = cache[key]
        if keep is not None and not keep(got):
            return False
        if outcome.verdict == "finding":
            return got.verdict == "finding" and got.invariant == outcome.invariant
        return got.verdict == "refused" and not leak_features(draft) and \
            (got.refusal or "")[:60] == (outcome.refusal or "")[:60]

    smallest = shrink(outcome.draw, same, budget)
    return cache.get(repr(smallest)) or outcome


def reproducer(draw: Draw) -> str:
    """A few lines that rerun the finding from ``tests/``."""
    return ("from support.fuzz_draw import Draw, LoopSpec\nfrom support.fuzz_zoo import B, Hook, ModelSpec\n"
            f"from support.leak_fuzz import check\nprint(check({draw!r}).line())")
