"""Pipeline parallel with per-device clipping: a 2-stage pipeline on gloo, spawned here, against one process.

Each stage's parameters are one clip group with its own threshold; the pipeline's release must be that of
one process with the same two groups (noise-free: equal to 1e-6), with one event of sensitivity
√(R0² + R1²) in identical ledgers, noise of the allocation's variance on each stage, and nothing but
activations, their gradients and the Poisson sample crossing the stage boundary.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.gloo_harness import run_processes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tunefree
from tunefree.errors import PrivacyError
from tunefree.privacy.mechanisms import OneProcess

STAGES = 2
N, BATCH, SEED, STEPS = 64, 16, 7, 3
MICRO = 3  # the micro-batch (physical batch) size: a Poisson batch of ~16 is 5–6 micro-batches
R = (0.3, 0.8)  # the stages' thresholds: small enough that Abadi clipping clips
SPARSE_SEED = 14  # at batch_size=1 (q = 1/N) its first steps sample 1, 0 and 3 examples
SPREAD = (0.05, 20.0)  # thresholds below and above every norm: AUTO-S's normalised thresholds move
SIGMA = 1.3
HIDDEN = 8
DEADLINE_S = 90
COLLECTIVE_TIMEOUT_S = 10
NOISE_DRAWS = 10
WIDE = ((60, 40), (40, 30))  # the stages of the noise-variance scenario


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=generator),
                         torch.randint(0, 3, (N,), generator=generator))


def _stages() -> list[nn.Module]:
    torch.manual_seed(1)
    return [nn.Sequential(nn.Linear(6, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN)),
            nn.Sequential(nn.Tanh(), nn.Linear(HIDDEN, 3))]


def _stage(rank: int, noise_multiplier: float, module: nn.Module | None = None, batch_size: int = BATCH,
           **options):
    module = _stages()[rank] if module is None else module
    settings = {"clipping": "abadi", "physical_batch_size": MICRO, "seed": SEED, "steps": STEPS,
                "max_grad_norm": R[rank], **options}
    return tunefree.make_private_pipeline(
        module, torch.optim.SGD(module.parameters(), lr=0.5), DataLoader(_data(), batch_size=batch_size),
        stage_index=rank, num_stages=STAGES, target_delta=1e-3, noise_multiplier=noise_multiplier,
        loss_fn=F.cross_entropy if rank == STAGES - 1 else None, **settings)


def _one_process(noise_multiplier: float, initial: tuple[float, float] = R, batch_size: int = BATCH,
                 seed: int = SEED, **options) -> tuple[tunefree.DPEngine, list, list[dict]]:
    """The same run in this process: the stages composed, one clip group per stage. Returns the engine,
    each step's released gradients (per stage) and the thresholds each step left."""
    model = nn.Sequential(*_stages())
    groups = {f"stage{k}": [f"{k}.{n}" for n, _ in stage.named_parameters()] for k, stage in enumerate(model)}
    engine = tunefree.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(_data(), batch_size=batch_size),
        noise_multiplier=noise_multiplier, target_delta=1e-3, steps=STEPS,
        **{"clipping": "abadi", **options}, groups=groups, physical_batch_size=MICRO, seed=seed,
        max_grad_norm={"stage0": initial[0], "stage1": initial[1]})
    released, thresholds, batches = [], [], iter(engine.data_loader)
    for _ in range(STEPS):
        last = False
        while not last:
            x, y = next(batches)
            last = engine.schedule.ends_logical
            engine.optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            engine.optimizer.step()
        released.append([[p.grad.clone() for p in stage.parameters()] for stage in model])
        thresholds.append(engine.clip_thresholds)
    return engine, released, thresholds


# ---------------------------------------------------------------------------- the 2-process harness
def _run_stages(scenario, tmp_path: Path) -> list[dict]:
    return run_processes(scenario, tmp_path, world=STAGES, deadline_s=DEADLINE_S,
                         collective_timeout_s=COLLECTIVE_TIMEOUT_S)


_COMMUNICATIONS = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce", "all_gather", "reduce",
                   "gather", "scatter", "reduce_scatter", "all_to_all", "all_gather_object",
                   "broadcast_object_list", "batch_isend_irecv", "barrier", "all_reduce_coalesced")


class _Wiretap:
    """Records every torch.distributed communication (name, dtype, shape) while it is installed."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.dtype | None, tuple[int, ...] | None]] = []
        self.originals = {name: getattr(dist, name) for name in _COMMUNICATIONS if hasattr(dist, name)}

    def __enter__(self):
        for name, function in self.originals.items():
            setattr(dist, name, self._tapped(name, function))
        return self

    def __exit__(self, *exc):
        for name, function in self.originals.items():
            setattr(dist, name, function)

    def _tapped(self, name, function):
        def tapped(*args, **kwargs):
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            self.seen.append((name, None if tensor is None else tensor.dtype,
                              None if tensor is None else tuple(tensor.shape)))
            return function(*args, **kwargs)
        return tapped


# ---------------------------------------------------------------------------- scenarios (run per stage)
def _training_scenario(rank: int) -> dict:
    out: dict = {}
    quiet = _stage(rank, 0.0)
    released = []
    with _Wiretap() as tap:
        for _ in range(STEPS):
            quiet.step()
            released.append([p.grad.clone() for p in quiet.module.parameters()])
    out["quiet_released"], out["communications"] = released, tap.seen
    sparse = _stage(rank, 0.0, batch_size=1, seed=SPARSE_SEED)  # steps of 1, 0 and 3 examples
    out["sparse_released"] = []
    for _ in range(STEPS):
        sparse.step()
        out["sparse_released"].append([p.grad.clone() for p in sparse.module.parameters()])
    noisy = _stage(rank, SIGMA)
    losses = [noisy.step() for _ in range(STEPS)]
    out["losses"] = losses
    out["ledger"], out["epsilon"] = noisy.ledger.state_dict(), noisy.epsilon()
    out["sensitivity"] = noisy.sensitivity
    out["stds"] = noisy.release.noise_stds(noisy.engine.clip_thresholds)
    for allocation in ("global", "equal-budget"):  # the noise of the release alone (zero sums)
        torch.manual_seed(3)
        wide = _stage(rank, SIGMA, module=nn.Linear(*WIDE[rank]), noise_allocation=allocation)
        draws = [wide.release.release({}, wide.engine.clip_thresholds)[0] for _ in range(NOISE_DRAWS)]
        out[f"noise {allocation}"] = torch.cat([t.reshape(-1) for d in draws for t in d.values()])
    rescaled = tunefree.AdaptiveQuantile(rescale=True)
    for name, sigma, clipping, r, rule in (("adaptive abadi", 0.0, "abadi", R, "adaptive"),
                                           ("adaptive auto-s", 0.0, "auto-s", SPREAD, "adaptive"),
                                           ("adaptive rescaled", 0.0, "abadi", SPREAD, rescaled),
                                           ("adaptive noisy", SIGMA, "abadi", R, "adaptive")):
        adaptive = _stage(rank, sigma, thresholds=rule, clipping=clipping, max_grad_norm=r[rank])
        out[name] = {"released": [], "thresholds": [], "stage thresholds": []}
        for _ in range(STEPS):
            adaptive.step()
            out[name]["released"].append([p.grad.clone() for p in adaptive.module.parameters()])
            out[name]["thresholds"].append(adaptive.engine.clip_thresholds)
            out[name]["stage thresholds"].append(adaptive.stage_thresholds())
        out[name]["ledger"] = adaptive.ledger.state_dict()
    try:
        _stage(rank, SIGMA if rank == 0 else 2 * SIGMA)
    except PrivacyError as error:
        out["mismatch"] = str(error)
    return out


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> list[dict]:
    return _run_stages(_training_scenario, tmp_path_factory.mktemp("pipeline"))


# ---------------------------------------------------------------------------- tests
@pytest.mark.distributed
def test_noise_free_release_equals_one_process_with_a_group_per_stage(pipeline):
    _, reference, _ = _one_process(0.0)
    for step in range(STEPS):
        for rank in range(STAGES):
            for ours, theirs in zip(pipeline[rank]["quiet_released"][step], reference[step][rank]):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert all(any(g.abs().max() > 1e-3 for g in stage) for stage in reference[0])  # not zeros


@pytest.mark.distributed
def test_an_empty_poisson_batch_releases_noise_only_and_a_single_example_passes(pipeline):
    from tunefree.privacy.randomness import SeededSource

    assert [int(SeededSource(SPARSE_SEED).inclusion(t, N, 1 / N).sum()) for t in range(STEPS)] == [1, 0, 3]
    _, reference, _ = _one_process(0.0, batch_size=1, seed=SPARSE_SEED)
    for step in range(STEPS):
        for rank in range(STAGES):
            for ours, theirs in zip(pipeline[rank]["sparse_released"][step], reference[step][rank]):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert all(g.abs().max() == 0 for stage in reference[1] for g in stage)  # the empty step
    assert all(any(g.abs().max() > 0 for g in stage) for stage in reference[2])


@pytest.mark.distributed
def test_the_release_is_one_event_of_sensitivity_sqrt_sum_of_squares_in_identical_ledgers(pipeline):
    first, second = pipeline
    assert first["ledger"] == second["ledger"]
    assert first["sensitivity"] == second["sensitivity"] == pytest.approx(math.hypot(*R), rel=1e-12)
    single, _, _ = _one_process(SIGMA)
    assert single.sensitivity == pytest.approx(math.hypot(*R), rel=1e-12)
    assert first["ledger"] == single.ledger.state_dict()  # STEPS sampled Gaussian events of σ
    assert math.isfinite(single.epsilon())
    assert first["epsilon"] == second["epsilon"] == single.epsilon()


@pytest.mark.parametrize("name", ["abadi", "auto-s", "rescaled"])
@pytest.mark.distributed
def test_adaptive_thresholds_per_stage_equal_one_process_with_adaptive_group_thresholds(pipeline, name):
    """Noise-free, each stage's count is exact: its thresholds (for AUTO-S, and Abadi's rescaled ones,
    at the common scale of every stage's estimate) and releases follow the one-process run's groups step
    by step, and every stage knows every stage's threshold for its noise."""
    initial = R if name == "abadi" else SPREAD
    options = {"clipping": "abadi" if name != "auto-s" else "auto-s",
               "thresholds": tunefree.AdaptiveQuantile(rescale=True) if name == "rescaled" else "adaptive"}
    _, reference, history = _one_process(0.0, initial, **options)
    for step in range(STEPS):
        everyone = [history[step][f"stage{k}"] for k in range(STAGES)]
        for rank in range(STAGES):
            ours = pipeline[rank][f"adaptive {name}"]
            assert ours["thresholds"][step] == pytest.approx({f"stage{rank}": everyone[rank]}, rel=1e-9)
            assert list(ours["stage thresholds"][step]) == pytest.approx(everyone, rel=1e-9)
            for mine, theirs in zip(ours["released"][step], reference[step][rank]):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    assert history[-1] != history[0] != {"stage0": initial[0], "stage1": initial[1]}  # they did move


@pytest.mark.distributed
def test_adaptive_stages_record_the_joint_count_release_in_identical_ledgers(pipeline):
    first, second = (out["adaptive noisy"] for out in pipeline)
    assert first["ledger"] == second["ledger"]
    single, _, _ = _one_process(SIGMA, thresholds="adaptive")
    # gradient and K counts, one sampled event per step: ε, a function of the ledger, is the same too
    assert first["ledger"] == single.ledger.state_dict()


@pytest.mark.distributed
def test_global_allocation_gives_every_stage_sigma_times_the_total_sensitivity(pipeline):
    expected = SIGMA * math.hypot(*R)
    for rank in pipeline:
        assert rank["stds"] == [pytest.approx(expected, rel=1e-12)]


@pytest.mark.parametrize("allocation", ["global", "equal-budget"])
@pytest.mark.distributed
def test_each_stage_draws_the_variance_of_its_allocation(pipeline, allocation):
    """Global: σ·S on every coordinate. Equal budget: stage k gets c·Rₖ with Σ(Rₖ/(c·Rₖ))² = 1/σ², i.e.
    c = σ√K. Each stage's own threshold here is max_grad_norm=R[k]."""
    total = math.hypot(*R)
    for rank, out in enumerate(pipeline):
        noise = out[f"noise {allocation}"].double()
        std = SIGMA * total if allocation == "global" else SIGMA * math.sqrt(STAGES) * R[rank]
        ratio = noise.var().item() / std**2
        assert abs(ratio - 1) < 0.06, (rank, ratio)  # ≥ 12 300 draws: relative std of the estimate ≤ 1.3%
        assert abs(noise.mean().item()) < 5 * std / math.sqrt(noise.numel())


@pytest.mark.distributed
def test_stages_draw_independent_noise(pipeline):
    """A seeded run derives each stage's noise stream from the seed and the stage: the same numbers on
    two stages would let one stage's release cancel the other's noise."""
    first, second = (out["noise global"].double() for out in pipeline)
    n = min(first.numel(), second.numel())
    a, b = first[:n] - first[:n].mean(), second[:n] - second[:n].mean()
    correlation = (a @ b / (a.norm() * b.norm())).item()
    assert abs(correlation) < 5 / math.sqrt(n)


@pytest.mark.distributed
def test_only_activations_their_gradients_and_the_sample_cross_the_stage_boundary(pipeline):
    """No per-sample norm (a 1-D tensor of the micro-batch's size) and no collective beyond the
    broadcast of each step's Poisson sample travels: per-device clipping communicates nothing of its own."""
    header = (torch.int64, (10,))
    for out in pipeline:
        seen = out["communications"]
        assert {name for name, _, _ in seen} <= {"send", "recv", "broadcast"}
        broadcasts = [(dtype, shape) for name, dtype, shape in seen if name == "broadcast"]
        assert broadcasts == [(torch.uint8, (N,))] * STEPS  # one Poisson sample per step
        messages = [(dtype, shape) for name, dtype, shape in seen if name in ("send", "recv")]
        payloads = [m for m in messages if m != header]
        assert len(payloads) == len(messages) // 2 > 0  # each payload after its header
        for dtype, shape in payloads:
            assert dtype == torch.float32 and len(shape) == 2
            assert shape[1] == HIDDEN and 1 <= shape[0] <= MICRO
        sent = [shape for name, _, shape in seen if name == "send" and shape != header[1]]
        received = [shape for name, _, shape in seen if name == "recv" and shape != header[1]]
        assert sent == received  # activations one way, their gradients the other, micro-batch by micro-batch


@pytest.mark.distributed
def test_the_last_stage_returns_the_micro_batch_losses(pipeline):
    first, last = pipeline
    assert first["losses"] == [None] * STEPS
    assert all(len(step) >= 1 and all(loss.dim() == 0 for loss in step) for step in last["losses"])


@pytest.mark.distributed
def test_stages_set_up_differently_are_refused(pipeline):
    assert "stage 1 was set up differently" in pipeline[0]["mismatch"]
    assert "stage 0 was set up differently" in pipeline[1]["mismatch"]


def test_a_pipeline_stage_needs_torch_distributed():
    module = nn.Linear(6, 3)
    with pytest.raises(ValueError, match="init_process_group"):
        tunefree.make_private_pipeline(module, torch.optim.SGD(module.parameters(), lr=0.1),
                                       DataLoader(_data(), batch_size=BATCH), stage_index=0, num_stages=2,
                                       target_delta=1e-3, noise_multiplier=1.0, steps=1)


@pytest.mark.parametrize("settings, error, match", [
    ({"groups": "per-layer"}, ValueError, "one clip group: drop groups"),
    ({"max_grad_norm": {"stage0": 1.0}}, ValueError, "clip threshold Rₖ, a number"),
    ({"audit_canaries": 4}, ValueError, "audit_canaries is not supported in a pipeline"),
    ({"clip_gamma": 0.1}, TypeError, "unexpected settings clip_gamma"),
])
def test_settings_a_stage_does_not_run_are_refused_before_anything(settings, error, match):
    """The settings are make_private's keywords, forwarded; those a stage cannot run are refused before the
    process group is even looked at."""
    module = nn.Linear(6, 3)
    with pytest.raises(error, match=match):
        tunefree.make_private_pipeline(module, torch.optim.SGD(module.parameters(), lr=0.1),
                                       DataLoader(_data(), batch_size=BATCH), stage_index=0, num_stages=2,
                                       target_delta=1e-3, noise_multiplier=1.0, steps=1, **settings)


class _OtherStage(OneProcess):
    """One process standing in for stage 0 of two: stage 1's group is elsewhere, at threshold (or
    estimate) ``other``."""

    def __init__(self, other: float):
        self.other = other

    def all_groups(self, own):
        return {**own, "stage1": (self.other, 7)}


def test_an_adaptive_stage_checkpoint_restores_every_stage_estimate():
    """The common scale of a stage's threshold is over every stage's estimate: a resumed stage must not
    fall back to the initial ones. Its release always noises for every stage's current threshold, asked
    of the stages at the release."""
    from tunefree.clipping.groups import ClipGroup
    from tunefree.components.thresholds import AdaptiveQuantile, QuantileEstimator
    from tunefree.privacy.mechanisms import GradientRelease
    from tunefree.privacy.randomness import SecretSource

    def stage_estimator(other: float) -> QuantileEstimator:
        module = nn.Linear(4, 2)
        group = ClipGroup("stage0", ["weight", "bias"], list(module.parameters()), R[0])
        return QuantileEstimator([group], AdaptiveQuantile(), 2.0, scale=1.0, parallelism=_OtherStage(other))

    saved = stage_estimator(R[1])
    assert saved.joint_counts == STAGES  # its count is one of the two stages' joint release
    saved.quantiles["stage0"], saved.estimates = 0.5, {"stage0": 0.5, "stage1": 3.0}
    resumed = stage_estimator(R[1])
    resumed.load_state_dict(saved.state_dict())
    assert resumed.estimates == {"stage0": 0.5, "stage1": 3.0}
    assert resumed.thresholds() == {"stage0": pytest.approx(0.5 / math.hypot(0.5, 3.0))}
    with pytest.raises(ValueError, match="estimates of the run's 2 clip groups"):
        resumed.load_state_dict({"quantiles": {"stage0": 1.0}, "unclipped_fractions": None})
    group = resumed.groups[0]
    release = GradientRelease([group], SIGMA, SecretSource(), "global", _OtherStage(3.0))
    assert release.noise_stds({"stage0": 0.5}) == [pytest.approx(SIGMA * math.hypot(0.5, 3.0))]
